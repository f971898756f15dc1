"""Shared fixtures: free ports, the ``kvpush`` CLI as a subprocess, real ``serve-*`` endpoints.

``kvpush_run`` runs one CLI command to completion. ``serve`` is a ``tests.support.procs.Launcher``
for the test (``serve.start(role, *args)`` starts a real ``python -m kvpush serve-*`` process and
waits for its ``--ready-file``; all are stopped at teardown with SIGTERM, then SIGKILL);
``pd_pair`` is a module-wide P and D with a small geometry. Every child gets
``procs.clean_env``: no ``KVPUSH_*`` variables of the caller, ``NO_COLOR=1``, a wide ``COLUMNS``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpush.commands.common import ports
from tests.support.etcd import EtcdServer
from tests.support.procs import KVPUSH, Launcher, Proc, clean_env, wait_ready

SMALL = ["--num-blocks", "64", "--layers", "2", "--block-bytes", "4096"]

# The CLI suites' names for the launcher's types.
Served = Proc
ServeFactory = Launcher
cli_env = clean_env


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``slow`` test runs only when the run selects it (``-m slow``, as ``make test-slow``
    and CI do) or with ``KVPUSH_RUN_SLOW=1``: ``make test`` stays short."""
    if item.get_closest_marker("slow") is None or os.environ.get("KVPUSH_RUN_SLOW") == "1":
        return
    expr = str(item.config.getoption("markexpr") or "")
    if "slow" not in expr.replace("not slow", ""):
        pytest.skip("slow test: run with -m slow (or KVPUSH_RUN_SLOW=1)")


def unused_port() -> int:
    """A TCP port nobody listens on right now, outside the ephemeral range
    (``kvpush.commands.common.ports``)."""
    return ports.free_port()


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str

    @property
    def err_lines(self) -> list[str]:
        """stderr lines that the CLI's error path writes (``error:`` / ``hint:``)."""
        return [ln for ln in self.stderr.splitlines() if ln.startswith(("error:", "hint:"))]


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, cwd: str | None = None
) -> Done:
    p = subprocess.run(
        [*KVPUSH, *args],
        capture_output=True,
        text=True,
        env=env or clean_env(),
        timeout=timeout,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )
    return Done(p.returncode, p.stdout, p.stderr)


@pytest.fixture
def kvpush_run() -> Callable[..., Done]:
    """Run ``python -m kvpush ARGS...`` to completion: ``Done(returncode, stdout, stderr)``."""
    return run_cli


@pytest.fixture
def make_env() -> Callable[..., dict[str, str]]:
    """``make_env(NAME=value, ...)``: the children's clean environment plus these variables."""
    return clean_env


@pytest.fixture
def free_port() -> int:
    return unused_port()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Launcher]:
    f = Launcher(tmp_path)
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    """One small P and one small D for a whole test module."""
    f = Launcher(tmp_path_factory.mktemp("pd"))
    try:
        p = f.serve("prefill", *SMALL, wait=False)
        d = f.serve("decode", *SMALL, wait=False)
        wait_ready(p)
        wait_ready(d)
        yield p, d
    finally:
        f.close()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd server on free loopback ports, for one test (stopped at teardown)."""
    server = EtcdServer(tmp_path / "etcd-data").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd on https that demands a client certificate (``.pki``: CA, client cert)."""
    from tests.support.etcd_tls import TlsEtcdServer, make_pki, openssl_missing

    missing = openssl_missing()
    if missing:
        pytest.skip(missing)
    server = TlsEtcdServer(tmp_path / "etcd-tls", make_pki(tmp_path / "pki")).start()
    try:
        yield server
    finally:
        server.stop()

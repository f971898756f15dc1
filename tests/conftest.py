"""Shared fixtures: free ports, the ``kvpush`` CLI as a subprocess, real ``serve-*`` endpoints.

``kvpush_run`` runs one CLI command to completion. ``serve`` starts a real
``python -m kvpush serve-prefill|serve-decode`` process, waits for its ``--ready-file`` and
stops it at teardown with SIGTERM, then SIGKILL; ``pd_pair`` is a module-wide P and D with a
small geometry. Every child gets the environment without the caller's ``KVPUSH_*`` variables,
with ``NO_COLOR=1`` and a wide ``COLUMNS`` so that output is stable.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

KVPUSH = [sys.executable, "-m", "kvpush"]
SMALL = ["--num-blocks", "64", "--layers", "2", "--block-bytes", "4096"]


def unused_port() -> int:
    """A TCP port nobody listens on right now (bound and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")}
    env.update({"NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


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
        env=env or cli_env(),
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
    return cli_env


@pytest.fixture
def free_port() -> int:
    return unused_port()


@dataclass
class Served:
    role: str
    proc: subprocess.Popen[bytes]
    ready_file: Path
    log: Path
    info: dict[str, object] = field(default_factory=dict)
    returncode: int | None = None

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal, wait; SIGKILL after ``timeout``. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        return self.returncode


class ServeFactory:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Served] = []

    def start(
        self,
        role: str,
        *args: str,
        wait: bool = True,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        output: str | None = "json",
    ) -> Served:
        n = len(self.procs)
        ready = self.tmp / f"{role}-{n}.ready.json"
        log = self.tmp / f"{role}-{n}.log"
        cmd = [*KVPUSH, f"serve-{role}", "--ready-file", str(ready), "--interval", "0.5"]
        if output is not None:
            cmd += ["-o", output]
        if "--port" not in args:
            cmd += ["--port", "0"]
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [*cmd, *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env or cli_env(),
                stdin=subprocess.DEVNULL,
            )
        s = Served(role, proc, ready, log)
        self.procs.append(s)
        if wait:
            wait_ready(s, timeout)
        return s

    def close(self) -> None:
        for s in self.procs:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        for s in self.procs:
            s.stop()


def wait_ready(s: Served, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if s.ready_file.exists():
            s.info = json.loads(s.ready_file.read_text())
            return
        if s.proc.poll() is not None:
            raise AssertionError(
                f"serve-{s.role} exited with {s.proc.returncode} before it was ready:\n"
                + s.log_text()
            )
        time.sleep(0.05)
    raise AssertionError(f"serve-{s.role} not ready within {timeout}s:\n" + s.log_text())


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[ServeFactory]:
    f = ServeFactory(tmp_path)
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Served]]:
    """One small P and one small D for a whole test module."""
    f = ServeFactory(tmp_path_factory.mktemp("pd"))
    try:
        p = f.start("prefill", *SMALL, wait=False)
        d = f.start("decode", *SMALL, wait=False)
        wait_ready(p)
        wait_ready(d)
        yield p, d
    finally:
        f.close()

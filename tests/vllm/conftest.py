"""Fixtures for the vLLM interop suite (marker ``vllm``; ``make test-vllm`` runs it).

``vllm_p`` / ``vllm_d`` are module-scoped: one real vLLM P and one real vLLM D per test module,
started together (their slow vLLM imports overlap) and stopped at the module's end, whatever
happened. A module sets their lease by overriding the ``vllm_lease`` fixture, or starts more
processes alongside them by overriding ``vllm_pair``. Work directories live in one temporary
directory per module (``vllm_tmp``), removed at teardown (kept with KVPUSH_KEEP_VLLM_TMP=1); a
failing assertion carries the peer's status and log tail instead.

The suite needs the vLLM virtualenv (``scripts/vllm-venv.sh``), so a run that did not select
the marker (``-m vllm``, or ``KVPUSH_RUN_VLLM=1``) skips it: ``make test`` deselects it anyway.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import VllmPeer, start_many, stop_many, vllm_python

_REASON = "vLLM interop test: run with -m vllm (make test-vllm) or KVPUSH_RUN_VLLM=1"


def _selected(config: pytest.Config) -> bool:
    expr = str(config.getoption("markexpr") or "")
    return os.environ.get("KVPUSH_RUN_VLLM") == "1" or "vllm" in expr.replace("not vllm", "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.vllm)
            if not _selected(config):
                item.add_marker(pytest.mark.skip(reason=_REASON))


@pytest.fixture(scope="session")
def vllm_py() -> str:
    """The vLLM venv's python (``KVPUSH_VLLM_PYTHON`` or ``scripts/vllm-venv.sh``)."""
    return vllm_python()


@pytest.fixture(scope="module")
def vllm_tmp() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvpush-vllm-"))
    try:
        yield d
    finally:
        if os.environ.get("KVPUSH_KEEP_VLLM_TMP"):  # debugging: keep logs, wire taps, status
            print(f"\nkept {d}")
        else:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def vllm_lease() -> int:
    """kv_lease_duration (s) of the module's vLLM peers; override in a module to change it."""
    return 30


@pytest.fixture(scope="module")
def vllm_pair(vllm_py: str, vllm_tmp: Path, vllm_lease: int) -> Iterator[tuple[VllmPeer, VllmPeer]]:
    peers = start_many(
        [
            ("P", vllm_tmp / "vllm-P", {"lease": vllm_lease}),
            ("D", vllm_tmp / "vllm-D", {"lease": vllm_lease}),
        ],
        python=vllm_py,
    )
    try:
        yield peers[0], peers[1]
    finally:
        stop_many(peers)


@pytest.fixture(scope="module")
def vllm_p(vllm_pair: tuple[VllmPeer, VllmPeer]) -> VllmPeer:
    """A real vLLM prefill engine (kv_producer), shared by the module."""
    return vllm_pair[0]


@pytest.fixture(scope="module")
def vllm_d(vllm_pair: tuple[VllmPeer, VllmPeer]) -> VllmPeer:
    """A real vLLM decode engine (kv_consumer), shared by the module."""
    return vllm_pair[1]

"""``serve-decode --prewarm``'s warm-up of D's own request path (``kvpush.decode.warmup``): a real
pool and a real executor. It runs on the completer's thread, only reads (no block allocated or
changed), is said in the rank's telemetry info, and a warm-up that cannot run leaves the
endpoint to start all the same. No timing is asserted."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvpush.config import PoolConfig, Role
from kvpush.decode.warmup import WARMED, warm_reads, warm_request_path
from kvpush.memory.pool import KvPool
from kvpush.telemetry.store import Telemetry

pytestmark = pytest.mark.timeout(60)


def _pool(num_blocks: int = 16) -> KvPool:
    return KvPool(PoolConfig(num_blocks=num_blocks, layers=2, block_bytes=256, dtype="uint8"))


def test_warm_up_runs_the_completers_reads_on_its_thread_and_changes_nothing() -> None:
    pool = _pool()
    ids = np.arange(pool.cfg.num_blocks, dtype=np.int64)
    pool.fill("held-by-nobody", ids)  # bytes to compare before and after
    before = pool.digest(ids)
    counts = pool.allocator.counts()
    tm = Telemetry(Role.DECODE, "d")
    ex = ThreadPoolExecutor(1, thread_name_prefix="completer-under-test")
    try:
        assert warm_request_path(pool, ex, tm, 0)
        # The completer's thread was started by the warm-up, not by a first request.
        assert any(t.name.startswith("completer-under-test") for t in threading.enumerate())
    finally:
        ex.shutdown(wait=True)
    assert tm.snapshot().info.get("warmup") == WARMED
    assert pool.digest(ids) == before  # read only
    assert pool.allocator.counts() == counts  # nothing allocated or left held


def test_warm_up_of_a_one_block_pool() -> None:
    pool = _pool(num_blocks=1)
    assert warm_reads(pool) >= 0.0
    assert pool.allocator.counts() == _pool(num_blocks=1).allocator.counts()


def test_a_warm_up_that_cannot_run_is_said_and_the_rank_starts_anyway(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = _pool()
    tm = Telemetry(Role.DECODE, "d")
    ex = ThreadPoolExecutor(1)
    ex.shutdown()  # a stopped completer: submit refuses
    with caplog.at_level(logging.WARNING, logger="kvpush.decode.warmup"):
        assert not warm_request_path(pool, ex, tm, 1)
    assert "decode rank 1: warming the request path failed" in caplog.text
    assert "warmup" not in tm.snapshot().info

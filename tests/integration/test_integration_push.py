"""Real NIXL, real ZMQ, separate processes on 127.0.0.1: P pushes to two (then three) Ds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.legs import Outcome, run_many, run_request, stats
from tests.support.procs import Proc, endpoints

pytestmark = pytest.mark.integration

POOL = {"num_blocks": 512, "layers": 2, "block_bytes": 64 * 1024}


def _gauges(addr: str) -> dict[str, float]:
    g = stats(addr)["gauges"]
    assert isinstance(g, dict)
    return g


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    with endpoints(tmp_path, POOL) as start:
        yield start


def _wait_idle(addr: str, key: str, want: float, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        g = _gauges(addr)
        if g[key] == want or time.monotonic() > deadline:
            return g
        time.sleep(0.05)


def test_one_p_two_d_then_a_slow_third_d_joins(cluster) -> None:
    p = cluster("prefill", "p")
    d1 = cluster("decode", "d1")
    d2 = cluster("decode", "d2")
    start_free = {a: _gauges(a)["pool_free"] for a in (p.address, d1.address, d2.address)}

    # Phase 1: 120 requests of 4 blocks, round robin over D1 and D2.
    items = [(f"a{i}", p.address, (d1, d2)[i % 2].address, 4) for i in range(120)]
    t0 = time.perf_counter()
    out = run_many(items, concurrency=8)
    elapsed = time.perf_counter() - t0
    bad = [o for o in out if o.rep.outcome != "ok" or o.rep.verified is not True]
    assert not bad, bad[:3]
    nbytes = sum(o.rep.nbytes for o in out)
    hist = stats(p.address)["histograms"]
    assert isinstance(hist, dict)
    write_s = hist["write_duration"]["sum"]
    print(
        f"\nphase 1: {len(out)} requests, {nbytes / 1e6:.1f} MB in {elapsed:.2f}s: "
        f"{nbytes / elapsed / 1e9:.2f} GB/s end to end (side-channel legs, fill, verify); "
        f"{nbytes / write_s / 1e9:.2f} GB/s mean per-WRITE rate "
        "(bytes / summed WRITE time; WRITEs overlap)"
    )

    # Phase 2: D3 joins mid-run; its handshake reply is 1.5 s late. D1's pushes keep flowing.
    d3 = cluster("decode", "d3", handshake_reply_delay_s=1.5)
    d3_result: list[Outcome] = []
    t3 = threading.Thread(
        target=lambda: d3_result.append(run_request("join-0", p.address, d3.address, 4))
    )
    t3.start()
    time.sleep(0.2)  # D3's handshake with P (both directions) is now pending
    during = run_many([(f"b{i}", p.address, d1.address, 4) for i in range(40)], concurrency=4)
    t3.join(30)
    assert d3_result and d3_result[0].rep.outcome == "ok" and d3_result[0].rep.verified
    assert all(o.rep.outcome == "ok" and o.rep.verified for o in during)
    # Every D1 request sent while D3's handshake was pending finished before D3's first push.
    assert max(o.t_done for o in during) < d3_result[0].t_done, (
        "D1 pushes stalled behind D3's handshake"
    )
    p_snap = stats(p.address)
    peers = p_snap["peers"]
    assert isinstance(peers, list) and len(peers) == 3
    assert all(row["state"] == "connected" and row["mode"] == "full" for row in peers)

    # Pools return to their starting counts; nothing quarantined.
    for addr in (p.address, d1.address, d2.address):
        g = _wait_idle(addr, "pool_free", start_free[addr])
        assert g["pool_free"] == start_free[addr], (addr, g)
        assert g["pool_quarantined"] == 0
    counters = p_snap["counters"]
    assert isinstance(counters, dict)
    assert counters["pushes_ok"] == 161
    assert p_snap["failures"] == {}

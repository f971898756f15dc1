"""Tensor-parallel endpoints under failure (issue 9): one rank of D (or P) dies mid-run.

Real processes, real NIXL, loopback. A rank's owner loop is killed by the fault hook
``crash_rank_after`` (as a bug in that rank's thread would kill it): the requests it held fail at
once with ``rank_failed`` naming the rank, the other ranks' shares are cancelled (their blocks
come back), the endpoint exits non-zero with the failure in its log, and the peer keeps serving
everyone else with its pools back to where they started.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import cluster_ctx
from tests.support.fault_legs import Result, run_leg
from tests.support.invariants import check_results, fresh_batch, settle
from tests.support.side import gauges, snapshot
from tests.support.waits import wait_for

pytestmark = pytest.mark.integration

# Four heads of 4 KiB per region: every TP size here divides them.
TP_POOL = {"num_blocks": 256, "layers": 2, "block_bytes": 16 * 1024, "kv_heads": 4}


def _pool(tp: int) -> dict[str, object]:
    return {**TP_POOL, "block_bytes": int(TP_POOL["block_bytes"]) // tp}


def _load_until_dead(c: Any, name: str, p_addr: str, d_addr: str, n: int) -> list[Result]:
    """``n`` requests, four at a time, until process ``name`` has exited (the rest are not
    sent: a dead side channel just swallows requests until the client's timeout)."""
    proc = c.procs[name]

    def one(i: int) -> Result | None:
        if proc.popen.poll() is not None:
            return None
        return run_leg(f"k{i}", p_addr, d_addr, 4, d_timeout_s=10, p_timeout_s=3)

    with ThreadPoolExecutor(4) as ex:
        return [r for r in ex.map(one, range(n)) if r is not None]


def _rank_free(address: str) -> list[float]:
    return [r["gauges"]["pool_free"] for r in snapshot(address)["ranks"]]


def test_d_rank_killed_mid_run(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p", tp_size=2, pool=_pool(2))
        d = c.start("decode", "d", tp_size=2, pool=_pool(2), crash_rank_after=[1, 24])
        d2 = c.start("decode", "d2", tp_size=1, pool=_pool(1))
        p_free = _rank_free(p.address)
        res = _load_until_dead(c, "d", p.address, d.address, 80)
        reasons = check_results(res, allowed={"rank_failed", "cancelled", "d_unreachable"})
        assert reasons["ok"] >= 10 and reasons["rank_failed"] >= 1, reasons
        named = [r for r in res if r.reason == "rank_failed"]
        assert all("D rank 1" in r.detail for r in named), named[:3]
        # Failed at once, not at the request deadline (6 s here).
        assert max(r.latency_s for r in named) < 3.0, [r.latency_s for r in named]
        rc, log = c.crashed("d")
        assert rc != 0 and "rank 1" in log and "crashed" in log, log[-2000:]
        # P serves the other D, and its pools come back (D rank 1's registrations that never
        # came are given back by P's lease).
        fresh_batch(p.address, [d2.address], n=16)
        settle(p.address, timeout_s=10, quarantine_clears=True)
        wait_for(lambda: _rank_free(p.address) == p_free, 10, "P's ranks back to their start")
        assert snapshot(p.address)["failures"].get("internal_error", 0) == 0


def test_p_rank_killed_mid_run(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p", tp_size=2, pool=_pool(2), crash_rank_after=[1, 24])
        d = c.start("decode", "d", tp_size=2, pool=_pool(2))
        d_start = gauges(d.address)
        res = _load_until_dead(c, "p", p.address, d.address, 80)
        reasons = check_results(
            res,
            allowed={
                "rank_failed",
                "cancelled",
                "prefill_dead",
                "prefill_unreachable",
                "shutting_down",  # P stops once a rank failed: its other rank drains
            },
        )
        assert reasons["ok"] >= 10 and reasons["rank_failed"] >= 1, reasons
        named = [r for r in res if r.reason == "rank_failed"]
        assert all("P rank 1" in r.detail for r in named), named[:3]
        rc, log = c.crashed("p")
        assert rc != 0 and "rank 1" in log, log[-2000:]
        # D lost nothing: every block of both ranks comes back once P is gone.
        g = settle(d.address, timeout_s=10, quarantine_clears=True)
        assert g["pool_free"] == d_start["pool_free"], g

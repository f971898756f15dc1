"""Block ownership under faults (issue 5, tests 6 and 10): D aborts after PUSH_REG, and pools
that run out.

Test 6 is vLLM's C1: D gives up on a request after its PUSH_REG while P may be writing; if D
reused those blocks at once, P's late bytes would corrupt the next owner. Every request here
goes through the same D, whose allocator hands released blocks out again first (LIFO), and D
verifies every byte of every successful request.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpush.wire import protocol
from tests.support.cluster import cluster_ctx
from tests.support.fault_legs import Result, run_leg
from tests.support.invariants import check_results, fresh_batch, settle
from tests.support.procstats import ProcStats
from tests.support.side import counters, failures, gauges, request
from tests.support.waits import wait_for

pytestmark = pytest.mark.integration

# Bigger blocks than the other fault tests: a push is 12 MiB, so WRITEs take long enough for
# aborts to land while bytes are moving.
ABORT_POOL = {"num_blocks": 512, "layers": 2, "block_bytes": 64 * 1024}
ABORT_BLOCKS = 48  # 12 MiB per push


def test_d_aborts_after_push_reg_under_load(tmp_path: Path) -> None:
    rng = random.Random(5)
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p", pool=ABORT_POOL)
        d = c.start("decode", "d", pool=ABORT_POOL)
        fresh_batch(p.address, [d.address], n=4, blocks=ABORT_BLOCKS)
        d_start = ProcStats.of(d.popen.pid)

        # Interleave aborting requests (D's deadline passes around the time P pushes: before
        # P finished, while the WRITE is in flight, or just after) with normal ones.
        plan: list[tuple[str, float, float]] = []
        for i in range(120):
            if i % 3 == 2:
                plan.append((f"keep-{i}", 0.0, rng.uniform(0.0, 0.05)))
            else:
                # Some race the WRITE itself, some abort before P has finished its blocks.
                if i % 3 == 1:
                    plan.append((f"abort-{i}", rng.uniform(0.005, 0.06), rng.uniform(0, 0.01)))
                else:
                    plan.append((f"abort-{i}", rng.uniform(0.005, 0.03), rng.uniform(0.03, 0.1)))

        def one(item: tuple[str, float, float]) -> Result:
            tid, deadline, p_delay = item
            return run_leg(
                tid, p.address, d.address, ABORT_BLOCKS, deadline_s=deadline, p_delay_s=p_delay
            )

        with ThreadPoolExecutor(6) as ex:
            results = list(ex.map(one, plan))
        reasons = check_results(results, allowed={"deadline"})
        keep = [r for r in results if r.tid.startswith("keep-")]
        assert all(r.outcome == "ok" for r in keep), [r for r in keep if r.outcome != "ok"][:3]
        assert reasons["deadline"] >= 20, reasons  # enough aborts to mean something

        # The blocks' next owners: a fresh batch through the same D, every byte verified.
        fresh_batch(p.address, [d.address], n=24, blocks=ABORT_BLOCKS, prefix="next")
        gp = settle(p.address, quarantine_clears=True)
        gd = settle(d.address, quarantine_clears=True)
        cp, cd = counters(p.address), counters(d.address)
        print(
            "aborts:",
            dict(reasons),
            "P cancels:",
            cp.get("cancels_received"),
            "D quarantine released:",
            cd.get("quarantine_released"),
            "P failures:",
            failures(p.address),
        )
        assert cp.get("cancels_received", 0) >= reasons["deadline"] // 2, cp
        assert cd.get("quarantine_released", 0) >= 1, cd  # some aborts raced a push
        # Pushes P made for requests D had already abandoned: their blocks were quarantined
        # on D until the WRITE's own completion (or a fence) said no more bytes would land.
        raced = cp.get("pushes_ok", 0) - (4 + reasons["ok"] + 24)
        print("aborted requests whose WRITE still ran:", raced)
        assert gp["pool_free"] == gp["pool_total"] and gd["pool_free"] == gd["pool_total"]
        d_start.assert_bounded(ProcStats.of(d.popen.pid), "D after aborts")


def test_pool_exhaustion_refuses_at_once(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p", pool={"num_blocks": 64, "layers": 2, "block_bytes": 16384})
        d = c.start("decode", "d", pool={"num_blocks": 64, "layers": 2, "block_bytes": 16384})
        fresh_batch(p.address, [d.address], n=4)

        # More than the whole pool: refused at once, nothing allocated.
        r = run_leg("huge", p.address, d.address, 65, send_p=False)
        assert r.outcome == "failed" and r.reason == "no_free_blocks", r
        assert r.latency_s < 1.0, r
        rep = request(p.address, protocol.PrefillReq(transfer_id="huge-p", num_blocks=65))
        assert rep.outcome == "failed" and rep.reason == "no_free_blocks", rep
        for a in (p.address, d.address):
            g = gauges(a)
            assert g["pool_free"] == 64 and g["pool_allocated"] == 0, g

        # D: 5 x 12 blocks registered and waiting; a request for 8 more is refused at once and
        # the pool holds exactly the 60 blocks of the waiting requests (nothing half-allocated).
        waiting: list[Result] = []
        ts = [
            threading.Thread(
                target=lambda i=i: waiting.append(
                    run_leg(f"w-{i}", p.address, d.address, 12, p_delay_s=1.5)
                )
            )
            for i in range(5)
        ]
        for t in ts:
            t.start()
        wait_for(lambda: gauges(d.address)["pool_allocated"] == 60, 30, "D to hold 60 blocks")
        t0 = time.monotonic()
        r = run_leg("one-too-many", p.address, d.address, 8, send_p=False)
        assert r.outcome == "failed" and r.reason == "no_free_blocks", r
        assert time.monotonic() - t0 < 1.0, "refusal was not immediate"
        g = gauges(d.address)
        assert (g["pool_allocated"], g["pool_free"]) == (60, 4), g
        # A request that fits still goes through while the pool is nearly full.
        ok = run_leg("fits", p.address, d.address, 4)
        assert ok.outcome == "ok" and ok.verified, ok
        for t in ts:
            t.join(20)
        assert check_results(waiting) == {"ok": 5}

        # P: blocks finished for transfers no D registered yet hold P's pool; the next prefill
        # that does not fit is refused at once and P's pool holds exactly the finished blocks.
        for i in range(5):
            rep = request(p.address, protocol.PrefillReq(transfer_id=f"pf-{i}", num_blocks=12))
            assert rep.outcome == "ok", rep
        rep = request(p.address, protocol.PrefillReq(transfer_id="pf-x", num_blocks=8))
        assert rep.outcome == "failed" and rep.reason == "no_free_blocks", rep
        g = gauges(p.address)
        assert (g["pool_allocated"], g["pool_free"]) == (60, 4), g
        # D registers for them now: they complete, and P's blocks come back.
        late = [run_leg(f"pf-{i}", p.address, d.address, 12, send_p=False) for i in range(5)]
        assert check_results(late) == {"ok": 5}
        assert failures(p.address).get("no_free_blocks", 0) >= 2
        assert failures(d.address).get("no_free_blocks", 0) >= 2
        for a in (p.address, d.address):
            g = settle(a, quarantine_clears=True)
            assert g["pool_free"] == 64, g
        fresh_batch(p.address, [d.address], n=8, prefix="after")

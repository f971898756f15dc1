"""Peer death, freeze and restart (issue 5, tests 1-4): real processes, real NIXL on 127.0.0.1.

Every test checks the invariants of ``tests.support.invariants``: every request ends ok (verified by
D) or failed with a reason; pools return to their start (or differ by exactly the quarantined
blocks); handles, threads and memory stay bounded; the survivors serve a fresh batch afterwards.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvpush.commands.common.ports import free_port
from kvpush.wire import protocol
from tests.support.cluster import cluster_ctx
from tests.support.fault_legs import Result, run_leg
from tests.support.invariants import check_results, fresh_batch, settle
from tests.support.procstats import ProcStats
from tests.support.side import counters, failures, gauges, request, snapshot
from tests.support.waits import wait_for

pytestmark = pytest.mark.integration
# Longer than the write deadline plus the fence deadline: the fence must be retried.
FREEZE_S = 4.0


def _load(
    p: str,
    d: str,
    n: int,
    prefix: str,
    blocks: int = 8,
    concurrency: int = 6,
    stop: threading.Event | None = None,
    **kw: Any,
) -> tuple[threading.Thread, list[Result]]:
    """Run ``n`` requests in the background; the list fills when they have all ended. Once
    ``stop`` is set no new request starts (a router stops sending work to a dead peer)."""
    out: list[Result] = []
    halt = stop or threading.Event()

    def one(i: int) -> Result | None:
        if halt.is_set():
            return None
        return run_leg(f"{prefix}-{i}", p, d, blocks, **kw)

    def go() -> None:
        with ThreadPoolExecutor(concurrency) as ex:
            out.extend(r for r in ex.map(one, range(n)) if r is not None)

    t = threading.Thread(target=go, name=f"load-{prefix}")
    t.start()
    return t, out


@pytest.mark.slow
def test_d_killed_before_and_during_pushes(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")
        d1 = c.start("decode", "d1")
        d2 = c.start("decode", "d2")
        d3 = c.start("decode", "d3")
        fresh_batch(p.address, [d1.address, d2.address, d3.address], n=12)
        p_start = ProcStats.of(p.popen.pid)

        # Before: D1 registered four requests, then died before P finished their blocks.
        regd: list[Result] = []
        ts = [
            threading.Thread(
                target=lambda i=i: regd.append(
                    run_leg(f"pre-{i}", p.address, d1.address, 4, send_p=False, d_timeout_s=3)
                )
            )
            for i in range(4)
        ]
        for t in ts:
            t.start()
        wait_for(lambda: snapshot(p.address)["gauges"]["regs_waiting_blocks"] == 4, 30, "PUSH_REGs")
        c.kill("d1")
        # P finishes the blocks now: its WRITEs hit a dead peer.
        for i in range(4):
            rep = request(p.address, protocol.PrefillReq(transfer_id=f"pre-{i}", num_blocks=4))
            assert rep.outcome == "ok", rep
        # And blocks D1 will never register for: P's lease (3 s) gives them back.
        for i in range(3):
            rep = request(p.address, protocol.PrefillReq(transfer_id=f"orphan-{i}", num_blocks=4))
            assert rep.outcome == "ok", rep
        for t in ts:
            t.join(15)
        assert [r.reason for r in regd] == ["d_unreachable"] * 4, regd

        # During: load on D2 and D3; D3 is SIGKILLed while its pushes flow.
        t2, out2 = _load(p.address, d2.address, 40, "ok2")
        dead = threading.Event()
        t3, out3 = _load(p.address, d3.address, 400, "die3", stop=dead, d_timeout_s=4)
        wait_for(lambda: counters(d3.address).get("requests_ok", 0) >= 20, 20, "D3 load")
        c.kill("d3")
        dead.set()
        t2.join(60)
        t3.join(60)
        assert check_results(out2) == {"ok": 40}, "D2 was disturbed by D3's death"
        r3 = check_results(out3)
        assert r3["ok"] > 0 and r3["d_unreachable"] > 0, r3

        g = settle(p.address, timeout_s=8)
        assert g["pool_quarantined"] == 0, g  # a dead peer can land nothing: no quarantine
        snap = snapshot(p.address)
        rows = {r["peer"]: r for r in snap["peers"]}
        # P pushed to D1 after its death: it noticed at once, removed the agent, and the
        # re-handshake of the next push failed. D3 is noticed at P's next NIXL call to it (if
        # its last registrations were all served, there is none: the idle TTL removes it).
        assert d1.address not in rows or rows[d1.address]["state"] == "failed", rows
        assert rows.get(d3.address, {}).get("state") != "connecting", rows
        assert rows[d2.address]["state"] == "connected"
        f = snap["failures"]
        print("P failures:", f, "P peers:", rows)
        assert f.get("lease_expired", 0) >= 3, f  # the orphans (and die3 legs D never sent)
        dead_kinds = (
            "peer_dead",
            "write_post_failed",
            "write_error",
            "handshake_failed",
            "decode_unreachable",
        )
        assert sum(f.get(k, 0) for k in dead_kinds) >= 4, f  # the pre-registered pushes
        fresh_batch(p.address, [d2.address], n=16)
        settle(d2.address, quarantine_clears=True)
        p_start.assert_bounded(ProcStats.of(p.popen.pid), "P after two D deaths")


@pytest.mark.slow
def test_d_frozen_then_resumed(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")
        d1 = c.start("decode", "d1")
        d2 = c.start("decode", "d2")
        fresh_batch(p.address, [d1.address, d2.address], n=8)
        p_start = ProcStats.of(p.popen.pid)

        # D1 registers 6 requests, is frozen, then P finishes their blocks: WRITEs into a
        # stopped process stay in progress until kvpush's own write deadline catches them.
        t1, out1 = _load(
            p.address, d1.address, 6, "frozen", concurrency=6, p_delay_s=1.0, d_timeout_s=20
        )
        wait_for(lambda: snapshot(p.address)["gauges"]["regs_waiting_blocks"] == 6, 30, "regs")
        c.freeze("d1")
        t_freeze = time.monotonic()
        # P keeps serving D2 while D1 is frozen.
        during = fresh_batch(p.address, [d2.address], n=12, prefix="during")
        assert max(r.latency_s for r in during) < FREEZE_S - 1, [r.latency_s for r in during]
        wait_for(
            lambda: (
                sum(failures(p.address).get(k, 0) for k in ("write_timeout", "peer_dead")) > 0
                or counters(p.address).get("pushes_ok", 0) >= 8 + 12 + 6
            ),
            10,
            "P to time out its WRITEs into frozen D1 (or complete them)",
        )
        time.sleep(max(0.0, FREEZE_S - (time.monotonic() - t_freeze)))
        c.thaw("d1")
        t1.join(40)
        res = check_results(out1)
        print("frozen D1 outcomes:", dict(res), "P failures:", failures(p.address))

        # After the thaw, both sides settle; quarantined blocks are exactly what telemetry shows.
        fresh_batch(p.address, [d1.address, d2.address], n=16, prefix="after")
        for a in (p.address, d1.address, d2.address):
            settle(a, timeout_s=10, quarantine_clears=True)
        p_start.assert_bounded(ProcStats.of(p.popen.pid), "P after a frozen D")


@pytest.mark.slow
def test_d_restarted_at_same_address(tmp_path: Path) -> None:
    port = free_port()
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")
        d = c.start("decode", "d", port=port, engine_id="d-fixed")
        other = c.start("decode", "other")
        fresh_batch(p.address, [d.address, other.address], n=8)
        inc0 = d.incarnation

        # Crash and restart at the same address: P must drop the old incarnation and
        # handshake with the new one (a fresh agent name per incarnation).
        c.kill("d")
        d = c.restart("d")
        assert d.port == port and d.incarnation != inc0
        fresh_batch(p.address, [d.address, other.address], n=8, prefix="crash")
        inc1 = d.incarnation

        # A registration from the dead incarnation is still waiting at P when the new one is
        # connected: P must drop it without disturbing the new incarnation (whose blocks it
        # names are someone else's now), while the new D is under load.
        ghost: list[Result] = []
        tg = threading.Thread(
            target=lambda: ghost.append(
                run_leg("ghost", p.address, d.address, 4, send_p=False, d_timeout_s=3)
            )
        )
        tg.start()
        wait_for(lambda: gauges(p.address)["regs_waiting_blocks"] == 1, 30, "ghost PUSH_REG")
        c.kill("d")
        d = c.restart("d")
        fresh_batch(p.address, [d.address], n=4, prefix="new-inc")
        tl, load = _load(p.address, d.address, 60, "under-ghost", blocks=4)
        rep = request(p.address, protocol.PrefillReq(transfer_id="ghost", num_blocks=4))
        assert rep.outcome == "ok", rep
        tl.join(30)
        tg.join(10)
        assert ghost[0].reason == "d_unreachable", ghost
        assert check_results(load) == {"ok": 60}, "the ghost registration disturbed the new D"
        assert failures(p.address).get("stale_registration") == 1, failures(p.address)
        inc2 = d.incarnation

        # Graceful restart, with load on the other D meanwhile.
        t, out = _load(p.address, other.address, 20, "bg")
        c.stop("d")
        d = c.restart("d")
        assert d.incarnation not in (inc0, inc1, inc2)
        fresh_batch(p.address, [d.address], n=8, prefix="graceful")
        t.join(30)
        assert check_results(out) == {"ok": 20}

        snap = snapshot(p.address)
        rows = [r for r in snap["peers"] if r["peer"] == d.address]
        assert len(rows) == 1 and rows[0]["state"] == "connected", snap["peers"]
        assert snap["counters"].get("peers_evicted", 0) >= 2, snap["counters"]
        for a in (p.address, d.address, other.address):
            settle(a, quarantine_clears=True)


def test_cancel_from_a_restarted_d_is_acknowledged_to_it(tmp_path: Path) -> None:
    """P still holds its connection to a D that was killed and restarted at the same address
    when the new incarnation registers a request and cancels it (its deadline passed before
    P's blocks were done): P acknowledges the cancel to the incarnation that sent it, not over
    the dead one's connection, and does not drop it when the dead one is evicted; the new D's
    blocks come back. (The soak found this: the ack went to the old agent, or was forgotten
    with it, and the new D's blocks stayed quarantined for as long as P lived.)"""
    port = free_port()
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")
        d = c.start("decode", "d", port=port)
        fresh_batch(p.address, [d.address], n=4)  # P holds a full connection to D
        c.kill("d")
        d = c.restart("d")
        for i in range(3):
            r = run_leg(f"cancel-{i}", p.address, d.address, 4, deadline_s=0.5, send_p=False)
            assert (r.outcome, r.reason) == ("failed", "deadline"), r
        settle(d.address, timeout_s=15, quarantine_clears=True)
        assert failures(p.address).get("cancel_unacknowledged", 0) == 0, failures(p.address)
        fresh_batch(p.address, [d.address], n=4, prefix="after")
        for a in (p.address, d.address):
            settle(a, quarantine_clears=True)


@pytest.mark.slow
@pytest.mark.slow
def test_p_killed_mid_push_then_restarted(tmp_path: Path) -> None:
    port = free_port()
    deadline_s = 9.0
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p", port=port, engine_id="p-fixed")
        d1 = c.start("decode", "d1", timeouts={"request_deadline_s": deadline_s})
        d2 = c.start("decode", "d2", timeouts={"request_deadline_s": deadline_s})
        fresh_batch(p.address, [d1.address, d2.address], n=8)
        d_start = ProcStats.of(d1.popen.pid)

        # D1 and D2 register requests whose blocks P will never push (P legs held back).
        t1, out1 = _load(p.address, d1.address, 6, "w1", send_p=False, d_timeout_s=15)
        t2, out2 = _load(p.address, d2.address, 6, "w2", send_p=False, d_timeout_s=15)
        wait_for(lambda: snapshot(p.address)["gauges"]["regs_waiting_blocks"] == 12, 30, "regs")
        # Plus a stream of complete requests in flight when P dies.
        gone = threading.Event()
        t3, out3 = _load(
            p.address, d1.address, 400, "flow", stop=gone, d_timeout_s=15, p_timeout_s=3
        )
        wait_for(lambda: counters(d1.address).get("requests_ok", 0) >= 8 + 30, 20, "flow")
        t_kill = time.monotonic()
        c.kill("p")
        gone.set()
        for t in (t1, t2, t3):
            t.join(30)
        waited = [*out1, *out2]
        reasons = check_results([*waited, *out3])
        assert reasons["ok"] >= 30 and reasons["prefill_dead"] >= 12, reasons
        print("P killed mid-push:", dict(reasons))
        cut = [r for r in out3 if r.outcome == "failed"]
        assert cut, "no request was cut by P's death"
        for r in cut:  # requests cut mid-flight by P's death fail fast too
            assert r.reason in ("prefill_dead", "prefill_unreachable", "handshake_failed"), r
            assert r.t_end - t_kill < deadline_s / 3, (r, r.t_end - t_kill)
        for r in waited:
            assert r.outcome == "failed" and r.reason in ("prefill_dead", "prefill_unreachable"), r
            # D learnt of P's death fast, not at its deadline.
            assert r.t_end - t_kill < deadline_s / 3, (r, r.t_end - t_kill)

        # A new P incarnation at the same address: both Ds work against it.
        p = c.restart("p")
        fresh_batch(p.address, [d1.address, d2.address], n=16, prefix="newp")

        # P dies and restarts while both Ds are idle (nothing to heartbeat): a D finds out
        # when its next PUSH_REG fails, and handshakes with the new incarnation at once.
        c.kill("p")
        p = c.restart("p")
        t0 = time.monotonic()
        fresh_batch(p.address, [d1.address, d2.address], n=8, prefix="idle-restart")
        assert time.monotonic() - t0 < deadline_s / 3, "the first requests waited for a deadline"
        for a in (p.address, d1.address, d2.address):
            settle(a, quarantine_clears=True)
        d_start.assert_bounded(ProcStats.of(d1.popen.pid), "D1 after P's death")

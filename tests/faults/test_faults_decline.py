"""No leg pins the other (issue 12): a refusal on one side frees the other side at once.

Real processes, real NIXL, loopback. The side that cannot take a transfer tells the other over
its side channel (``DeclineReq``, ``kvpush.runtime.decline``): D refusing (no free blocks)
gives P's finished blocks back long before P's lease would; P refusing fails D's request with
P's reason long before D's deadline; P stopping gracefully fails D's waiting requests with
``shutting_down``, not ``prefill_dead``; D stopping answers the requests its drain ended.
The bounds are fractions of the lease or deadline the
other side would otherwise wait for, which these tests set short (``FAST_TIMEOUTS``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvpush.wire import protocol
from tests.support.cluster import FAST_TIMEOUTS, cluster_ctx
from tests.support.fault_legs import Result, run_leg, run_legs
from tests.support.invariants import check_results, settle
from tests.support.side import counters, failures, gauges, request
from tests.support.waits import wait_for

pytestmark = pytest.mark.integration

LEASE_S = FAST_TIMEOUTS["lease_s"]
DEADLINE_S = FAST_TIMEOUTS["request_deadline_s"]


def _p_back(address: str, free: float, timeout_s: float) -> float:
    """Seconds until P's pool is back to ``free`` blocks (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    wait_for(lambda: gauges(address)["pool_free"] == free, timeout_s, "P's blocks back")
    return time.monotonic() - t0


def _held(
    p: str, d: str, prefix: str, n: int, blocks: int, out: list[Result]
) -> list[threading.Thread]:
    """``n`` requests D registers and P is never asked to prefill, each on a started thread
    that appends how it ended to ``out``."""
    legs = [
        threading.Thread(
            target=lambda i=i: out.append(run_leg(f"{prefix}{i}", p, d, blocks, send_p=False))
        )
        for i in range(n)
    ]
    for t in legs:
        t.start()
    return legs


def test_a_refusing_d_beside_a_healthy_one_never_pins_p(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")
        tiny: dict[str, object] = {"num_blocks": 8, "layers": 2, "block_bytes": 16384}
        small = c.start("decode", "small", pool=tiny)
        ok = c.start("decode", "ok")
        p_free = gauges(p.address)["pool_free"]
        healthy: list[Result] = []

        def load() -> None:
            for i in range(40):
                healthy.append(run_leg(f"h{i}", p.address, ok.address, 4))

        t = threading.Thread(target=load)
        t.start()
        waits: list[float] = []
        for i in range(8):
            # D refuses at once; P's prefill of the same transfer follows the refusal.
            r = run_leg(f"big{i}", p.address, small.address, 16)
            assert r.outcome == "failed" and r.reason == "no_free_blocks", r
            assert r.p_outcome == "ok", r
            t0 = time.monotonic()
            wait_for(
                lambda i=i: counters(p.address).get("declines_received", 0) >= i + 1,
                LEASE_S / 2,
                "D's decline at P",
            )
            waits.append(time.monotonic() - t0)
        t.join(60)
        assert check_results(healthy) == {"ok": 40}
        # Every refused transfer's blocks came back well inside the lease that held them before.
        assert _p_back(p.address, p_free, LEASE_S / 2) < LEASE_S / 2
        print(f"declines seen at P after the refusal: max {max(waits) * 1000:.0f} ms")
        g = settle(p.address, quarantine_clears=True)
        assert g["pool_free"] == p_free, g
        assert counters(small.address).get("declines_sent", 0) >= 8


def test_p_refusing_fails_d_at_once_with_ps_reason(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p", pool={"num_blocks": 16, "layers": 2, "block_bytes": 16384})
        d = c.start("decode", "d")
        d_free = gauges(d.address)["pool_free"]
        out: list[Result] = []
        leg = threading.Thread(
            target=lambda: out.append(run_leg("huge", p.address, d.address, 32, send_p=False))
        )
        t0 = time.monotonic()
        leg.start()
        wait_for(lambda: gauges(p.address)["regs_waiting_blocks"] == 1, 30, "D's PUSH_REG at P")
        rep = request(p.address, protocol.PrefillReq(transfer_id="huge", num_blocks=32))
        assert rep.outcome == "failed" and rep.reason == "no_free_blocks", rep
        leg.join(DEADLINE_S + 5)
        (r,) = out
        assert r.outcome == "failed" and r.reason == "no_free_blocks", r
        assert "P declined" in r.detail, r
        assert time.monotonic() - t0 < DEADLINE_S / 2, "D waited for its deadline"
        g = settle(d.address, quarantine_clears=True)
        assert g["pool_free"] == d_free, g
        assert gauges(p.address)["regs_waiting_blocks"] == 0


def _stop_with_four_waiting(tmp_path: Path, who: str) -> tuple[list[Result], float]:
    """Four requests D registered wait on a P that never pushes them; ``who`` ("p" or "d")
    is stopped. How they ended, and the seconds from the stop until all had."""
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")
        d = c.start("decode", "d")
        out: list[Result] = []
        legs = _held(p.address, d.address, "w", 4, 4, out)
        wait_for(lambda: gauges(p.address)["regs_waiting_blocks"] == 4, 30, "D's PUSH_REGs")
        t0 = time.monotonic()
        c.stop(who)
        for t in legs:
            t.join(DEADLINE_S + 25)
        took = time.monotonic() - t0
        if who == "p":
            g = settle(d.address, quarantine_clears=True)
            assert g["pool_quarantined"] == 0, g
        return out, took


def test_p_stopping_gracefully_is_shutting_down_not_dead(tmp_path: Path) -> None:
    out, took = _stop_with_four_waiting(tmp_path, "p")
    assert [r.reason for r in out] == ["shutting_down"] * 4, out
    assert took < DEADLINE_S / 2


def test_d_stopping_gracefully_answers_its_waiting_requests_with_shutting_down(
    tmp_path: Path,
) -> None:
    """D's drain ends the four requests, and its side channel stays up until their answers are
    out: each client hears ``shutting_down`` when the drain ends, not silence until its own wait
    runs out (``d_unreachable``, 20 s)."""
    out, took = _stop_with_four_waiting(tmp_path, "d")
    assert [(r.reason, r.detail) for r in out] == [("shutting_down", "D stopped")] * 4, out
    assert took < DEADLINE_S


@pytest.mark.slow
def test_p_stopping_mid_load_is_shutting_down_for_every_request_in_flight(
    tmp_path: Path,
) -> None:
    """P gets SIGTERM while two Ds pull steady load through it (every stage of a request in
    flight: PUSH_REGs on their way, blocks finished or not, WRITEs posted) and a third D waits
    on two requests P has not prefilled. No request ends with ``prefill_dead``: one whose
    blocks P had finished is written during the drain (``ok``); one P cannot finish ends with
    ``shutting_down`` -- P refuses the PUSH_REGs it holds or that reach it during its drain, and
    tells each connected D at its end that it writes nothing more; one started after P is gone
    finds it unreachable. The two held requests make sure the ``shutting_down`` path is taken
    whatever stage the steady requests happen to be at when the signal lands (they all may be
    past P's intake: CI saw 42 ``ok`` and 6 ``prefill_unreachable``)."""
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")
        ds = [c.start("decode", f"d{i}") for i in range(2)]
        held_d = c.start("decode", "held")
        out: list[Result] = []
        held: list[Result] = []
        stop = threading.Event()

        def worker(w: int) -> None:
            i = 0
            while not stop.is_set():
                d = ds[(w + i) % 2]
                out.append(run_leg(f"w{w}-{i}", p.address, d.address, 2, p_delay_s=0.002 * w))
                i += 1

        workers = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
        for t in workers:
            t.start()
        wait_for(lambda: sum(r.outcome == "ok" for r in out) >= 30, 30, "steady load")
        waiting = _held(p.address, held_d.address, "held", 2, 2, held)
        # Sent: P reads them by its drain's last look at its notifications and refuses them.
        wait_for(
            lambda: counters(held_d.address).get("push_regs_sent", 0) >= 2, 30, "held PUSH_REGs"
        )
        c.stop("p")
        stop.set()
        for t in workers + waiting:
            t.join(DEADLINE_S + 15)
        reasons = check_results(out, allowed={"shutting_down", "prefill_unreachable"})
        assert reasons["ok"] >= 30, reasons
        assert [r.reason for r in held] == ["shutting_down"] * 2, held
        for d in [*ds, held_d]:
            assert "prefill_dead" not in failures(d.address), failures(d.address)
            settle(d.address, quarantine_clears=True)


def test_a_burst_of_refusals_never_starves_a_healthy_d(tmp_path: Path) -> None:
    """32 requests at a time into a D that refuses them all (as fast as it can refuse) beside
    steady traffic to a healthy D through the same P: D's declines reach P in batches, so P's
    pool never drains and the healthy D's requests all succeed."""
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")  # 256 blocks
        small = c.start(
            "decode", "small", pool={"num_blocks": 8, "layers": 2, "block_bytes": 16384}
        )
        ok = c.start("decode", "ok")
        p_free = gauges(p.address)["pool_free"]
        lowest = [p_free]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                lowest[0] = min(lowest[0], gauges(p.address)["pool_free"])
                time.sleep(0.01)

        healthy: list[Result] = []

        def load() -> None:
            healthy.extend(run_legs([(f"h{i}", p.address, ok.address, 4) for i in range(120)], 4))

        threads = [threading.Thread(target=watch), threading.Thread(target=load)]
        for t in threads:
            t.start()
        refused = run_legs([(f"r{i}", p.address, small.address, 2) for i in range(600)], 32)
        done.set()
        for t in threads:
            t.join(120)
        assert check_results(healthy) == {"ok": 120}, check_results(healthy)
        # (the small D serves what fits in its 8 blocks and refuses the rest)
        reasons = check_results(refused, allowed={"no_free_blocks"})
        assert reasons["no_free_blocks"] >= 300, reasons
        print(f"P's free blocks: lowest {lowest[0]:.0f} of {p_free:.0f}")
        assert _p_back(p.address, p_free, LEASE_S / 2) < LEASE_S / 2
        assert counters(p.address).get("declines_received", 0) >= reasons["no_free_blocks"]

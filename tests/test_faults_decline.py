"""No leg pins the other (issue 12): a refusal on one side frees the other side at once.

Real processes, real NIXL, loopback. The side that cannot take a transfer tells the other over
its side channel (``DeclineReq``, ``kvpush.runtime.decline``): D refusing (no free blocks)
gives P's finished blocks back long before P's lease would; P refusing fails D's request with
P's reason long before D's deadline; P stopping gracefully fails D's waiting requests with
``shutting_down``, not ``prefill_dead``. The bounds are fractions of the lease or deadline the
other side would otherwise wait for, which these tests set short (``FAST_TIMEOUTS``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvpush.wire import protocol
from tests.support.faults import (
    FAST_TIMEOUTS,
    Result,
    check_results,
    cluster_ctx,
    counters,
    gauges,
    request,
    run_leg,
    settle,
    wait_for,
)

pytestmark = pytest.mark.integration

LEASE_S = FAST_TIMEOUTS["lease_s"]
DEADLINE_S = FAST_TIMEOUTS["request_deadline_s"]


def _p_back(address: str, free: float, timeout_s: float) -> float:
    """Seconds until P's pool is back to ``free`` blocks (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    wait_for(lambda: gauges(address)["pool_free"] == free, timeout_s, "P's blocks back")
    return time.monotonic() - t0


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
        wait_for(lambda: gauges(p.address)["regs_waiting_blocks"] == 1, 5, "D's PUSH_REG at P")
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


def test_p_stopping_gracefully_is_shutting_down_not_dead(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p")
        d = c.start("decode", "d")
        out: list[Result] = []
        legs = [
            threading.Thread(
                target=lambda i=i: out.append(
                    run_leg(f"w{i}", p.address, d.address, 4, send_p=False)
                )
            )
            for i in range(4)
        ]
        for t in legs:
            t.start()
        wait_for(lambda: gauges(p.address)["regs_waiting_blocks"] == 4, 5, "D's PUSH_REGs")
        t0 = time.monotonic()
        c.stop("p")
        for t in legs:
            t.join(DEADLINE_S + 5)
        assert [r.reason for r in out] == ["shutting_down"] * 4, out
        assert time.monotonic() - t0 < DEADLINE_S / 2
        g = settle(d.address, quarantine_clears=True)
        assert g["pool_quarantined"] == 0, g

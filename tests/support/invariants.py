"""The invariants every fault test checks once its faults are over.

``check_results``: every request ended ok (and D verified every byte) or failed with a reason;
``fresh_batch``: the survivors serve a fresh batch, all ok and verified; ``settle``: pool counts
come back to their start, or differ by exactly the quarantined blocks.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

from tests.support.fault_legs import Result, run_legs
from tests.support.side import gauges


def check_results(results: list[Result], allowed: set[str] | None = None) -> Counter[str]:
    """Every request ended ok (and D verified every byte) or failed with a reason."""
    reasons: Counter[str] = Counter()
    for r in results:
        assert r.outcome in ("ok", "failed"), r
        if r.outcome == "ok":
            assert r.verified is True, f"{r.tid}: ok but not verified: {r}"
            reasons["ok"] += 1
        else:
            assert r.reason, f"{r.tid}: failed without a reason: {r}"
            assert r.reason != "verify_failed", f"{r.tid}: CORRUPTED KV: {r}"
            if allowed is not None:
                assert r.reason in allowed, f"{r.tid}: unexpected reason {r.reason}: {r}"
            reasons[r.reason] += 1
    return reasons


def fresh_batch(
    p_addr: str, d_addrs: list[str], n: int = 16, blocks: int = 4, prefix: str = "fresh"
) -> list[Result]:
    """Survivors keep serving: ``n`` requests, all ok and verified."""
    tag = uuid.uuid4().hex[:6]
    items = [(f"{prefix}-{tag}-{i}", p_addr, d_addrs[i % len(d_addrs)], blocks) for i in range(n)]
    res = run_legs(items, concurrency=4)
    bad = [r for r in res if r.outcome != "ok" or r.verified is not True]
    assert not bad, bad[:3]
    return res


_BUSY_GAUGES = (
    "pool_allocated",
    "pool_inflight",
    "d_waiting",
    "inflight_writes",
    "deferred",
    "finished_waiting_reg",
    "regs_waiting_blocks",
)


def settle(
    address: str, timeout_s: float = 10.0, quarantine_clears: bool = False
) -> dict[str, float]:
    """Wait until nothing is allocated or in flight; then every block is free or quarantined.

    With ``quarantine_clears`` also wait for quarantine to drain (fences landed) and require it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        g = gauges(address)
        busy = any(g.get(k, 0) for k in _BUSY_GAUGES)
        if quarantine_clears:
            busy = busy or g.get("pool_quarantined", 0) > 0
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for k in _BUSY_GAUGES:
        assert g.get(k, 0) == 0, f"{address}: {k} = {g.get(k)} after {timeout_s}s: {g}"
    assert g["pool_free"] + g["pool_quarantined"] == g["pool_total"], (address, g)
    if quarantine_clears:
        assert g["pool_quarantined"] == 0, (address, g)
    return g

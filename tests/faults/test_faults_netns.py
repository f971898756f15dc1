"""A slow, then partitioned, link between P and D in two network namespaces. ``netns``, ``slow``.

This kernel has no ``tc netem`` (DESIGN.md section 3), so a userspace relay carries IP packets
between a TUN device in P's namespace and one in D's, adding delay or dropping everything (a
partition). D runs under ``unshare --pid --ipc`` inside its namespace so UCX cannot use shared
memory or CMA and must take the TCP path over the relay, and ``UCX_NET_DEVICES`` pins UCX to the
TUN device on both sides. Addresses (10.200.7.1/2) exist only inside the namespaces created here,
which are removed in ``finally``. The requests are driven from inside P's namespace.

Checks: pushes over a 10 ms RTT link succeed with every byte verified and the KV bytes really
crossed the relay; during a partition P's WRITEs are caught by kvpush's write deadline and D's
requests end (failed with a reason) by their deadline, not by TCP's minutes; after the link
heals both pools settle with nothing quarantined (the fence is retried until it lands) and
fresh requests succeed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import FAST_TIMEOUTS, SMALL_POOL
from tests.support.marks import skip_unless_marker_selected
from tests.support.netns import NetnsPair, NsProc, netns_unavailable, run_in_netns, start_in_netns
from tests.support.relay import Relay

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.netns]

DELAY_S = 0.005  # each way: 10 ms RTT
DEADLINE_S = 6.0


@pytest.fixture(autouse=True)
def _only_when_selected(request: pytest.FixtureRequest) -> None:
    skip_unless_marker_selected(request, "slow")
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"netns test not permitted here: {why}")


def _ok(results: list[dict[str, Any]]) -> None:
    bad = [r for r in results if r["outcome"] != "ok" or r["verified"] is not True]
    assert not bad, bad[:3]


def _settled(ns: str, addr: str, timeout_s: float = 20.0) -> dict[str, float]:
    busy = ("pool_allocated", "pool_inflight", "pool_quarantined", "d_waiting", "inflight_writes")
    deadline = time.monotonic() + timeout_s
    while True:
        g = run_in_netns(ns, "stats", addr)["gauges"]
        if not any(g.get(k, 0) for k in busy) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    for k in busy:
        assert g.get(k, 0) == 0, (addr, k, g)
    assert g["pool_free"] == g["pool_total"], (addr, g)
    return g


def test_slow_then_partitioned_link_across_namespaces(tmp_path: Path) -> None:
    pair = NetnsPair()
    relay: Relay | None = None
    procs: list[NsProc] = []
    try:
        fd_a, fd_b = pair.create()
        relay = Relay(fd_a, fd_b, DELAY_S).start()
        timeouts = {**FAST_TIMEOUTS, "request_deadline_s": DEADLINE_S}
        p = start_in_netns(
            {"role": "prefill", "host": pair.a_ip, "pool": SMALL_POOL, "timeouts": timeouts},
            tmp_path,
            "p",
            pair.ns_a,
            env={"UCX_NET_DEVICES": pair.dev_a},
        )
        procs.append(p)
        d = start_in_netns(
            {"role": "decode", "host": pair.b_ip, "pool": SMALL_POOL, "timeouts": timeouts},
            tmp_path,
            "d",
            pair.ns_b,
            unshare=True,
            env={"UCX_NET_DEVICES": pair.dev_b},
        )
        procs.append(d)
        ns = pair.ns_a

        # Slow link: everything works, and the KV bytes crossed the relay (TCP, not shm/CMA).
        before = relay.forwarded_bytes
        res = run_in_netns(ns, "legs", p.address, d.address, "16", "16", "slow")
        _ok(res)
        regions = 2 * SMALL_POOL["layers"]
        kv_bytes = len(res) * 16 * regions * SMALL_POOL["block_bytes"]
        assert relay.forwarded_bytes - before >= kv_bytes, (relay.forwarded_bytes, kv_bytes)
        assert min(r["latency_s"] for r in res) >= 2 * DELAY_S

        # Partition while four requests are registered and P is about to push them.
        out: list[list[dict[str, Any]]] = []
        t = threading.Thread(
            target=lambda: out.append(
                run_in_netns(ns, "legs", p.address, d.address, "4", "8", "cut", "1.0")
            )
        )
        t.start()
        time.sleep(0.6)  # the PUSH_REGs have crossed; the P legs go out at 1.0 s
        relay.partitioned = True
        time.sleep(DEADLINE_S + 1.0)
        relay.partitioned = False
        t.join(60)
        (cut,) = out
        for r in cut:
            assert r["outcome"] == "failed" and r["reason"], r
            # Ended by kvpush's own deadlines, not TCP's retransmission timeouts.
            assert r["server_latency_s"] < DEADLINE_S + 2.0, r
        print("partitioned requests:", sorted({r["reason"] for r in cut}), "dropped", relay.dropped)

        # The link healed: both sides settle (fences landed) and fresh requests succeed.
        _ok(run_in_netns(ns, "legs", p.address, d.address, "8", "16", "healed"))
        for addr in (p.address, d.address):
            _settled(ns, addr)
        p_stats = run_in_netns(ns, "stats", p.address)
        print("P failures:", p_stats["failures"], "fences:", p_stats["counters"].get("fences_ok"))
    finally:
        problems = []
        for proc in procs:
            rc = proc.stop()
            if rc != 0:
                problems.append(f"{proc.address} exited {rc}:\n{proc.log_text()[-3000:]}")
        if relay is not None:
            relay.stop()
        pair.destroy()
    assert not problems, problems

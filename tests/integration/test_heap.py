"""What a busy endpoint keeps alive: real P and D worker processes (the bench's), real NIXL.

A D that answered thousands of requests kept every one of them (request, future, answer) in
its deadline heap until the deadline passed, 60 s later: ~1M objects after 30,000 pushes, and
each full garbage collection walked them all with every thread stopped (~1 s, ``bench rate``).
And every worker walked the ~170k objects torch, numpy and the endpoint built at start-up in
each such collection, where ``serve-*`` had frozen them. Counts of objects, not timings."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.commands.bench.common import endpoint_cfg
from kvpush.commands.bench.passes import ClosedLoop
from kvpush.commands.bench.probes import GcReport
from kvpush.commands.bench.procs import Cluster
from kvpush.config import Role

pytestmark = pytest.mark.integration

BLOCK_BYTES = 4096


def test_a_busy_d_keeps_no_answered_request_alive_and_freezes_its_startup_heap(
    tmp_path: Path,
) -> None:
    with Cluster(tmp_path) as cl:
        ws = cl.endpoints(
            {
                "p": endpoint_cfg(Role.PREFILL, layers=1, block_bytes=BLOCK_BYTES, num_blocks=256),
                "d": endpoint_cfg(
                    Role.DECODE, layers=1, block_bytes=BLOCK_BYTES, num_blocks=64, verify=False
                ),
            }
        )
        pw, dw = ws["p"], ws["d"]
        n = 6_000
        # The first pass fills what is bounded (P's ring of recent outcomes, the heaps' slack);
        # the second may add next to nothing.
        ClosedLoop(pw, dw, "warm.", n, 1, 16).timed()
        before = {name: w.call("gc_report", reply=GcReport) for name, w in ws.items()}
        for b in before.values():
            # What start-up built is frozen, out of every later collection (~35,000 objects
            # here since an endpoint no longer imports torch; ~60,000 with it).
            assert b["frozen_objects"] > 20_000, b
        r, _, _ = ClosedLoop(pw, dw, "k.", n, 1, 16).timed()
        assert all(r["ok"]), r["reasons"]
        after = {name: w.call("gc_report", reply=GcReport) for name, w in ws.items()}
        for name in ws:
            grew = after[name]["tracked_objects"] - before[name]["tracked_objects"]
            # ~35 objects per answered request were kept on D before: 200,000 here.
            assert grew < n, (name, before[name]["tracked_objects"], grew)

"""A P that answers "starting" after drive admitted it is another process: drive marks it down at
once (``peer_restarted``), re-checks it and sends again once it serves. It never spends requests
on it as ``bad_request``: a fault test once lost 100 that way (a P killed and restarted at its
port; drive's pooled connection reconnected to the new process while its ranks were being
built, and every prefill leg sent meanwhile was refused with "starting").

Real endpoints, real ZMQ and NIXL: D in its own process, P in this one (so that the test can
make it answer as a process still starting: its side channel refuses every request with
"starting" until its ranks are built, ``kvpush.endpoint.core``). Drive runs in this process too.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvpush.commands.common.results import RequestResult
from kvpush.commands.drive.driver import DriveConfig, DriveHooks, Driver, DriveReport
from kvpush.config import EndpointConfig, PoolConfig, Role
from kvpush.endpoint import open_endpoint
from tests.support.procs import Launcher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

POOL = ["--num-blocks", "256", "--layers", "1", "--block-bytes", "4096"]


def test_a_p_answering_starting_mid_run_is_down_and_back_not_bad_requests(
    serve: Launcher,
) -> None:
    d = serve.start("decode", *POOL)
    ep = open_endpoint(
        EndpointConfig(
            role=Role.PREFILL, pool=PoolConfig(num_blocks=256, layers=1, block_bytes=4096)
        )
    )
    events: list[str] = []
    results: list[RequestResult] = []
    out: list[DriveReport] = []
    try:
        cfg = DriveConfig(
            prefill=(ep.address,),
            decode=(d.address,),
            requests=800,
            concurrency=4,
            blocks=1,
            timeout_s=30,
            rate=100.0,
            peer_grace_s=60.0,
        )
        drv = Driver(cfg, DriveHooks(on_event=events.append, on_result=results.append))
        t = threading.Thread(target=lambda: out.append(drv.run()), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while len(results) < 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(results) >= 100, "drive did not get going"
        # What a new process at P's address answers while its ranks are built.
        ep._ready.clear()
        time.sleep(2.0)
        ep._ready.set()
        t.join(150)
        assert out, "drive did not finish"
    finally:
        ep.stop()
    rep = out[0]
    by = rep.failures_by_reason
    assert "bad_request" not in by, (by, events)
    assert set(by) <= {"peer_restarted", "deadline"}, (by, events)
    assert any(f"prefill {ep.address} is down (restarted" in e for e in events), events
    assert any(f"prefill {ep.address} is back up" in e for e in events), events
    # Only what met the refusal (or was in flight when P went down) failed; the rest waited.
    assert rep.failed <= 12, (by, events)
    assert rep.ok + rep.failed == cfg.requests

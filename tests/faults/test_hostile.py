"""Well-formed hostile messages cost bounded work (issue 17): real endpoints, real sockets.

Each flood is a burst of valid-looking side-channel requests up to and just past a cap, sent
down one connection without waiting for answers (``tests.support.hostile.Flood``), while a
``kvpush drive`` pushes real requests through the same P/D pair beside it. Asserted: every
drive request succeeds, every request over a cap is answered at once with a named reason, and
the endpoint's threads and RSS stay within generous bounds. How much the flood slows the
drive is measured by ``kvpush bench hostile`` (BENCHMARKS.md), never asserted here.
"""

from __future__ import annotations

import math
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvpush.config import Role
from kvpush.decode.limits import MAX_DELAYED_REQUESTS
from kvpush.prefill.limits import MAX_DECLINED_IDS, MAX_PUSH_WAITS
from kvpush.wire import protocol
from kvpush.wire.side_messages import MAX_DECLINE_BATCH
from tests.conftest import SMALL, Done, Served, ServeFactory, run_cli, unused_port
from tests.support.hostile import Drive, Flood, reason_of, thread_count
from tests.support.procs import KVPUSH, clean_env, wait_ready
from tests.support.procstats import ProcStats
from tests.support.side import failures, request, snapshot

pytestmark = pytest.mark.integration

GEOM = ["--num-blocks", "256", "--layers", "2", "--block-bytes", "4096"]
THREADS = 8  # a flood may not add more threads than this (a wait or a request is no thread)
RSS_MB = 200


def _pair(serve: ServeFactory, *extra: str, d_extra: tuple[str, ...] = ()) -> tuple[Served, Served]:
    p = serve.start("prefill", *GEOM, *extra, wait=False)
    d = serve.start("decode", *GEOM, *extra, *d_extra, wait=False)
    wait_ready(p)
    wait_ready(d)
    return p, d


def _drive_ok(drive: Drive, n: int) -> None:
    rc, summary, err = drive.result()
    assert rc == 0 and summary.get("ok") == n, (rc, summary, err[-2000:])


# ------------------------------------------------------------------ floods at the caps' edge


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_push_wait_flood_is_capped_and_costs_no_threads(serve: ServeFactory) -> None:
    p, d = _pair(serve)
    before = ProcStats.of(p.popen.pid)
    drive = Drive(p.address, d.address, 150, "--concurrency", "4")
    f = Flood(p.address)
    n = MAX_PUSH_WAITS + 64
    for i in range(n):
        f.send(protocol.PushWaitReq(transfer_id=f"wait-{i}", timeout_s=4.0))
    # The ones over the cap are refused at once, the others answered "pending" at 4 s.
    reps = f.collect(n, 60)
    peak = thread_count(p.popen.pid)
    _drive_ok(drive, 150)
    f.close()
    assert len(reps) == n
    refused = [r for r in reps.values() if isinstance(r, protocol.ErrorRep)]
    assert len(refused) >= 64 and all(reason_of(r) == "too_many_waits" for r in refused)
    pending = [r for r in reps.values() if isinstance(r, protocol.PushWaitRep)]
    assert pending and all(r.outcome == "pending" for r in pending)
    assert peak - before.threads <= THREADS, (before, peak)
    before.assert_bounded(ProcStats.of(p.popen.pid), "waits", rss_mb=RSS_MB, threads=THREADS)
    assert failures(p.address).get("too_many_waits", 0) == len(refused)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_decline_flood_is_capped_and_p_keeps_pushing(serve: ServeFactory) -> None:
    p, d = _pair(serve)
    before = ProcStats.of(p.popen.pid)
    drive = Drive(p.address, d.address, 150, "--concurrency", "4")
    f = Flood(p.address)
    per = MAX_DECLINE_BATCH + 1
    n = MAX_DECLINED_IDS // per + 4
    tag = uuid.uuid4().hex[:8]
    for i in range(n):
        ids = [f"{tag}-{i}-{j}" for j in range(per)]
        f.send(
            protocol.DeclineReq(
                transfer_id=ids[0], also=ids[1:], reason="no_free_blocks", origin=Role.DECODE
            )
        )
    reps = f.collect(n, 30)
    _drive_ok(drive, 150)
    f.close()
    assert len(reps) == n
    refused = [r for r in reps.values() if isinstance(r, protocol.ErrorRep)]
    assert refused and all(reason_of(r) == "too_many_declined" for r in refused)
    ok = [r for r in reps.values() if isinstance(r, protocol.DeclineRep)]
    assert len(ok) * per <= MAX_DECLINED_IDS and len(ok) + len(refused) == n
    assert failures(p.address).get("too_many_declined", 0) == len(refused)
    before.assert_bounded(ProcStats.of(p.popen.pid), "declines", rss_mb=RSS_MB, threads=THREADS)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_delayed_decode_flood_is_capped_and_d_keeps_receiving(serve: ServeFactory) -> None:
    p, d = _pair(serve)
    before = ProcStats.of(d.popen.pid)
    f = Flood(d.address)
    n = MAX_DELAYED_REQUESTS + 64
    host, port = p.address.rsplit(":", 1)
    for i in range(n):
        f.send(
            protocol.DecodeReq(
                transfer_id=f"delayed-{i}",
                prefill_host=host,
                prefill_port=int(port),
                num_blocks=1,
                alloc_delay_s=600.0,
            )
        )
    time.sleep(1.0)
    drive = Drive(p.address, d.address, 150, "--concurrency", "4")
    reps = f.collect(64, 30)  # only the refusals answer now
    _drive_ok(drive, 150)
    f.close()
    assert len(reps) >= 64
    assert all(reason_of(r) == "too_many_delayed" for r in reps.values()), {
        reason_of(r) for r in reps.values()
    }
    assert failures(d.address).get("too_many_delayed", 0) == len(reps)
    assert snapshot(d.address)["gauges"]["d_waiting"] == MAX_DELAYED_REQUESTS
    before.assert_bounded(ProcStats.of(d.popen.pid), "delayed", rss_mb=RSS_MB, threads=THREADS)


# ------------------------------------------------------------------ absurd values


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0, 1e300])
def test_absurd_times_are_refused_at_decode(pd_pair: tuple[Served, Served], value: float) -> None:
    p, d = pd_pair
    host, port = p.address.rsplit(":", 1)
    threads = thread_count(p.popen.pid), thread_count(d.popen.pid)
    cases = [
        (p.address, protocol.PushWaitReq(transfer_id="absurd", timeout_s=value), "timeout_s"),
        (
            d.address,
            protocol.DecodeReq(
                transfer_id="absurd",
                prefill_host=host,
                prefill_port=int(port),
                num_blocks=1,
                deadline_s=value,
            ),
            "deadline_s",
        ),
        (
            d.address,
            protocol.DecodeReq(
                transfer_id="absurd",
                prefill_host=host,
                prefill_port=int(port),
                num_blocks=1,
                alloc_delay_s=value,
            ),
            "alloc_delay_s",
        ),
    ]
    for address, req, field in cases:
        f = Flood(address)
        f.send(req)
        reps = f.collect(1, 5)
        f.close()
        assert len(reps) == 1, f"{field}={value}: no answer"
        rep = next(iter(reps.values()))
        assert isinstance(rep, protocol.ErrorRep) and rep.code == "bad_value", rep
        assert field in rep.message, rep
    # Nothing died and nothing was started for them.
    assert (thread_count(p.popen.pid), thread_count(d.popen.pid)) == threads
    rep = request(p.address, protocol.PushWaitReq(transfer_id="absurd", timeout_s=0.1))
    assert isinstance(rep, protocol.PushWaitRep) and rep.outcome == "pending"


# ------------------------------------------------------------------ trust nothing claimed


def _decode(d: Served, p_host: str, p_port: int, tid: str, **kw: Any) -> protocol.DecodeRep:
    rep = request(
        d.address,
        protocol.DecodeReq(
            transfer_id=tid, prefill_host=p_host, prefill_port=p_port, num_blocks=2, **kw
        ),
        timeout_s=20,
    )
    assert isinstance(rep, protocol.DecodeRep), rep
    return rep


@pytest.mark.timeout(90)
def test_claimed_tp_sizes_on_the_vllm_wire_are_refused_before_any_rank_handshake(
    serve: ServeFactory,
) -> None:
    common = [*GEOM, "--wire", "vllm", "--compat-hash", "5" * 64]
    p, d = _pair(serve, *common)
    host, port = p.address.rsplit(":", 1)
    for tp in (2, 4096, 65536):
        rep = _decode(
            d,
            host,
            int(port),
            f"tp{tp}-{uuid.uuid4().hex[:8]}",
            remote_engine_id=p.engine_id,
            remote_request_id=f"tp{tp}-{uuid.uuid4().hex[:8]}",
            remote_tp_size=tp,
        )
        assert rep.outcome == "failed" and rep.reason == "incompatible", rep
        assert f"has 1 TP rank(s), the request claims {tp} (remote_tp_size)" in rep.detail, rep
    snap = snapshot(d.address)
    # Only P's real rank 0 was ever asked (once per request), and it is the only row.
    assert snap["counters"].get("handshakes_started", 0) <= 3, snap["counters"]
    assert [r["peer"] for r in snap["peers"]] == [p.address], snap["peers"]
    # A request that claims P's true size is served as before.
    rid = f"true-{uuid.uuid4().hex[:8]}"
    pre = request(p.address, protocol.PrefillReq(transfer_id=rid, num_blocks=2), 10)
    assert isinstance(pre, protocol.PrefillRep) and pre.outcome == "ok", pre
    kv = pre.kv_transfer_params
    rep = _decode(
        d,
        host,
        int(port),
        rid,
        remote_engine_id=str(kv["remote_engine_id"]),
        remote_request_id=str(kv["remote_request_id"]),
        remote_tp_size=int(str(kv["tp_size"])),
    )
    assert rep.outcome == "ok", rep


@pytest.mark.timeout(90)
def test_a_d_told_that_another_d_or_itself_is_its_p(serve: ServeFactory) -> None:
    d1 = serve.start("decode", *SMALL, wait=False)
    d2 = serve.start("decode", *SMALL, wait=False)
    wait_ready(d1)
    wait_ready(d2)
    free = snapshot(d1.address)["gauges"]["pool_free"]
    for target, words in ((d2, "decode endpoint"), (d1, "itself")):
        host, port = target.address.rsplit(":", 1)
        rep = _decode(d1, host, int(port), f"role-{uuid.uuid4().hex[:8]}", deadline_s=8.0)
        assert rep.outcome == "failed", rep
        assert words in rep.detail, rep
        assert rep.reason in ("handshake_failed", "incompatible"), rep
        assert "NIXL_ERR" not in rep.detail, rep
    g = snapshot(d1.address)["gauges"]
    assert g["pool_free"] == free and g["pool_quarantined"] == 0, g
    assert snapshot(d2.address)["counters"].get("push_regs_received", 0) == 0


# ------------------------------------------------------------------ refusals reach the other leg


@pytest.mark.timeout(90)
def test_duplicate_registration_is_declined_to_d_and_logged_escaped(serve: ServeFactory) -> None:
    p, d = _pair(serve, d_extra=("--request-deadline", "30"))
    host, port = p.address.rsplit(":", 1)
    tid = "dup\nFORGED 2026 ERROR kvpush: owned \x1b[31mred\x1b[0m"

    first: list[protocol.DecodeRep] = []
    t = threading.Thread(
        target=lambda: first.append(_decode(d, host, int(port), tid, request_id="A")),
        daemon=True,
    )
    t.start()
    time.sleep(1.0)
    second = _decode(d, host, int(port), tid, request_id="B")
    assert second.outcome == "failed" and second.reason == "duplicate_registration", second
    assert "already registered by another request" in second.detail, second  # P's word
    rep = request(p.address, protocol.PrefillReq(transfer_id=tid, num_blocks=2), 10)
    assert isinstance(rep, protocol.PrefillRep) and rep.outcome == "ok"
    t.join(30)
    assert first and first[0].outcome == "ok", first
    log = p.log_text()
    assert "FORGED" in log  # the id was logged ...
    for line in log.splitlines():
        assert not line.startswith("FORGED"), line  # ... never as a record of its own
        assert "\x1b" not in line, line
    assert "\\n" in log and "\\x1b" in log


# ------------------------------------------------------------------ fast, honest first contact


@pytest.mark.timeout(60)
def test_a_closed_p_port_fails_a_decode_request_at_once(pd_pair: tuple[Served, Served]) -> None:
    _, d = pd_pair
    rep = _decode(d, "127.0.0.1", unused_port(), f"closed-{uuid.uuid4().hex[:8]}")
    assert rep.outcome == "failed" and rep.reason == "prefill_unreachable", rep
    assert "connection refused" in rep.detail, rep


@pytest.mark.timeout(60)
def test_like_a_closed_port_fails_at_once(tmp_path: Path) -> None:
    port = unused_port()
    r: Done = run_cli("serve-decode", "--wire", "vllm", "--like", f"127.0.0.1:{port}")
    assert r.returncode == 69, r.stderr
    assert r.err_lines[0] == f"error: 127.0.0.1:{port}: connection refused", r.stderr


@pytest.mark.timeout(120)
def test_a_busy_metrics_port_is_refused_before_the_pool_is_allocated(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # A 2 GiB pool: allocated first, it would show in the child's peak RSS.
        args = [*KVPUSH, "serve-prefill", "--port", "0", "--metrics-port", str(port)]
        args += ["--num-blocks", "2048", "--layers", "16", "--block-bytes", "32768"]
        code = (
            "import resource, subprocess, sys\n"
            f"p = subprocess.run({args!r}, capture_output=True, text=True)\n"
            "print(p.returncode)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
            "sys.stderr.write(p.stderr)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env()
        )
    rc, maxrss_kb = (int(x) for x in out.stdout.split())
    errs = [ln for ln in out.stderr.splitlines() if ln.startswith(("error:", "hint:"))]
    assert rc == 1, out.stderr
    assert errs[0] == f"error: cannot bind metrics port 127.0.0.1:{port}: address already in use"
    assert "0 means off" in errs[1] or "picks a free" not in errs[1], errs
    assert maxrss_kb < 1024 * 1024, f"peak RSS {maxrss_kb} kB: the pool was allocated first"
    assert not re.search(r"ready on", out.stderr)

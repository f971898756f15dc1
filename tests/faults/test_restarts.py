"""Restarts heal, and drive shows it (issue 16, item 2): real P and D processes, real NIXL.

A P or a D is SIGKILLed about two seconds into ``kvpush drive`` and restarted at the same port;
drive holds its intake for ``--peer-grace`` while no peer of that role is up, re-runs its
preflight before the peer gets traffic again, and the rest of the run goes through the new
incarnation. Asserted each time, on the endpoints' own telemetry and logs:

* the old incarnation's agent was removed (``stale_agents_removed``) before the new one was
  loaded (the log says so, in that order), the peer's restart was seen (``peer_restarts``),
  exactly one remote agent is loaded afterwards (``remote_agents``) and nothing was ever sent
  through a removed agent (``stale_agent_uses`` = 0);
* every request is accounted for, failures have named reasons from the closed set, and only the
  requests in flight at the kill failed.

Also: a D restarted with another geometry gets no traffic after drive's re-check; a P that is
still starting gets none either; a P restarted at another TP size (2->1, 2->4, 4->2) is re-learnt
by its D, and no request the new size can serve is lost. No timing is asserted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpush.telemetry.names import Failure
from tests.support.legs import stats
from tests.support.procs import KVPUSH, Launcher, Proc, clean_env, launch, node_cmd

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

REASONS = {f.value for f in Failure}
POOL = ["--num-blocks", "256", "--layers", "1", "--block-bytes", "4096"]
FAST = ["--lease", "3", "--heartbeat", "0.5"]
# What the requests in flight when a peer dies may fail with (each named).
CUT = {"prefill_unreachable", "decode_unreachable", "prefill_dead", "peer_restarted", "peer_dead"}


def _until(what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def _snap(p: Proc) -> dict[str, Any]:
    return stats(p.address)


def _counter(p: Proc, name: str) -> int:
    return int(_snap(p)["counters"].get(name, 0))


def _gauge(p: Proc, name: str) -> float:
    return float(_snap(p)["gauges"].get(name, 0))


def _drive(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*KVPUSH, "drive", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
    )


def _finish(drive: subprocess.Popen[str], n: int, timeout: float = 200) -> tuple[dict, str]:
    try:
        stdout, stderr = drive.communicate(timeout=timeout)
    finally:
        drive.kill()
    out = json.loads(stdout)
    assert out["requests"] == n
    assert out["ok"] + out["failed"] == n
    assert sum(out["failures_by_reason"].values()) == out["failed"]
    assert set(out["failures_by_reason"]) <= REASONS, out["failures_by_reason"]
    assert "Traceback" not in stderr
    print(f"ok {out['ok']}/{n}, failed {out['failures_by_reason']}")
    print("\n".join(out["first_failures"]))
    print("\n".join(ln for ln in stderr.splitlines() if " is down" in ln or " up" in ln))
    return out, stderr


def _healed(peer: Proc, restarted: Proc) -> None:
    """``peer`` dropped ``restarted``'s old agent before loading its new one, and never used
    the old one."""
    snap = _snap(peer)
    c, g = snap["counters"], snap["gauges"]
    assert c.get("stale_agents_removed", 0) >= 1, c
    assert c.get("peer_restarts", 0) >= 1, c
    assert g["stale_agent_uses"] == 0, g
    assert g["remote_agents"] == 1, g  # the new incarnation's agent only
    log = peer.log_text()
    removed = log.find("removed the agent")
    restart = log.find("restarted: incarnation")
    assert 0 <= removed < restart, log[-3000:]


def _restart_at(serve: Launcher, role: str, port: int, *args: str) -> Proc:
    return serve.start(role, "--port", str(port), *args)


# ------------------------------------------------------------------ kvpush wire, both directions


def test_p_killed_and_restarted_at_the_same_port_mid_drive(serve: Launcher, free_port: int) -> None:
    p = serve.start("prefill", "--port", str(free_port), *POOL, *FAST)
    d = serve.start("decode", *POOL, "--heartbeat", "0.5")
    n = 600
    drive = _drive(
        "-p", p.address, "-d", d.address, "-n", str(n), "-c", "4", "--blocks", "1",
        "--timeout", "60", "--peer-grace", "60",
    )  # fmt: skip
    _until("D taking traffic", lambda: _counter(d, "requests_ok") >= 20)
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait(10)
    p2 = _restart_at(serve, "prefill", free_port, *POOL, *FAST)
    assert p2.incarnation != p.incarnation
    out, stderr = _finish(drive, n)
    assert f"prefill {p.address} is down" in stderr, stderr
    assert f"prefill {p.address} is back up" in stderr, stderr
    # Only what was in flight at the kill failed (4 workers): the rest waited for the new P.
    assert set(out["failures_by_reason"]) <= CUT, out["failures_by_reason"]
    assert out["failed"] <= 8, out["failures_by_reason"]
    assert _counter(p2, "pushes_ok") > 0
    _healed(d, p2)


def test_d_killed_and_restarted_at_the_same_port_mid_drive(serve: Launcher, free_port: int) -> None:
    p = serve.start("prefill", *POOL, *FAST)
    d = serve.start("decode", "--port", str(free_port), *POOL)
    n = 600
    drive = _drive(
        "-p", p.address, "-d", d.address, "-n", str(n), "-c", "4", "--blocks", "1",
        "--timeout", "60", "--peer-grace", "60",
    )  # fmt: skip
    _until("D taking traffic", lambda: _counter(d, "requests_ok") >= 20)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    d2 = _restart_at(serve, "decode", free_port, *POOL)
    out, stderr = _finish(drive, n)
    assert f"decode {d.address} is down" in stderr, stderr
    assert f"decode {d.address} is back up" in stderr, stderr
    assert set(out["failures_by_reason"]) <= CUT, out["failures_by_reason"]
    assert out["failed"] <= 8, out["failures_by_reason"]
    assert _counter(d2, "requests_ok") > 0
    _healed(p, d2)


# ------------------------------------------------------------------ drive's re-check


def test_a_d_restarted_with_another_geometry_gets_no_traffic(
    serve: Launcher, free_port: int
) -> None:
    p = serve.start("prefill", *POOL, *FAST)
    d1 = serve.start("decode", *POOL)
    d2 = serve.start("decode", "--port", str(free_port), *POOL)
    n = 2000  # at 100/s: the run outlasts D2's restart and several re-checks
    drive = _drive(
        "-p", p.address, "-d", d1.address, "-d", d2.address, "-n", str(n), "-c", "4",
        "--blocks", "1", "--timeout", "60", "--rate", "100",
    )  # fmt: skip
    _until("D2 taking traffic", lambda: _counter(d2, "requests_ok") >= 10)
    d2.proc.send_signal(signal.SIGKILL)
    d2.proc.wait(10)
    other = ["--num-blocks", "256", "--layers", "2", "--block-bytes", "4096"]
    d2b = _restart_at(serve, "decode", free_port, *other)
    out, stderr = _finish(drive, n)
    assert f"decode {d2.address} answers but stays down: incompatible" in stderr, stderr
    assert "incompatible" not in out["failures_by_reason"], out["failures_by_reason"]
    snap = _snap(d2b)["counters"]
    assert snap.get("requests_ok", 0) + snap.get("requests_failed", 0) == 0, snap
    assert set(out["failures_by_reason"]) <= CUT, out["failures_by_reason"]


def test_a_p_still_starting_gets_no_traffic(
    serve: Launcher, free_port: int, tmp_path: Path
) -> None:
    pool = {"num_blocks": 256, "layers": 1, "block_bytes": 4096}
    p = serve.start("prefill", "--port", str(free_port), *POOL, *FAST)
    d = serve.start("decode", *POOL, "--heartbeat", "0.5")
    n = 400
    drive = _drive(
        "-p", p.address, "-d", d.address, "-n", str(n), "-c", "4", "--blocks", "1",
        "--timeout", "60", "--peer-grace", "60",
    )  # fmt: skip
    _until("D taking traffic", lambda: _counter(d, "requests_ok") >= 20)
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait(10)
    # The new P's side channel answers "starting" for 4 s before it serves.
    cfg = {
        "role": "prefill",
        "port": free_port,
        "pool": pool,
        "timeouts": {"lease_s": 3.0, "heartbeat_s": 0.5},
        "start_delay_s": 4.0,
    }
    ready = tmp_path / "slow-p.ready"
    slow = launch(node_cmd(cfg, ready), ready, tmp_path / "slow-p.log", role="prefill")
    serve.procs.append(slow)
    out, stderr = _finish(drive, n)
    assert f"prefill {p.address} answers but stays down: still starting" in stderr, stderr
    assert "bad_request" not in out["failures_by_reason"], out["failures_by_reason"]
    assert set(out["failures_by_reason"]) <= CUT, out["failures_by_reason"]
    assert out["failed"] <= 8, out["failures_by_reason"]


# ------------------------------------------------------------------ P restarted at another TP size

TP_GEOM = ["--num-blocks", "128", "--layers", "2", "--block-tokens", "4", "--kv-heads", "4",
           "--head-dim", "16", "--dtype", "float16"]  # fmt: skip


@pytest.mark.parametrize(("before", "after"), [(2, 1), (2, 4), (4, 2)], ids=lambda v: str(v))
def test_p_restarted_at_another_tp_size_is_relearnt(
    serve: Launcher, free_port: int, before: int, after: int
) -> None:
    p = serve.start("prefill", "--port", str(free_port), "--tp", str(before), *TP_GEOM, *FAST)
    d = serve.start("decode", "--tp", "2", *TP_GEOM, "--heartbeat", "0.5")
    n = 300
    drive = _drive(
        "-p", p.address, "-d", d.address, "-n", str(n), "-c", "4", "--blocks", "1",
        "--timeout", "60", "--peer-grace", "60",
    )  # fmt: skip
    _until("D taking traffic", lambda: _counter(d, "requests_ok") >= 20)
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait(10)
    p2 = _restart_at(serve, "prefill", free_port, "--tp", str(after), *TP_GEOM, *FAST)
    out, _ = _finish(drive, n)
    # Nothing the new size can serve is lost: no incompatible, no failed handshake.
    assert set(out["failures_by_reason"]) <= CUT, out["failures_by_reason"]
    assert out["failed"] <= 8, out["failures_by_reason"]
    assert _counter(p2, "prefills") > 0
    # A fresh run through the same D at the new size: all ok.
    r = subprocess.run(
        [*KVPUSH, "drive", "--json", "-p", p2.address, "-d", d.address, "-n", "60", "-c", "4",
         "--blocks", "1", "--timeout", "60"],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip
    again = json.loads(r.stdout)
    assert again["ok"] == 60, again["failures_by_reason"]

"""Readiness moved only by the endpoint's own health (issue 24, item 4): real ``serve-decode``
processes with ``--metrics-port``, real P processes, real NIXL and side channels on 127.0.0.1.

On main, one request every 8 s naming a closed P port (no token needed) kept a healthy idle D at
503, out of its Service where no good request could reset it, and a frozen P turned every D
unready. Now requests naming closed ports, and requests to a frozen P (they end ``deadline``),
leave D ready; a failure of D's own data path -- its P's WRITE failing on a working,
authenticated connection -- still turns it unready, until a request succeeds again.
"""

from __future__ import annotations

import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvpush.telemetry.names import OWN_FAILURES
from tests.conftest import unused_port
from tests.support.cluster import FAST_TIMEOUTS, SMALL_POOL
from tests.support.fault_legs import Result, run_leg, run_legs
from tests.support.procs import Launcher
from tests.support.side import remember_token, snapshot
from tests.support.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# The geometry of tests.support.cluster.SMALL_POOL, as serve-* flags.
SMALL = [
    "--num-blocks", str(SMALL_POOL["num_blocks"]), "--layers", str(SMALL_POOL["layers"]),
    "--block-bytes", str(SMALL_POOL["block_bytes"]),
]  # fmt: skip
FAST = ["--side-channel-timeout", "1", "--handshake-timeout", "2"]  # a closed port fails fast


def http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Prober:
    """Probes ``/readyz`` every 0.2 s on its own thread until stopped; keeps every answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prober", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.answers.append(http(self.url))

    def stop(self) -> list[tuple[int, str]]:
        self._stop.set()
        self._thread.join(30)
        self.answers.append(http(self.url))
        return self.answers


def failures(address: str) -> dict[str, int]:
    f = snapshot(address)["failures"]
    assert isinstance(f, dict)
    return f


def test_requests_naming_closed_ports_or_a_frozen_p_leave_an_idle_d_ready(
    serve: Launcher,
) -> None:
    mport = unused_port()
    d = serve.serve("decode", *SMALL, *FAST, "--metrics-port", str(mport))
    p = serve.serve("prefill", *SMALL)
    ready = f"http://127.0.0.1:{mport}/readyz"
    assert http(ready) == (200, "ok\n")
    prober = Prober(ready)
    try:
        # A flood naming ports nobody listens on: every request fails, D stays ready.
        closed = [f"127.0.0.1:{unused_port()}" for _ in range(8)]
        items = [(f"closed-{i}", closed[i % 8], d.address, 2) for i in range(40)]
        got = run_legs(items, concurrency=8, send_p=False, d_timeout_s=15)
        assert {r.reason for r in got} == {"prefill_unreachable"}, got
        assert failures(d.address)["prefill_unreachable"] >= 40
        # A frozen P: D's requests to it end at their deadline, P's fault; D stays ready.
        assert run_leg("warm", p.address, d.address, 2).outcome == "ok"
        os.kill(p.popen.pid, signal.SIGSTOP)
        try:
            frozen = run_legs(
                [(f"frozen-{i}", p.address, d.address, 2) for i in range(6)],
                concurrency=6,
                send_p=False,
                deadline_s=2.0,
                d_timeout_s=15,
            )
        finally:
            os.kill(p.popen.pid, signal.SIGCONT)
        assert {r.outcome for r in frozen} == {"failed"}, frozen
        assert not {r.reason for r in frozen} & OWN_FAILURES, frozen
        assert failures(d.address).get("deadline", 0) >= 1
    finally:
        answers = prober.stop()
    assert len(answers) >= 10, answers  # probed all along
    assert all(a == (200, "ok\n") for a in answers), [a for a in answers if a[0] != 200]
    # P thawed: D serves it again.
    assert run_leg("thawed", p.address, d.address, 2).outcome == "ok"


def test_its_own_failure_turns_d_unready_until_a_request_succeeds(
    serve: Launcher, tmp_path: Path
) -> None:
    """P and D share a token. After its first push P's NIXL forgets D's agent (the fault hook
    ``drop_agents_after``): P's next WRITE cannot be posted, P tells D over D's authenticated
    side channel, and D's request ends ``write_post_failed`` -- the transfer into D failed on a
    working connection: D's data path, counted against its readiness."""
    token = "readiness-test-token-0123456789"
    tfile = tmp_path / "token"
    tfile.write_text(token)
    tfile.chmod(0o600)
    mport = unused_port()
    d = serve.serve(
        "decode", *SMALL, *FAST, "--metrics-port", str(mport), "--auth-token-file", str(tfile)
    )
    remember_token(d.address, token)
    cfg = {
        "role": "prefill",
        "pool": dict(SMALL_POOL),
        "timeouts": dict(FAST_TIMEOUTS),
        "drop_agents_after": 1,
        "auth_token": token,
    }
    p = serve.node(cfg, "p")
    remember_token(p.address, token)
    ready = f"http://127.0.0.1:{mport}/readyz"

    def leg(tid: str) -> Result:
        return run_leg(tid, p.address, d.address, 4, d_timeout_s=15)

    r = leg("first")
    assert r.outcome == "ok", r
    assert http(ready) == (200, "ok\n")  # (this probe's sample follows the success)
    wait_for(lambda: "fault injection" in p.log_text(), 20, "P's NIXL dropping D's agent")
    r = leg("cut")
    assert (r.outcome, r.reason) == ("failed", "write_post_failed"), r
    status, body = http(ready)
    assert status == 503, body
    assert body.startswith("not ready: data path failing: 1 failure of its own"), body
    assert "(write_post_failed x1)" in body, body
    assert http(f"http://127.0.0.1:{mport}/healthz") == (200, "ok\n")  # alive all along
    # P evicted the peer; the next request handshakes afresh and succeeds: ready again.
    r = leg("healed")
    assert r.outcome == "ok", r
    assert http(ready) == (200, "ok\n")

"""``kvpush drive`` you can trust when peers die: real P and D processes on 127.0.0.1.

Every test checks the invariants: every request accounted for (the summary has exactly
``--requests`` results, ok + failed), every failure with a reason from the closed set
(``Failure``), pools back to their start counts, no leftover process. No timing is asserted:
where a run must not wait out a request timeout, the timeout given to drive is longer than the
test waits for the whole run, so waiting it out would fail the test.
"""

from __future__ import annotations

import functools
import json
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvpush.telemetry.names import Failure
from tests.support.fault_legs import Result, run_leg
from tests.support.legs import stats
from tests.support.procs import KVPUSH, Proc, clean_env
from tests.support.side import client, gauges

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

REASONS = {f.value for f in Failure}
POOL = ["--num-blocks", "256", "--layers", "1", "--block-bytes", "4096"]
# P gives up a request's finished blocks 3 s after its last news (its D died), so pools settle.
P_FAST = ["--lease", "3", "--heartbeat", "0.5"]


def _until(
    what: str, cond: Callable[[], bool], timeout: float = 60.0, seen: Callable[[], str] = str
) -> None:
    """Wait for ``cond``; on timeout, fail with ``seen()`` (what there was to see instead)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{seen()}")
        time.sleep(0.1)


def _counter(p: Proc, name: str) -> int:
    c = stats(p.address)["counters"]
    assert isinstance(c, dict)
    return int(c.get(name, 0))


def _pool_free(p: Proc) -> tuple[int, int]:
    g = stats(p.address)["gauges"]
    assert isinstance(g, dict)
    return int(g["pool_free"]), int(g["pool_total"])


def _all_free(p: Proc) -> bool:
    free, total = _pool_free(p)
    return free == total


def _settled(*procs: Proc) -> None:
    for p in procs:
        _until(f"{p.address}'s pool back to its start", functools.partial(_all_free, p))


def _accounted(out: dict[str, Any], n: int) -> None:
    assert out["requests"] == n
    assert out["ok"] + out["failed"] == n
    assert sum(out["failures_by_reason"].values()) == out["failed"]
    assert set(out["failures_by_reason"]) <= REASONS, out["failures_by_reason"]


def _drive(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*KVPUSH, "drive", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
    )


_PROGRESS = re.compile(r"drive: \d+/\d+ done, ")


class _Watched:
    """A drive run whose stderr (peer events, progress) and stdout are read as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = _drive(*args)
        err, std = self.proc.stderr, self.proc.stdout
        assert err is not None and std is not None
        self.err_lines: list[str] = []
        self._out: list[str] = []
        self._readers = [
            threading.Thread(target=lambda: self.err_lines.extend(iter(err.readline, ""))),
            threading.Thread(target=lambda: self._out.append(std.read())),
        ]
        for t in self._readers:
            t.start()

    def said(self, text: str) -> bool:
        return any(text in ln for ln in self.err_lines)

    def events(self) -> str:
        """Its stderr so far but the progress lines."""
        return "".join(ln for ln in self.err_lines if not _PROGRESS.match(ln))

    def said_all(self, pattern: re.Pattern[str]) -> list[str]:
        """The first group of each match of ``pattern`` in its stderr so far."""
        return pattern.findall("".join(self.err_lines))

    def finish(self, timeout: float) -> tuple[dict[str, Any], str]:
        """Its report and all of its stderr, once it exits within ``timeout``."""
        self.proc.wait(timeout)
        for t in self._readers:
            t.join(30)
        return json.loads(self._out[0]), "".join(self.err_lines)


def _above(count: Callable[[], int], than: int) -> Callable[[], bool]:
    return lambda: count() > than


def _one_p_two_ds(serve: Any) -> tuple[Proc, Proc, Proc]:
    p = serve.start("prefill", *POOL, *P_FAST)
    return p, serve.start("decode", *POOL), serve.start("decode", *POOL)


def test_concurrency_2000_accounts_for_every_request(serve, kvpush_run) -> None:
    big = ["--num-blocks", "2048", "--layers", "1", "--block-bytes", "4096"]
    p = serve.start("prefill", *big)
    d = serve.start("decode", *big)
    r = kvpush_run(
        "drive", "-p", p.address, "-d", d.address, "-n", "2000", "-c", "2000", "--blocks", "1",
        "--json", timeout=600,
    )  # fmt: skip
    out = json.loads(r.stdout)
    _accounted(out, 2000)
    assert r.returncode == (0 if out["all_verified"] else 1), r.stderr
    assert 0 < out["concurrency"] < 2000
    assert out["notes"][0].startswith("--concurrency 2000 is more side-channel connections")
    assert out["ok"] == 2000, out["failures_by_reason"]
    _settled(p, d)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_dying_decode_costs_only_its_own_requests(serve, sig: int) -> None:
    p, d1, d2 = _one_p_two_ds(serve)
    drive = _drive(
        "-p", p.address, "-d", d1.address, "-d", d2.address, "-n", "800", "-c", "8",
        "--blocks", "1", "--timeout", "300",
    )  # fmt: skip
    try:
        _until("D1 taking traffic", lambda: _counter(d1, "requests_ok") >= 20)
        d1.proc.send_signal(sig)
        before = _counter(d2, "requests_ok")
        stdout, stderr = drive.communicate(timeout=200)  # << --timeout 300
    finally:
        drive.kill()
    out = json.loads(stdout)
    _accounted(out, 800)
    assert drive.returncode == (0 if out["failed"] == 0 else 1), stderr
    assert _counter(d2, "requests_ok") > before  # the healthy D kept serving
    assert out["by_decode"][d2.address] > out["by_decode"][d1.address]
    assert f"decode {d1.address} is down" in stderr
    assert "Traceback" not in stderr
    d1.proc.wait(30)
    _settled(p, d2)


def _says_stopping(p: Proc) -> bool:
    with client(p.address, 5.0) as c:
        kv = c.identify().kvpush
    return kv is not None and kv.stopping


def test_a_draining_decode_is_sent_no_new_request(serve, kvpush_run) -> None:
    """D1 got SIGTERM and drains for as long as two requests it registered wait on P (P is never
    asked to prefill them). Its first-contact answer says it is shutting down, so drive marks
    it down at its first request and gives every request to D2: the draining D refuses none
    (before, drive kept sending to it, each request refused at once, until its port closed)."""
    p = serve.start("prefill", *POOL, *P_FAST)
    d1 = serve.start("decode", *POOL, "--drain-timeout", "120")
    d2 = serve.start("decode", *POOL)
    held: list[Result] = []
    legs = [
        threading.Thread(
            target=lambda i=i: held.append(
                run_leg(f"held{i}", p.address, d1.address, 1, send_p=False)
            )
        )
        for i in range(2)
    ]
    for t in legs:
        t.start()
    _until("D1's PUSH_REGs at P", lambda: gauges(p.address)["regs_waiting_blocks"] == 2)
    d1.proc.send_signal(signal.SIGTERM)
    _until("D1 to say it is shutting down", lambda: _says_stopping(d1))
    r = kvpush_run(
        "drive", "-p", p.address, "-d", d1.address, "-d", d2.address, "-n", "40", "-c", "4",
        "--blocks", "1", "--json", timeout=120,
    )  # fmt: skip
    out = json.loads(r.stdout)
    _accounted(out, 40)
    assert out["ok"] == 40, (out["failures_by_reason"], r.stderr)
    assert out["by_decode"] == {d2.address: 40}
    assert f"decode {d1.address} is down (shutting down)" in r.stderr
    # P stops: D1's two requests end (P tells D it writes nothing more), and so does its drain.
    p.proc.send_signal(signal.SIGTERM)
    for t in legs:
        t.join(60)
    assert [x.reason for x in held] == ["shutting_down"] * 2, held
    assert d1.proc.wait(60) == 0


@pytest.mark.slow
def test_a_frozen_decode_is_routed_around(serve) -> None:
    p, d1, d2 = _one_p_two_ds(serve)
    drive = _Watched(
        "-p", p.address, "-d", d1.address, "-d", d2.address, "-n", "100000", "-c", "8",
        "--blocks", "1", "--timeout", "20",
    )  # fmt: skip
    down = f"decode {d1.address} is down (no answer to a liveness check"
    try:
        _until("D1 taking traffic", lambda: _counter(d1, "requests_ok") >= 20)
        n0 = _counter(d2, "requests_ok")
        time.sleep(2)
        rate_before = _counter(d2, "requests_ok") - n0  # D2's requests in 2 s, D1 healthy
        d1.proc.send_signal(signal.SIGSTOP)
        try:
            before = _counter(d2, "requests_ok")
            # The first 2 s of the freeze, before drive can tell that D1 is frozen: D2 keeps
            # its throughput (D1 holds only its own workers, not everyone's).
            time.sleep(2)
            rate_frozen = _counter(d2, "requests_ok") - before
            assert rate_frozen >= rate_before / 4, (rate_before, rate_frozen)
            # drive marks D1 down; D2 goes on, taking everything.
            _until("drive to mark D1 down", lambda: drive.said(down))
            marked = _counter(d2, "requests_ok")
            _until(
                "D2 serving while D1 is down", lambda: _counter(d2, "requests_ok") > marked + 100
            )
        finally:
            d1.proc.send_signal(signal.SIGCONT)
        thawed = _counter(d1, "requests_ok")
        _until("D1 back in the rotation", lambda: _counter(d1, "requests_ok") > thawed + 20)
        drive.proc.send_signal(signal.SIGINT)  # the partial summary of an interrupted run
        out, stderr = drive.finish(120)
    finally:
        drive.proc.kill()
    _accounted(out, 100000)
    assert drive.proc.returncode == 130
    assert out["interrupted"] is True
    assert down in stderr
    assert f"decode {d1.address} is back up" in stderr
    assert "drive: interrupted (SIGINT)" in stderr
    assert "Traceback" not in stderr
    _settled(p, d1, d2)


def test_a_frozen_decode_that_is_then_killed_fails_what_it_held_at_once(serve) -> None:
    """D1 freezes (SIGSTOP) while it holds requests: drive marks it down, not dead (they may
    still finish if it thaws). Then it is killed: its port refuses, and what it held fails at
    once -- not at drive's --timeout (300 s, longer than this test waits). A freeze that found
    D1 holding nothing (between two requests of each of its workers) is thawed and tried again."""
    p, d1, d2 = _one_p_two_ds(serve)
    drive = _Watched(
        "-p", p.address, "-d", d1.address, "-d", d2.address, "-n", "100000", "-c", "16",
        "--blocks", "1", "--timeout", "300",
    )  # fmt: skip
    down = re.compile(
        rf"decode {re.escape(d1.address)} is down \(no answer to a liveness check[^)]*\): "
        r"(\d+) requests already sent there wait"
    )
    back = re.compile(rf"decode {re.escape(d1.address)} (is back up)")
    try:
        held = 0
        for k in range(5):
            n = _counter(d1, "requests_ok")
            _until("D1 taking traffic", _above(lambda: _counter(d1, "requests_ok"), n + 19))
            d1.proc.send_signal(signal.SIGSTOP)
            _until("drive to mark D1 down", _above(lambda: len(drive.said_all(down)), k))
            held = int(drive.said_all(down)[-1])
            if held:
                break
            d1.proc.send_signal(signal.SIGCONT)
            _until("D1 back up", _above(lambda: len(drive.said_all(back)), k))
        assert held, "D1 held no request in five freezes"
        d1.proc.send_signal(signal.SIGKILL)
        gone = f"decode {d1.address} is gone (connection refused): {held} requests in flight"
        _until("D1's requests to fail", lambda: drive.said(gone), seen=drive.events)
        drive.proc.send_signal(signal.SIGINT)  # the partial summary of an interrupted run
        out, stderr = drive.finish(120)
    finally:
        drive.proc.kill()
    _accounted(out, 100000)
    assert out["failures_by_reason"].get("decode_unreachable", 0) >= held, out
    assert "Traceback" not in stderr
    _settled(p, d2)


def test_no_decode_left_fails_the_rest_at_once(serve) -> None:
    p = serve.start("prefill", *POOL, *P_FAST)
    d = serve.start("decode", *POOL)
    drive = _drive(
        "-p", p.address, "-d", d.address, "-n", "100000", "-c", "4", "--blocks", "1",
        "--timeout", "300",
    )  # fmt: skip
    try:
        _until("D taking traffic", lambda: _counter(d, "requests_ok") >= 20)
        d.proc.send_signal(signal.SIGKILL)
        stdout, stderr = drive.communicate(timeout=200)  # 100000 requests, no D: milliseconds
    finally:
        drive.kill()
    out = json.loads(stdout)
    _accounted(out, 100000)
    assert drive.returncode == 1
    assert set(out["failures_by_reason"]) == {"decode_unreachable"}
    assert out["failed"] > 90000
    assert f"decode {d.address} is down (connection refused)" in stderr
    _settled(p)


@pytest.mark.slow
def test_a_dying_prefill_ends_the_run_without_waiting_out_timeouts(serve) -> None:
    # D learns that P is gone from its own heartbeats (the endpoint's part); drive marks P down
    # at once and fails what is left with prefill_unreachable.
    p = serve.start("prefill", *POOL, *P_FAST)
    d1 = serve.start("decode", *POOL, "--heartbeat", "0.5")
    d2 = serve.start("decode", *POOL, "--heartbeat", "0.5")
    drive = _drive(
        "-p", p.address, "-d", d1.address, "-d", d2.address, "-n", "100000", "-c", "8",
        "--blocks", "1", "--timeout", "300",
    )  # fmt: skip
    try:
        _until("P taking traffic", lambda: _counter(d1, "requests_ok") >= 20)
        p.proc.send_signal(signal.SIGKILL)
        stdout, stderr = drive.communicate(timeout=200)  # << --timeout 300
    finally:
        drive.kill()
    out = json.loads(stdout)
    _accounted(out, 100000)
    assert drive.returncode == 1
    assert out["failures_by_reason"]["prefill_unreachable"] > 90000
    assert f"prefill {p.address} is down (connection refused)" in stderr
    assert "Traceback" not in stderr
    _settled(d1, d2)

"""The freeze watchdog (kvpush.runtime.watchdog) against real threads that really block.

A loop thread beats its heartbeat, then blocks (on a lock another thread holds): the watchdog
reports it once per stall with the stack it is blocked in, counts it and raises the gauge, and
lowers the gauge when it moves again. A native call that holds the interpreter lock
(``ctypes.PyDLL``'s ``usleep``: libc's sleep called with the lock held) stops every Python
thread, the watchdog's too: it is reported as a stall of the whole process once the lock comes
back, and ``py-spy dump --native`` shows the call *during* it (docs/reliability.md's recipe).
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from rich.console import Console

from kvpush.commands.common.live import render_live
from kvpush.config import Role
from kvpush.runtime.watchdog import PROCESS, Watchdog
from kvpush.telemetry.heartbeat import Heartbeat
from kvpush.telemetry.names import Counter, Gauge
from kvpush.telemetry.prom import snapshot_families
from kvpush.telemetry.snapshot import Snapshot
from kvpush.telemetry.store import Telemetry
from tests.support.procs import ROOT, clean_env

TIMEOUT = 0.4


def wait_for(cond: Callable[[], object], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


class _Registry:
    """A one-snapshot collector registry for ``generate_latest``."""

    def __init__(self, snap: Snapshot) -> None:
        self._snap = snap

    def collect(self) -> list[Metric]:
        return snapshot_families(self._snap)


def _text(renderable: object) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


class Looper:
    """A real loop thread: beats on every pass; blocks on ``gate`` while the test holds it."""

    def __init__(self, name: str) -> None:
        self.hb = Heartbeat(name)
        self.gate = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        self.hb.start()
        try:
            while not self.stop.is_set():
                self.hb.beat()
                with self.gate:  # blocks for real while the test holds the gate
                    pass
                time.sleep(0.005)
        finally:
            self.hb.park()

    def __enter__(self) -> Looper:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.gate.locked():
            self.gate.release()
        self.thread.join(5)


def test_a_blocked_thread_is_reported_once_with_its_stack_and_recovers() -> None:
    tm = Telemetry(Role.DECODE, "d-test")
    wd = Watchdog(TIMEOUT, period_s=0.05)
    with Looper("receiver-test") as lp, Looper("sidechannel-test") as healthy:
        wd.watch(lp.hb, tm)
        wd.watch(healthy.hb, tm)
        wd.start()
        try:
            time.sleep(3 * TIMEOUT)
            assert wd.stalls == []  # moving threads are never reported
            lp.gate.acquire()
            assert wait_for(lambda: len(wd.stalls) == 1)
            time.sleep(4 * TIMEOUT)  # still blocked: still one report
            assert [s.name for s in wd.stalls] == ["receiver-test"]
            stall = wd.stalls[0]
            assert stall.stalled_s >= TIMEOUT
            assert "in _run" in stall.stack and "with self.gate" in stall.stack
            snap = tm.snapshot()
            assert snap.counters[Counter.WATCHDOG_STALLS] == 1
            assert snap.gauges[Gauge.THREADS_STALLED] == 1
            # The same snapshot feeds -o json, the live view and Prometheus.
            counters = snap.to_dict()["counters"]
            assert isinstance(counters, dict) and counters["watchdog_stalls"] == 1
            page = generate_latest(_Registry(snap)).decode()
            assert 'kvpush_watchdog_stalls_total{engine_id="d-test",role="decode"} 1.0' in page
            assert 'kvpush_threads_stalled{engine_id="d-test",role="decode"} 1.0' in page
            assert "threads stalled now" in _text(render_live(snap))
            lp.gate.release()
            assert wait_for(lambda: tm.snapshot().gauges[Gauge.THREADS_STALLED] == 0)
            # A second stall is a second report.
            lp.gate.acquire()
            assert wait_for(lambda: len(wd.stalls) == 2)
            lp.gate.release()
            assert tm.snapshot().counters[Counter.WATCHDOG_STALLS] == 2
        finally:
            wd.stop()


def test_an_allowed_wait_and_a_parked_thread_are_not_stalls() -> None:
    wd = Watchdog(TIMEOUT, period_s=0.05)
    with Looper("owner-drain") as lp:
        wd.watch(lp.hb)
        assert wait_for(lambda: not lp.hb.parked)
        lp.gate.acquire()
        lp.hb.allow_until(time.monotonic() + 3 * TIMEOUT)  # e.g. a drain until its deadline
        assert wd.check(time.monotonic() + 2 * TIMEOUT) == []
        assert [s.name for s in wd.check(time.monotonic() + 4.5 * TIMEOUT)] == ["owner-drain"]
        lp.hb.park()  # the thread has ended: never reported again
        assert wd.check(time.monotonic() + 100) == []
        assert wd.stalled() == 0


def test_the_watchdog_thread_outlives_a_broken_callback() -> None:
    def boom(stall: object) -> None:
        raise RuntimeError("callback bug")

    wd = Watchdog(TIMEOUT, period_s=0.05, on_stall=boom)
    with Looper("owner-x") as lp:
        wd.watch(lp.hb)
        wd.start()
        try:
            lp.gate.acquire()
            assert wait_for(lambda: len(wd.stalls) == 1)
            moved = lp.hb.count
            lp.gate.release()
            assert wait_for(lambda: lp.hb.count > moved + 1)
            lp.gate.acquire()
            assert wait_for(lambda: len(wd.stalls) == 2)  # still watching
            lp.gate.release()
        finally:
            wd.stop()


def test_a_watchdog_needs_a_positive_timeout() -> None:
    with pytest.raises(ValueError):
        Watchdog(0)


GIL_HELD = r"""
import ctypes, logging, sys, threading, time
from kvpush.runtime.watchdog import Watchdog
from kvpush.telemetry.heartbeat import Heartbeat
from kvpush.telemetry.store import Telemetry
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
tm = Telemetry("decode", "d-gil")
hb = Heartbeat("receiver-gil")
stop = threading.Event()
def loop():
    hb.start()
    while not stop.is_set():
        hb.beat()
        time.sleep(0.005)
t = threading.Thread(target=loop, daemon=True); t.start()
wd = Watchdog(0.5, period_s=0.1)
wd.watch(hb, tm)
wd.start()
time.sleep(0.5)
def native_call_holding_the_gil():
    ctypes.PyDLL(None).usleep(int(float(sys.argv[1]) * 1e6))  # libc, the lock held throughout
print("holding", flush=True)
native_call_holding_the_gil()
time.sleep(0.6)
stop.set(); wd.stop()
print("stalls", [s.name for s in wd.stalls], tm.snapshot().counters.get("watchdog_stalls"))
"""
PY_SPY = Path(sys.executable).parent / "py-spy"


@pytest.mark.timeout(90)
def test_a_native_call_holding_the_gil_is_reported_after_and_seen_by_py_spy_during() -> None:
    hold_s = 8.0 if PY_SPY.exists() else 2.5
    p = subprocess.Popen(
        [sys.executable, "-c", GIL_HELD, str(hold_s)],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "holding"
    during = ""
    if PY_SPY.exists():  # the recipe of docs/reliability.md for the stall in progress
        during = subprocess.run(
            [str(PY_SPY), "dump", "--native", "--pid", str(p.pid)],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    # After: the whole process is reported once the lock is back; the loop thread is not
    # reported on top of it (every heartbeat was stale for the same reason).
    assert out.strip() == f"stalls ['{PROCESS}'] 1", out + err
    assert "watchdog: process made no progress for" in err
    if PY_SPY.exists():
        # During: the thread holding the lock, in the native call, from its Python caller.
        assert "native_call_holding_the_gil" in during, during
        assert "usleep" in during or "nanosleep" in during or "clock_nanosleep" in during, during

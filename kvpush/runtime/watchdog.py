"""The freeze watchdog: every long-lived loop publishes progress; one thread reports a loop that
made none, once per stall, with its stack -- so a freeze is never silent.

Owns ``Watchdog``: one thread per endpoint that reads the ``Heartbeat`` of each watched thread
(``kvpush.telemetry.heartbeat``: a counter and the time of the last pass, bumped by that thread
on every loop iteration; parked when the thread has ended). The endpoint's side channel and
every rank's owner thread (P's writer, D's receiver) are watched (``kvpush.endpoint.core``).

A thread whose heartbeat has not moved for ``timeout_s`` is reported once per stall: a warning
with its Python stack (``sys._current_frames``), ``watchdog_stalls`` counted and the
``threads_stalled`` gauge raised in the telemetry it was registered with (so ``-o json``, the
live view and Prometheus show it); when it moves again the gauge drops and the recovery is
logged. A thread may announce a phase in which it legitimately waits longer (``allow_until``,
e.g. its drain until the drain deadline): it is then reported only ``timeout_s`` after that.

What the watchdog cannot see from Python: a native call that holds the interpreter lock. Then
no Python thread runs, this one included. The watchdog measures its own lateness: when its wait
overran by ``timeout_s``, the whole process stood still, and it reports that (as the thread
``process``) once the lock comes back. Where the process is stuck *during* such a stall, only an
outside look shows: ``py-spy dump --native --pid PID`` (docs/reliability.md, "Freeze
watchdog"). faulthandler's C timer (``dump_traceback_later``) would dump the stacks without the
lock, but it reads the frames of running threads unlocked: when a stopped or starved process
runs again, the dump races its threads and was seen to kill the endpoint it was to report on.

Threads: heartbeats are written by their own thread only (two attribute stores, no lock) and read
by the watchdog thread; ``stalled()`` and the gauges may be read from any thread.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from kvpush.telemetry.heartbeat import Heartbeat
from kvpush.telemetry.names import Counter, Gauge
from kvpush.telemetry.store import Telemetry

log = logging.getLogger(__name__)

#: The pseudo-thread that stands for "every thread": a stall of the whole process.
PROCESS = "process"


@dataclass(frozen=True)
class Stall:
    """One reported stall: which thread, since how long, the stack it was in."""

    name: str
    stalled_s: float
    stack: str


@dataclass
class _Watched:
    hb: Heartbeat
    telemetry: Telemetry | None
    reported_at_count: int = -1  # the heartbeat count when its current stall was reported


class Watchdog:
    """Reports watched threads that make no progress for ``timeout_s`` (see the module doc)."""

    def __init__(
        self,
        timeout_s: float,
        *,
        period_s: float | None = None,
        name: str = "watchdog",
        on_stall: Callable[[Stall], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("a watchdog needs a positive timeout")
        self.timeout_s = timeout_s
        self.period_s = period_s if period_s is not None else min(1.0, timeout_s / 4)
        self._on_stall = on_stall
        self._lock = threading.Lock()
        self._watched: list[_Watched] = []
        self._process: _Watched | None = None
        self._process_tm: Telemetry | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.stalls: list[Stall] = []  # every stall reported, in order (tests, reports)

    # ------------------------------------------------------------------ set-up
    def watch(self, hb: Heartbeat, telemetry: Telemetry | None = None) -> None:
        """Watch ``hb``; its stalls are counted in ``telemetry`` (and whole-process stalls in the
        first telemetry given)."""
        with self._lock:
            self._watched.append(_Watched(hb, telemetry))
            if telemetry is not None and self._process_tm is None:
                self._process_tm = telemetry
        if telemetry is not None:
            telemetry.declare(counters=(Counter.WATCHDOG_STALLS,))
            telemetry.gauge_fn(Gauge.THREADS_STALLED, functools.partial(self.stalled, telemetry))

    # ------------------------------------------------------------------ readers (any thread)
    def stalled(self, telemetry: Telemetry | None = None) -> int:
        """How many watched threads are stalled now (those counted in ``telemetry``, if given)."""
        with self._lock:
            rows = list(self._watched)
            proc = self._process
        n = sum(
            1
            for w in rows
            if w.reported_at_count == w.hb.count
            and not w.hb.parked
            and (telemetry is None or w.telemetry is telemetry)
        )
        if proc is not None and (telemetry is None or telemetry is self._process_tm):
            n += 1
        return n

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.period_s + 5)

    # ------------------------------------------------------------------ the check
    def check(self, now: float | None = None) -> list[Stall]:
        """One pass: report threads newly stalled, note those that moved again. Returns the new
        stalls (tests call it directly)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            rows = list(self._watched)
        frames: dict[int, FrameType] | None = None
        new: list[Stall] = []
        for w in rows:
            hb = w.hb
            if hb.parked:
                continue
            count, last = hb.count, hb.last
            if w.reported_at_count >= 0 and count != w.reported_at_count:
                log.warning(
                    "watchdog: %s made progress again (%d passes since it was reported)",
                    hb.name,
                    count - w.reported_at_count,
                )
                w.reported_at_count = -1
            quiet = now - max(last, hb.allowed_until)
            if quiet < self.timeout_s or w.reported_at_count == count:
                continue
            if frames is None:
                frames = dict(sys._current_frames())
            frame = frames.get(hb.ident) if hb.ident is not None else None
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
            stall = Stall(hb.name, now - last, stack)
            w.reported_at_count = count
            self._report(stall, w.telemetry)
            new.append(stall)
        return new

    def _report(self, stall: Stall, telemetry: Telemetry | None) -> None:
        self.stalls.append(stall)
        if telemetry is not None:
            telemetry.inc(Counter.WATCHDOG_STALLS)
        log.warning(
            "watchdog: %s made no progress for %.1fs (--watchdog-timeout %gs); its stack:\n%s"
            "(native frames: py-spy dump --native --pid <pid>)",
            stall.name,
            stall.stalled_s,
            self.timeout_s,
            stall.stack.rstrip("\n") + "\n",
        )
        if self._on_stall is not None:
            try:
                self._on_stall(stall)
            except Exception:
                log.exception("watchdog: the stall callback failed")

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            self._stop.wait(self.period_s)
            now = time.monotonic()
            late = now - last - self.period_s
            last = now
            if late >= self.timeout_s:
                # Nothing Python ran for that long, this thread included: a native call held
                # the interpreter lock, or the process was stopped or starved of CPU.
                with self._lock:
                    self._process = _Watched(Heartbeat(PROCESS), self._process_tm)
                self._report(
                    Stall(
                        PROCESS,
                        late,
                        "(every thread: the interpreter lock was held, or the process was "
                        "stopped or starved; py-spy dump --native shows where, during it)\n",
                    ),
                    self._process_tm,
                )
                continue  # every heartbeat is stale now: give the threads a period to move
            if self._process is not None:
                with self._lock:
                    self._process = None
            try:
                self.check(now)
            except Exception:  # the watchdog must outlive anything it reads
                log.exception("watchdog: a check failed")

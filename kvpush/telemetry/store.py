"""The live metrics store of one endpoint: counters, failures, histograms, gauges, peer rows.

Worker threads (writer, receiver, side channel, handshake threads) bump it with
``inc``/``fail``/``observe``. ``fail`` is a dict update under a short lock; ``inc`` and ``observe``,
on every push's path, only append to a queue (atomic, no lock), folded into the counters and
buckets in runs by the thread that fills it and by every snapshot before it reads: a snapshot
sees everything bumped before it. Nothing here runs a thread. Readers never touch live state:
``Telemetry.snapshot()`` folds, then copies the counters and histogram buckets under their locks,
reads the registered gauge and peer callables (a P's peer rows get their ``lane`` fields there:
``peer_extras_fn``), and hands the raw readings to the pure functions of
``kvpush.telemetry.snapshot`` that build a frozen ``Snapshot``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from itertools import islice
from typing import TypeVar

import numpy as np

from kvpush.config import Role
from kvpush.telemetry.names import RATE_COUNTERS
from kvpush.telemetry.snapshot import (
    _HIGH,
    _LOG_LOW,
    _LOW,
    _NB,
    _PER_DECADE,
    BUCKET_BOUNDS,
    HistSnapshot,
    Snapshot,
    hist_snapshot,
    window_rates,
)

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_ceil = math.ceil
_log10 = math.log10
_BOUNDS = np.array(BUCKET_BOUNDS, dtype=np.float64)

#: Queued values from which a histogram's fold is done by numpy (below, its fixed cost of
#: ~30 us is more than the loop's ~0.3 us a value saves).
VECTOR_AT = 256


class Histogram:
    """Counts of observed durations in fixed log-spaced buckets.

    ``observe`` only queues the value (a deque append: atomic, no lock), and the queue is folded
    into the buckets in runs of ``FOLD_AT`` by the thread that fills it, and by ``snapshot``
    before it reads: a snapshot sees every value observed before it. P's writer observes six
    values a push and D's receiver five; one at a time each paid a lock and the bucket
    arithmetic with cold caches between two WRITEs' copies (BENCHMARKS.md, issue 30).
    """

    __slots__ = ("_counts", "_lock", "_max", "_min", "_n", "_queued", "_sum")

    #: Values queued before the observing thread folds them (a run this long is bucketed by
    #: numpy at ~0.12 us a value; by the loop it was ~0.3, in runs of 128: ``_fold``).
    FOLD_AT = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: deque[float] = deque()
        self._counts = [0] * (_NB + 1)
        self._n = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = 0.0

    def observe(self, seconds: float) -> None:
        q = self._queued
        q.append(seconds)
        if len(q) >= self.FOLD_AT:
            with self._lock:
                self._fold()

    def observe_many(self, values: Iterable[float]) -> None:
        """``observe`` of each value, queued in one call (a batch's pushes end together)."""
        q = self._queued
        q.extend(values)
        if len(q) >= self.FOLD_AT:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Every queued value into the buckets (under the lock: only lock holders pop, so the
        values counted here are all there; others may append meanwhile, for the next fold).
        A run of ``VECTOR_AT`` or more is bucketed by numpy, a short one (a snapshot's) by the
        loop: the same rules (``tests/unit/test_histogram_fold.py``)."""
        q = self._queued
        k = len(q)
        if k >= VECTOR_AT:
            # (``popleft`` called k times from C, no Python frame a value: 0.06-0.11 us a
            # value, where a generator took 0.14)
            self._fold_array(np.fromiter(islice(iter(q.popleft, None), k), np.float64, count=k))
        else:
            self._fold_loop(k)

    def _fold_loop(self, k: int) -> None:
        """``_fold`` of the first ``k`` queued values, one at a time."""
        q = self._queued
        counts = self._counts
        bounds = BUCKET_BOUNDS
        n, total, lo, hi = self._n, self._sum, self._min, self._max
        for _ in range(k):
            seconds = q.popleft()
            # _bucket_index inlined
            if seconds > _LOW:
                if seconds > _HIGH:
                    i = _NB
                else:
                    i = _ceil((_log10(seconds) - _LOG_LOW) * _PER_DECADE)
                    if seconds > bounds[i]:
                        i += 1
                    elif seconds <= bounds[i - 1]:
                        i -= 1
            elif seconds >= 0.0:
                i = 0
            elif seconds < 0.0:  # a clock step: a negative duration counts as zero
                i, seconds = 0, 0.0
            else:  # NaN: a broken clock reading, not a duration
                continue
            counts[i] += 1
            n += 1
            total += seconds
            if seconds > hi:
                hi = seconds
            if seconds < lo:
                lo = seconds
        self._n, self._sum, self._min, self._max = n, total, lo, hi

    def _fold_array(self, v: np.ndarray) -> None:
        """``_fold`` of ``v``, the loop's rules vectorised: NaN skipped, a negative duration
        counted as zero, bucket i the first whose bound is >= the value (``_NB``: above all)."""
        v = v[~np.isnan(v)]
        if not v.size:
            return
        v = np.maximum(v, 0.0)
        per = np.bincount(np.searchsorted(_BOUNDS, v, side="left"), minlength=_NB + 1)
        counts = self._counts
        for i in np.flatnonzero(per).tolist():
            counts[i] += int(per[i])
        self._n += int(v.size)
        with np.errstate(over="ignore"):  # (a sum past the float range is inf, as in the loop)
            self._sum += float(v.sum())
        self._min = min(self._min, float(v.min()))
        self._max = max(self._max, float(v.max()))

    def snapshot(self) -> HistSnapshot:
        with self._lock:
            self._fold()
            counts = list(self._counts)
            total, sum_, lo, hi = self._n, self._sum, self._min, self._max
        return hist_snapshot(counts, total, sum_, lo, hi)


# --- the store --------------------------------------------------------------------------------

_Scalar = str | int | float


def _float_of(fn: Callable[[], float]) -> float:
    """A gauge's reading as a float (the conversion may raise, as the call may)."""
    return float(fn())


def _peer_value(v: object, depth: int = 0) -> object:
    """A peer-row value as JSON can carry it: scalars kept, NaN/inf -> None, lists and dicts
    of them kept (two levels: a row's ``lane``), others -> str."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if v is None or isinstance(v, (str, int, bool)):
        return v
    if depth < 2 and isinstance(v, (list, tuple)):
        return [_peer_value(x, depth + 1) for x in v]
    if depth < 2 and isinstance(v, dict):
        return {str(k): _peer_value(x, depth + 1) for k, x in v.items()}
    return str(v)


class Telemetry:
    """Metrics of one endpoint: bumped by workers, read as a ``Snapshot``.

    ``inc``, ``fail`` and ``observe`` may be called from any thread. ``gauge_fn`` and ``peers_fn``
    register callables that the snapshot calls on the reader's thread; they must be cheap and
    thread-safe (a ``len()`` of a queue, a copy of a small table).
    """

    #: Rates average over about this many seconds (a sample ring refreshed by ``snapshot()``).
    RATE_WINDOW_S = 3.0
    #: ``snapshot()`` calls closer together than this share a rate sample.
    RATE_SAMPLE_MIN_S = 0.2

    def __init__(
        self,
        role: Role,
        engine_id: str,
        incarnation: str = "",
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.role = role
        self.engine_id = engine_id
        self.incarnation = incarnation
        self._clock = clock
        self._wall = wall_clock
        self._started = clock()
        self._lock = threading.Lock()  # guards _counters and _failures
        self._counters: dict[str, int] = {}
        # Increments not yet added to ``_counters`` (``inc``): folded like a histogram's values.
        self._incs: deque[tuple[str, int]] = deque()
        self._failures: dict[str, int] = {}
        self._hists: dict[str, Histogram] = {}
        self._gauges: dict[str, Callable[[], float]] = {}
        self._peer_sources: list[Callable[[], list[dict[str, object]]]] = []
        self._peer_extras: list[Callable[[], Mapping[str, Mapping[str, object]]]] = []
        self._info: dict[str, _Scalar] = {}
        self._broken_sources: set[str] = set()  # logged once each
        self._rate_lock = threading.Lock()
        self._samples: deque[tuple[float, tuple[int, ...]]] = deque()
        self._samples.append((self._started, (0,) * len(RATE_COUNTERS)))

    # -- writers (any thread, hot path) --

    def inc(self, counter: str, n: int = 1) -> None:
        q = self._incs
        q.append((counter, n))  # (atomic: no lock on the hot path)
        if len(q) >= Histogram.FOLD_AT:
            with self._lock:
                self._fold_incs()

    def _fold_incs(self) -> None:
        """Every queued increment into ``_counters`` (under the lock, as ``Histogram._fold``)."""
        q, counters = self._incs, self._counters
        for _ in range(len(q)):
            counter, n = q.popleft()
            counters[counter] = counters.get(counter, 0) + n

    def fail(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + n

    def observe(self, hist: str, seconds: float) -> None:
        h = self._hists.get(hist)
        if h is None:
            with self._lock:
                h = self._hists.setdefault(hist, Histogram())
        h.observe(seconds)

    def observe_many(self, hist: str, values: Iterable[float]) -> None:
        """``observe`` of each value into ``hist``, in one call."""
        h = self._hists.get(hist)
        if h is None:
            with self._lock:
                h = self._hists.setdefault(hist, Histogram())
        h.observe_many(values)

    def declare(
        self,
        counters: Iterable[str] = (),
        failures: Iterable[str] = (),
        histograms: Iterable[str] = (),
    ) -> None:
        """Make names appear (at zero) before their first event, so scrapes see every series."""
        with self._lock:
            for c in counters:
                self._counters.setdefault(c, 0)
            for f in failures:
                self._failures.setdefault(f, 0)
            for h in histograms:
                self._hists.setdefault(h, Histogram())

    # -- set-up (usually at start) --

    def gauge_fn(self, name: str, fn: Callable[[], float]) -> None:
        """Read ``fn()`` at snapshot time as gauge ``name`` (a later call for the name replaces)."""
        with self._lock:
            self._gauges[name] = fn

    def peers_fn(self, fn: Callable[[], list[dict[str, object]]]) -> None:
        """Add a source of per-peer rows; the snapshot concatenates the rows of every source.

        Row keys: peer, engine_id, mode, state, duration_s, failures, last_error (a P's rows:
        also lane and lane_flags, ``peer_extras_fn``).
        """
        with self._lock:
            self._peer_sources.append(fn)

    def peer_extras_fn(self, fn: Callable[[], Mapping[str, Mapping[str, object]]]) -> None:
        """Add fields to peer rows at snapshot time: ``fn()`` maps a row's ``peer`` to its
        extra fields (P's ``lane`` and ``lane_flags``: ``kvpush.prefill.lanestats``). Called on
        the reader's thread, like ``peers_fn``."""
        with self._lock:
            self._peer_extras.append(fn)

    def info(self, **kv: str | int | float) -> None:
        with self._lock:
            self._info.update(kv)

    # -- readers --

    def snapshot(self) -> Snapshot:
        now = self._clock()
        with self._lock:
            self._fold_incs()
            counters = dict(self._counters)
            failures = dict(self._failures)
            hists = dict(self._hists)
            gauge_fns = dict(self._gauges)
            peer_sources = list(self._peer_sources)
            extras = list(self._peer_extras)
            info = dict(self._info)
        return Snapshot(
            ts=self._wall(),
            role=self.role,
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            uptime_s=max(0.0, now - self._started),
            info=info,
            counters=counters,
            failures=failures,
            gauges=self._read_gauges(gauge_fns),
            rates=self._rates(now, counters),
            histograms={name: h.snapshot() for name, h in sorted(hists.items())},
            peers=self._read_peers(peer_sources, extras),
        )

    def _rates(self, now: float, counters: dict[str, int]) -> dict[str, float]:
        current = (now, tuple(counters.get(n, 0) for n in RATE_COUNTERS))
        with self._rate_lock:
            samples = self._samples
            # Keep the newest sample that is at least a window old as the base.
            while len(samples) > 1 and samples[1][0] <= now - self.RATE_WINDOW_S:
                samples.popleft()
            rates = window_rates(samples[0], current, RATE_COUNTERS)
            if now - samples[-1][0] >= self.RATE_SAMPLE_MIN_S:
                samples.append(current)
        return rates

    def _read_gauges(self, fns: dict[str, Callable[[], float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, fn in fns.items():
            value = self._guarded(f"gauge {name}", partial(_float_of, fn))
            if value is not None and math.isfinite(value):  # NaN/inf have no JSON form
                out[name] = value
        return out

    def _read_peers(
        self,
        sources: list[Callable[[], list[dict[str, object]]]],
        extras: list[Callable[[], Mapping[str, Mapping[str, object]]]],
    ) -> list[dict[str, object]]:
        rows: list[dict[str, object]] = []
        for fn in sources:
            got = self._guarded(f"peers source {fn!r}", fn)
            if got is not None:
                rows.extend({str(k): _peer_value(v) for k, v in row.items()} for row in got)
        for extra in extras:
            more = self._guarded(f"peer fields {extra!r}", extra)
            if more is None:
                continue
            for row in rows:
                add = more.get(str(row.get("peer", "")))
                if add:
                    row.update({str(k): _peer_value(v) for k, v in add.items()})
        return rows

    def _guarded(self, what: str, fn: Callable[[], _T]) -> _T | None:
        """``fn()``, or None when it raises: a broken source must not break the scrape or the
        view; it is left out, and logged once (``what`` names it)."""
        try:
            return fn()
        except Exception as e:
            self._report_broken(what, e)
            return None

    def _report_broken(self, what: str, e: Exception) -> None:
        if what not in self._broken_sources:
            self._broken_sources.add(what)
            logger.warning(
                "telemetry: %s raised %s: %s (left out of snapshots)", what, type(e).__name__, e
            )

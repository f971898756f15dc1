"""Telemetry readings as data: fixed histogram buckets, the frozen ``Snapshot`` and pure helpers.

Histograms use fixed log-spaced buckets (10 per decade from 1 µs to 1000 s, bounds rounded to three
significant digits so that Prometheus ``le`` labels read cleanly). Percentiles are interpolated
geometrically inside a bucket, so they are within one bucket width (a factor 10**0.1 ≈ 1.26) of the
exact value, and usually much closer. Everything here is pure: the live view, ``--json`` lines,
``kvpush probe --stats`` and the Prometheus exporter all read these types. ``HistSnapshot`` is
re-exported from ``kvpush.stats_schema``, where readers that may not import the telemetry (the
bench) find the same definition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from kvpush.config import Role
from kvpush.stats_schema import HistSnapshot
from kvpush.telemetry.names import POOL_GAUGES, QUEUE_GAUGES, RATE_COUNTERS

__all__ = [
    "BUCKET_BOUNDS",
    "POOL_GAUGES",
    "QUEUE_GAUGES",
    "RATE_COUNTERS",
    "HistSnapshot",
    "Snapshot",
    "bucket_index",
    "expand_buckets",
    "hist_snapshot",
    "snapshot_from_dict",
    "window_rates",
]

# --- histogram buckets ------------------------------------------------------------------------

_PER_DECADE = 10
_LOG_LOW = -6  # 1 µs
_LOG_HIGH = 3  # 1000 s

#: Upper bounds (``le``) of the finite buckets, seconds. A last, implicit bucket holds overflow.
BUCKET_BOUNDS: tuple[float, ...] = tuple(
    float(f"{10 ** (_LOG_LOW + i / _PER_DECADE):.3g}")
    for i in range((_LOG_HIGH - _LOG_LOW) * _PER_DECADE + 1)
)
_NB = len(BUCKET_BOUNDS)  # index _NB is the overflow bucket (> 1000 s)
_LOW = BUCKET_BOUNDS[0]
_HIGH = BUCKET_BOUNDS[-1]


def bucket_index(seconds: float) -> int:
    """Index of the bucket holding ``seconds``: the first i with seconds <= BUCKET_BOUNDS[i]."""
    if seconds <= _LOW:
        return 0
    if seconds > _HIGH:
        return _NB
    i = math.ceil((math.log10(seconds) - _LOG_LOW) * _PER_DECADE)
    # log10 and the rounded bounds can disagree by one near an edge: settle it by comparison.
    if seconds > BUCKET_BOUNDS[i]:
        return i + 1
    if seconds <= BUCKET_BOUNDS[i - 1]:
        return i - 1
    return i


# --- the snapshot -----------------------------------------------------------------------------


class Snapshot(msgspec.Struct, frozen=True, omit_defaults=True):
    """Everything one endpoint's telemetry says at one instant; build it with ``snapshot()``.

    ``ranks``: with more than one tensor-parallel rank, each rank's own snapshot (its queues,
    pool, handshakes and throughput; ``kvpush.telemetry.merge``). Empty -- and then left out of
    the encoded form, so a one-rank endpoint's ``-o json`` line and stats reply read as before
    ranks existed -- for one rank.
    """

    ts: float  # wall clock, seconds since the epoch
    role: Role
    engine_id: str
    incarnation: str
    uptime_s: float
    info: dict[str, str | int | float]
    counters: dict[str, int]
    failures: dict[str, int]
    gauges: dict[str, float]
    rates: dict[str, float]  # per second, over the last few seconds; keys as in RATE_COUNTERS
    histograms: dict[str, HistSnapshot]
    peers: list[dict[str, object]]
    ranks: list[Snapshot] = []  # per tensor-parallel rank (``kvpush.telemetry.merge``)

    def to_dict(self) -> dict[str, object]:
        """Plain JSON types, exactly what a JSON or msgpack peer decodes (tuples become lists).

        ``snapshot_from_dict`` reverses it.
        """
        d: dict[str, object] = msgspec.json.decode(msgspec.json.encode(self))
        return d


def snapshot_from_dict(d: dict[str, object]) -> Snapshot:
    """Rebuild a ``Snapshot`` from ``to_dict`` output (e.g. received from a peer).

    Raises ``msgspec.ValidationError`` when a field is missing or has the wrong type.
    """
    return msgspec.convert(d, Snapshot)


def _quantile(counts: Sequence[int], total: int, q: float, lo_obs: float, hi_obs: float) -> float:
    rank = q * total
    cum = 0
    for i, c in enumerate(counts):
        if c and cum + c >= rank:
            lo = BUCKET_BOUNDS[i - 1] if i > 0 else 0.0
            hi = BUCKET_BOUNDS[i] if i < _NB else hi_obs
            lo, hi = max(lo, lo_obs), min(hi, hi_obs)
            frac = (rank - cum) / c
            # Buckets are log-spaced: interpolate in log space (linearly from a zero edge).
            value = lo * (hi / lo) ** frac if 0.0 < lo < hi else lo + (hi - lo) * frac
            return min(max(value, lo_obs), hi_obs)
        cum += c
    return hi_obs


def hist_snapshot(
    counts: Sequence[int], total: int, sum_: float, lo_obs: float, hi_obs: float
) -> HistSnapshot:
    """Pure: percentiles and sparse cumulative buckets from raw bucket counts (len _NB + 1)."""
    if total == 0:
        return HistSnapshot(count=0, sum=0.0, p50=0.0, p90=0.0, p99=0.0, max=0.0, buckets=[])
    buckets: list[tuple[float, int]] = []
    cum = 0
    for i in range(_NB):
        if counts[i]:
            cum += counts[i]
            buckets.append((BUCKET_BOUNDS[i], cum))
    return HistSnapshot(
        count=total,
        sum=sum_,
        p50=_quantile(counts, total, 0.50, lo_obs, hi_obs),
        p90=_quantile(counts, total, 0.90, lo_obs, hi_obs),
        p99=_quantile(counts, total, 0.99, lo_obs, hi_obs),
        max=hi_obs,
        buckets=buckets,
    )


def expand_buckets(hist: HistSnapshot) -> list[tuple[float, int]]:
    """The cumulative count at every one of ``BUCKET_BOUNDS`` (no ``+Inf``; that is ``count``)."""
    out: list[tuple[float, int]] = []
    sparse = iter(hist.buckets)
    nxt = next(sparse, None)
    cum = 0
    for le in BUCKET_BOUNDS:
        while nxt is not None and nxt[0] <= le:
            cum = nxt[1]
            nxt = next(sparse, None)
        out.append((le, cum))
    return out


def window_rates(
    base: tuple[float, Sequence[int]], now: tuple[float, Sequence[int]], names: Sequence[str]
) -> dict[str, float]:
    """Pure: per-second rates of ``names`` between two ``(t, values)`` samples."""
    dt = now[0] - base[0]
    if dt <= 1e-3:
        return dict.fromkeys(names, 0.0)
    return {n: max(0, now[1][k] - base[1][k]) / dt for k, n in enumerate(names)}

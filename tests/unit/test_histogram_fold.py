"""A histogram's fold (``kvpush.telemetry.store.Histogram``): a long run of queued values is
bucketed by numpy, a short one by the loop; both by the same rules -- ``bucket_index``'s bucket,
NaN skipped, a negative duration counted as zero -- so the counts, count, min and max agree to
the bit and the sum to rounding, whatever the values (bounds themselves, both sides of them,
the extremes)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.telemetry.snapshot import _NB, BUCKET_BOUNDS, bucket_index
from kvpush.telemetry.store import VECTOR_AT, Histogram

_EDGES = [b for x in BUCKET_BOUNDS for b in (x, math.nextafter(x, 0.0), math.nextafter(x, 9e9))]
_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.floats(min_value=0.0, max_value=5000.0),
    st.sampled_from([*_EDGES, 0.0, -0.0, -1e-9, math.inf, -math.inf]),
)


def _reference(values: list[float]) -> tuple[list[int], int, float, float]:
    counts = [0] * (_NB + 1)
    kept = [0.0 if v < 0 else v for v in values if not math.isnan(v)]
    for v in kept:
        counts[bucket_index(v)] += 1
    return counts, len(kept), min(kept, default=math.inf), max(kept, default=0.0)


def _folded(values: list[float]) -> Histogram:
    h = Histogram()
    h._queued.extend(values)
    with h._lock:
        h._fold()
    return h


@settings(max_examples=300, deadline=None)
@given(st.lists(_VALUES, min_size=VECTOR_AT, max_size=300))
def test_a_long_run_folds_as_the_rules_say(values: list[float]) -> None:
    h = _folded(values)
    counts, n, lo, hi = _reference(values)
    assert (h._counts, h._n, h._min, h._max) == (counts, n, lo, hi)
    finite = [0.0 if v < 0 else v for v in values if math.isfinite(v)]
    if len(finite) == n:  # (an infinity makes the sum infinite on both paths)
        try:
            exact = math.fsum(finite)
        except OverflowError:  # past the float range: infinite, as the loop's sum would be
            exact = math.inf
        assert h._sum == exact or math.isclose(h._sum, exact, rel_tol=1e-12, abs_tol=1e-300)
    assert not h._queued


@settings(max_examples=200, deadline=None)
@given(st.lists(_VALUES, max_size=VECTOR_AT - 1))
def test_a_short_run_folds_as_the_rules_say(values: list[float]) -> None:
    h = _folded(values)
    counts, n, lo, hi = _reference(values)
    assert (h._counts, h._n, h._min, h._max) == (counts, n, lo, hi)


def test_both_paths_leave_the_same_histogram() -> None:
    values = [1e-7, 1e-6, 2.5e-5, 0.003, 0.0031, 1.0, 999.0, 1001.0, -0.5, math.nan] * 10
    whole = _folded(values)
    parts = Histogram()
    for v in values:  # one at a time: folded by the loop, never a long run
        parts._queued.append(v)
        with parts._lock:
            parts._fold()
    assert whole._counts == parts._counts and whole._n == parts._n == 90
    assert (whole._min, whole._max) == (parts._min, parts._max) == (0.0, 1001.0)
    assert math.isclose(whole._sum, parts._sum, rel_tol=1e-12)
    a, b = whole.snapshot(), parts.snapshot()
    assert (a.buckets, a.p50, a.p90, a.p99, a.max) == (b.buckets, b.p50, b.p90, b.p99, b.max)

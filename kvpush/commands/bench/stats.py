"""Pure statistics for benchmark results: percentiles, summaries, windows, ratios.

No I/O, no threads. Percentiles are the tools' one definition,
``kvpush.commands.common.stats.percentile`` (nearest rank: always a recorded value), computed
exactly from the recorded samples (not from histogram buckets); here an empty series gives NaN
(reported as null), not 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvpush.commands.common.stats import percentile as _percentile


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th nearest-rank percentile (0..100) of ``values``; NaN when empty."""
    return _percentile(values, q, empty=math.nan)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def summary(values: Sequence[float]) -> dict[str, float]:
    """n, p50, p90, p99, max and mean of ``values`` (seconds in, seconds out)."""
    if not values:
        return {
            "n": 0,
            "p50": math.nan,
            "p90": math.nan,
            "p99": math.nan,
            "max": math.nan,
            "mean": math.nan,
        }
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": float(max(values)),
        "mean": float(sum(values) / len(values)),
    }


def window(
    t: Sequence[float], values: Sequence[float], ok: Sequence[bool], lo: float, hi: float
) -> tuple[list[float], int]:
    """Values of successful samples whose start time is in ``[lo, hi)``, and the failure count."""
    out: list[float] = []
    failed = 0
    for ti, v, good in zip(t, values, ok, strict=True):
        if lo <= ti < hi:
            if good:
                out.append(v)
            else:
                failed += 1
    return out, failed


def ratio(a: float, b: float) -> float:
    """a / b, NaN when undefined."""
    if b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def finite(x: float) -> float | None:
    """JSON-friendly: NaN and infinities become None."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None

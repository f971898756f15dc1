"""The one percentile of kvpush's tools: drive, demo, probe and bench report the same p99.

**Nearest rank**: the q-th percentile of n values is the smallest recorded value such that at
least q% of the values are at or below it (the ``ceil(q/100 * n)``-th smallest). It is always a
value that was observed (a p99 latency is a latency some request had), it never interpolates
between a fast and a slow sample, and on 1..100 it gives p50 = 50, p90 = 90, p99 = 99. The
median is the 50th percentile by the same rule (the lower middle of an even count).

Pure functions; no I/O, no threads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float, empty: float = 0.0) -> float:
    """Nearest-rank ``q``-th percentile (0..100) of ``values``; ``empty`` when there are none."""
    xs = sorted(values)
    if not xs:
        return empty
    k = max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))
    return float(xs[k])


def median(values: Iterable[float], empty: float = 0.0) -> float:
    """The 50th percentile by nearest rank."""
    return percentile(values, 50, empty)

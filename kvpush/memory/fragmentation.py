"""How fragmented a pool is: ``Fragmentation``, the allocator's reading of its free and held
runs (``kvpush.memory.allocator``), and ``runs_in``, the runs a list of block ids forms. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpush.telemetry.names import Gauge


@dataclass(frozen=True)
class Fragmentation:
    """How fragmented a pool is, read in one consistent snapshot.

    ``free_run_hist[k]`` counts free runs whose length is in ``[2**k, 2**(k+1))`` (trailing
    empty buckets dropped). ``alloc_mean_run_len`` is held blocks / held runs over every owner
    (quarantined included): the mean length of the runs a WRITE of a current allocation
    can merge on this side (0.0 when nothing is held).
    """

    total: int
    free: int
    free_runs: int
    largest_free_run: int
    free_run_hist: tuple[int, ...]
    alloc_blocks: int
    alloc_runs: int

    @property
    def alloc_mean_run_len(self) -> float:
        return self.alloc_blocks / self.alloc_runs if self.alloc_runs else 0.0

    def gauges(self) -> dict[str, float]:
        """Its telemetry gauges (``Gauge.POOL_FREE_RUNS`` ...)."""
        return {
            Gauge.POOL_FREE_RUNS: float(self.free_runs),
            Gauge.POOL_LARGEST_FREE_RUN: float(self.largest_free_run),
            Gauge.ALLOC_MEAN_RUN_LEN: self.alloc_mean_run_len,
        }

    def histogram(self) -> list[tuple[int, int, int]]:
        """``(min_len, max_len, runs)`` per power-of-two bucket, empty trailing ones dropped."""
        return [(1 << k, (2 << k) - 1, c) for k, c in enumerate(self.free_run_hist)]


def runs_in(ids: np.ndarray) -> int:
    """Number of maximal runs of consecutive ascending ids (1 for ``[4, 5, 6]``, 0 if empty)."""
    if ids.size == 0:
        return 0
    return 1 + int(np.count_nonzero(np.diff(ids) != 1))


def trimmed(hist: Sequence[int]) -> tuple[int, ...]:
    """``hist`` without its trailing empty buckets."""
    k = len(hist)
    while k and not hist[k - 1]:
        k -= 1
    return tuple(hist[:k])

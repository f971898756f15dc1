"""The schema of an endpoint's ``stats`` reply that its producer and its readers share:
``HistSnapshot``, one histogram of the telemetry snapshot as ``Snapshot.to_dict`` (the ``stats``
reply, ``-o json`` lines) carries it.

It stands below both sides of that contract: ``kvpush.telemetry.snapshot`` builds it (and
re-exports it with the rest of the snapshot), and readers that may not import the telemetry --
the bench reads its workers' ``stats`` replies with it (``kvpush.commands.bench.probes``) --
decode it from the reply's JSON. Pure data; any thread.
"""

from __future__ import annotations

import msgspec

__all__ = ["HistSnapshot"]


class HistSnapshot(msgspec.Struct, frozen=True):
    """One histogram at snapshot time. Times in seconds; zeros when nothing was observed.

    ``buckets`` is cumulative ``(le, count)``, listed only at the bounds whose own bucket is
    non-empty (a sparse form that keeps ``--json`` lines short); ``expand_buckets``
    (``kvpush.telemetry.snapshot``) restores the full fixed list of ``BUCKET_BOUNDS`` that
    Prometheus needs. Observations above the last bound are in ``count`` but under no finite
    ``le``.
    """

    count: int
    sum: float
    p50: float
    p90: float
    p99: float
    max: float
    buckets: list[tuple[float, int]]

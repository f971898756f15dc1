"""One endpoint's snapshot from its ranks' snapshots: pure.

Each tensor-parallel rank keeps its own ``Telemetry`` (its own queues, pool, handshakes and
throughput). The endpoint's snapshot sums counters, failures, gauges and rates over the ranks,
merges histograms bucket by bucket (percentiles recomputed from the summed buckets, not
averaged), lists every rank's peer rows with a ``rank`` key, and keeps the per-rank snapshots
under ``ranks`` so the live view, ``-o json`` and Prometheus (a ``rank`` label) show each one.
One rank: its snapshot, unchanged (``ranks`` empty).
"""

from __future__ import annotations

from kvpush.telemetry.names import Gauge
from kvpush.telemetry.snapshot import (
    _NB,
    BUCKET_BOUNDS,
    HistSnapshot,
    Snapshot,
    hist_snapshot,
)


def _counts(h: HistSnapshot) -> list[int]:
    """Per-bucket counts (length _NB + 1) from a sparse cumulative HistSnapshot."""
    counts = [0] * (_NB + 1)
    index = {le: i for i, le in enumerate(BUCKET_BOUNDS)}
    prev = 0
    for le, cum in h.buckets:
        counts[index[le]] = cum - prev
        prev = cum
    counts[_NB] = h.count - prev  # above the last bound
    return counts


def merge_hists(hs: list[HistSnapshot]) -> HistSnapshot:
    live = [h for h in hs if h.count]
    if not live:
        return hist_snapshot([0] * (_NB + 1), 0, 0.0, 0.0, 0.0)
    total = [0] * (_NB + 1)
    for h in live:
        for i, c in enumerate(_counts(h)):
            total[i] += c
    # The smallest observation is not kept in a snapshot: 0.0 only widens the first bucket.
    return hist_snapshot(
        total, sum(h.count for h in live), sum(h.sum for h in live), 0.0, max(h.max for h in live)
    )


def _sum(dicts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


# Gauges that are not additive over ranks: the largest of them, or their mean.
_MAX_GAUGES = frozenset({Gauge.POOL_LARGEST_FREE_RUN})
_MEAN_GAUGES = frozenset({Gauge.ALLOC_MEAN_RUN_LEN})


def _merge_gauges(gs: list[dict[str, float]]) -> dict[str, float]:
    out = _sum(gs)
    for name in _MAX_GAUGES & out.keys():
        out[name] = max(g.get(name, 0.0) for g in gs)
    for name in _MEAN_GAUGES & out.keys():
        out[name] = out[name] / len(gs)
    return out


def merge(snaps: list[Snapshot], top: Snapshot | None = None) -> Snapshot:
    """``top``: the endpoint's own request-level counts (a request spans every rank: counted
    once there); its counters and histograms replace the ranks' sums of the same names."""
    if not snaps:
        raise ValueError("no rank snapshots")
    first = snaps[0]
    if len(snaps) == 1:
        return first
    hist_names = sorted({n for s in snaps for n in s.histograms})
    peers: list[dict[str, object]] = []
    for r, s in enumerate(snaps):
        peers.extend({**row, "rank": r} for row in s.peers)
    counters = {k: int(v) for k, v in _sum([dict(s.counters) for s in snaps]).items()}
    hists = {
        n: merge_hists([s.histograms[n] for s in snaps if n in s.histograms]) for n in hist_names
    }
    rates = _sum([s.rates for s in snaps])
    if top is not None:
        counters.update(top.counters)
        rates.update({n: v for n, v in top.rates.items() if n in top.counters})
        hists.update(top.histograms)
    return Snapshot(
        ts=max(s.ts for s in snaps),
        role=first.role,
        engine_id=first.engine_id,
        incarnation=first.incarnation,
        uptime_s=first.uptime_s,
        info={**first.info, "rank": "all"},
        counters=counters,
        failures={k: int(v) for k, v in _sum([dict(s.failures) for s in snaps]).items()},
        gauges=_merge_gauges([s.gauges for s in snaps]),
        rates=rates,
        histograms=hists,
        peers=peers,
        ranks=list(snaps),
    )

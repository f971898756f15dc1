"""The Prometheus families of a snapshot's peer rows: handshakes, and which lane carries the KV.

Pure functions of the rows (``kvpush.telemetry.prom`` calls ``peer_families`` with its rank-level
parts and labels). ``peer`` is the peer endpoint's side-channel address and ``peer_rank`` its
rank (each rank is its own NIXL agent and handshake), so both group and filter as plain values:

- ``kvpush_peer_handshake_state{peer,peer_rank,mode,state}`` = 1 per peer row, with the counter
  ``kvpush_peer_handshake_failures_total{peer,peer_rank}`` and
  ``kvpush_peer_handshake_duration_seconds{peer,peer_rank}``;
- rows with a ``lane`` (a P's, ``kvpush.prefill.lanestats``):
  ``kvpush_peer_lane_info{peer,peer_rank,write,notif,locality,device,evidence,flags}`` = 1
  (transports joined with ``,``; ``evidence``: ``ucx proto info``, ``ambiguous`` or
  ``unknown``), ``kvpush_peer_descriptors_per_push{peer,peer_rank}`` (the last push's) and
  ``kvpush_peer_post_seconds_per_descriptor{peer,peer_rank}`` (mean time in NIXL's prep+post
  calls per descriptor).

No threads, no I/O: they run on the scrape thread inside the exporter's collector.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from kvpush.telemetry.snapshot import Snapshot

__all__ = ["lane_labels", "peer_families", "split_peer"]

_PEER_RANK = re.compile(r"^(?P<addr>.*) rank (?P<rank>\d+)$")


def split_peer(peer: str) -> tuple[str, str]:
    """``"HOST:PORT rank R"`` (``peer_name``'s form) -> ``("HOST:PORT", "R")``; rank 0 is
    written without it: ``"HOST:PORT"`` -> ``("HOST:PORT", "0")``."""
    m = _PEER_RANK.match(peer)
    return (m["addr"], m["rank"]) if m else (peer, "0")


def _joined(value: object) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "unknown"
    return str(value) if value else "unknown"


def lane_labels(row: dict[str, object]) -> dict[str, str] | None:
    """The labels of ``kvpush_peer_lane_info`` for a row with a ``lane`` (else None)."""
    lane = row.get("lane")
    if not isinstance(lane, dict):
        return None
    evidence = str(lane.get("evidence") or "unknown")
    flags = row.get("lane_flags")
    return {
        "write": _joined(lane.get("write")),
        "notif": _joined(lane.get("notif")),
        "locality": _joined(lane.get("locality")),
        "device": _joined(lane.get("devices")),
        "evidence": evidence.split(":", 1)[0],
        "flags": ",".join(str(f) for f in flags) if isinstance(flags, list) else "",
    }


def peer_families(parts: Sequence[tuple[list[str], Snapshot]], lab: list[str]) -> Iterator[Metric]:
    peer_lab = [*lab, "peer", "peer_rank"]
    state = GaugeMetricFamily(
        "kvpush_peer_handshake_state",
        "1 for each peer, labelled with its handshake mode and state",
        labels=[*peer_lab, "mode", "state"],
    )
    failures = CounterMetricFamily(
        "kvpush_peer_handshake_failures",
        "Failed handshakes per peer since it entered the peer table",
        labels=peer_lab,
    )
    duration = GaugeMetricFamily(
        "kvpush_peer_handshake_duration_seconds",
        "Duration of the last handshake per peer",
        labels=peer_lab,
    )
    for key, s in parts:
        for row in s.peers:
            peer = [*key, *split_peer(str(row.get("peer", "")))]
            mode, st = str(row.get("mode", "")), str(row.get("state", ""))
            state.add_metric([*peer, mode, st], 1)
            n = row.get("failures")
            if isinstance(n, int | float):
                failures.add_metric(peer, n)
            d = row.get("duration_s")
            if isinstance(d, int | float):
                duration.add_metric(peer, d)
    yield state
    yield failures
    yield duration
    yield from _lane_families(parts, peer_lab)


def _lane_families(
    parts: Sequence[tuple[list[str], Snapshot]], peer_lab: list[str]
) -> Iterator[Metric]:
    info = InfoMetricFamily(
        "kvpush_peer_lane",
        "Which transports carry the WRITE and the notification to each peer (UCX's own report)",
        labels=peer_lab,
    )
    descs = GaugeMetricFamily(
        "kvpush_peer_descriptors_per_push",
        "Descriptors of the last WRITE to each peer",
        labels=peer_lab,
    )
    post = GaugeMetricFamily(
        "kvpush_peer_post_seconds_per_descriptor",
        "Mean time in NIXL's prep+post calls per descriptor of the WRITEs to each peer",
        labels=peer_lab,
    )
    for key, s in parts:
        for row in s.peers:
            labels = lane_labels(row)
            if labels is None:
                continue
            peer = [*key, *split_peer(str(row.get("peer", "")))]
            info.add_metric(peer, labels)
            lane = row["lane"]
            assert isinstance(lane, dict)
            n, per = lane.get("descs_per_push"), lane.get("post_us_per_desc")
            if isinstance(n, int | float):
                descs.add_metric(peer, n)
            if isinstance(per, int | float):
                post.add_metric(peer, per / 1e6)
    yield info
    yield descs
    yield post

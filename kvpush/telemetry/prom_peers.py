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
from collections.abc import Callable, Iterator, Sequence

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


# The numbers of a peer row, one family each: its kind, name and help, and how the row gives
# the number (anything but an int or a float: no sample for that peer).
_Kind = type[CounterMetricFamily] | type[GaugeMetricFamily]
_Number = tuple[_Kind, str, str, Callable[[dict[str, object]], object]]
_HANDSHAKE_NUMBERS: tuple[_Number, ...] = (
    (
        CounterMetricFamily,
        "kvpush_peer_handshake_failures",
        "Failed handshakes per peer since it entered the peer table",
        lambda row: row.get("failures"),
    ),
    (
        GaugeMetricFamily,
        "kvpush_peer_handshake_duration_seconds",
        "Duration of the last handshake per peer",
        lambda row: row.get("duration_s"),
    ),
)
_LANE_NUMBERS: tuple[_Number, ...] = (
    (
        GaugeMetricFamily,
        "kvpush_peer_descriptors_per_push",
        "Descriptors of the last WRITE to each peer",
        lambda row: _lane(row).get("descs_per_push"),
    ),
    (
        GaugeMetricFamily,
        "kvpush_peer_post_seconds_per_descriptor",
        "Mean time in NIXL's prep+post calls per descriptor of the WRITEs to each peer",
        lambda row: _seconds(_lane(row).get("post_us_per_desc")),
    ),
)


def _lane(row: dict[str, object]) -> dict[str, object]:
    """A row's ``lane`` (a P's rows with UCX's lane report), or an empty one."""
    lane = row.get("lane")
    return lane if isinstance(lane, dict) else {}


def _seconds(us: object) -> object:
    return us / 1e6 if isinstance(us, int | float) else None


def _peer_rows(
    parts: Sequence[tuple[list[str], Snapshot]],
) -> list[tuple[list[str], dict[str, object]]]:
    """Every peer row of every part, with its labels: the part's, then ``peer`` and
    ``peer_rank``."""
    return [
        ([*key, *split_peer(str(row.get("peer", "")))], row) for key, s in parts for row in s.peers
    ]


def _numbers(
    table: tuple[_Number, ...], rows: list[tuple[list[str], dict[str, object]]], labels: list[str]
) -> Sequence[Metric]:
    """The families of ``table``, each with a sample for every row that gives its number."""
    families = [kind(name, doc, labels=labels) for kind, name, doc, _ in table]
    for peer, row in rows:
        for family, (*_, number) in zip(families, table, strict=True):
            n = number(row)
            if isinstance(n, int | float):
                family.add_metric(peer, n)
    return families


def peer_families(parts: Sequence[tuple[list[str], Snapshot]], lab: list[str]) -> Iterator[Metric]:
    peer_lab = [*lab, "peer", "peer_rank"]
    rows = _peer_rows(parts)
    state = GaugeMetricFamily(
        "kvpush_peer_handshake_state",
        "1 for each peer, labelled with its handshake mode and state",
        labels=[*peer_lab, "mode", "state"],
    )
    for peer, row in rows:
        mode, st = str(row.get("mode", "")), str(row.get("state", ""))
        state.add_metric([*peer, mode, st], 1)
    yield state
    yield from _numbers(_HANDSHAKE_NUMBERS, rows, peer_lab)
    info = InfoMetricFamily(
        "kvpush_peer_lane",
        "Which transports carry the WRITE and the notification to each peer (UCX's own report)",
        labels=peer_lab,
    )
    for peer, row in rows:
        labels = lane_labels(row)
        if labels is not None:
            info.add_metric(peer, labels)
    yield info
    yield from _numbers(_LANE_NUMBERS, rows, peer_lab)

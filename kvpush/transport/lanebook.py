"""One local agent's peers' lanes from UCX's tables: the data model and the attribution (pure).

``EpConfig`` is one endpoint configuration of a local agent as its ``UCX_PROTO_INFO`` tables
describe it (``kvpush.transport.protoinfo``); ``Lane`` is what a peer's lane is said to be;
``attribute`` and ``resolve`` decide which configuration a peer uses, by the rule the module
docstring of ``kvpush.transport.lanes`` states (first contacts against the tables' timestamps,
then the peer's locality). ``LaneBook`` holds one local agent's peers' first contacts and
answers their lanes from a ``ConfigSource`` (``kvpush.transport.lanes.LaneLog``: the process's
UCX log).

Threads: ``LaneBook.contact`` on the owner thread (a dict insert, once per peer);
``LaneBook.lanes`` on the thread that takes a telemetry snapshot. The rest is pure.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

from kvpush.transport.protoinfo import NOTIF, WRITE, Row, TableRow

EVIDENCE_UCX: Final = "ucx proto info"
#: A table is printed up to this long before the contact that made it is seen (UCX wires the
#: endpoint up before the progress call that delivers the peer's first notification returns).
WINDOW_S: Final = 2.0
#: ... and a contact stamped this long before the table still counts (clock reading order).
SLACK_S: Final = 0.05
#: The notification's size the notification lane is read at (kvpush's are ~100 B).
NOTIF_BYTES: Final = 256
_MAX_CONTACTS = 4096


class ConfigSource(Protocol):
    """Where a book's configurations come from (the process's UCX log)."""

    def refresh(self) -> None: ...

    def problem(self) -> str: ...

    def configs(self, worker: str) -> list[EpConfig]: ...


@dataclass(frozen=True)
class Lane:
    """Which transports carry one peer's WRITEs and notifications, and how that is known."""

    write: tuple[str, ...] = ()  # transports of the WRITE: ("cma",), ("tcp",), ("rc_mlx5",)
    devices: tuple[str, ...] = ()  # their devices: ("memory",), ("lo", "eth0")
    notif: tuple[str, ...] = ()  # transports of NIXL's notifications (active messages)
    notif_devices: tuple[str, ...] = ()
    locality: str = ""  # UCX's: intra-node, inter-node ("" unknown)
    cfg: int | None = None  # UCX's endpoint configuration index (per local agent)
    evidence: str = ""  # EVIDENCE_UCX, "ambiguous: cfg#1|cfg#2" or "unknown: why"

    @property
    def known(self) -> bool:
        return self.evidence == EVIDENCE_UCX

    def as_dict(self) -> dict[str, object]:
        return {
            "write": list(self.write),
            "devices": list(self.devices),
            "notif": list(self.notif),
            "notif_devices": list(self.notif_devices),
            "locality": self.locality,
            "cfg": self.cfg,
            "evidence": self.evidence,
        }


def unknown(why: str) -> Lane:
    return Lane(evidence=f"unknown: {why}")


@dataclass
class EpConfig:
    """One endpoint configuration of one local agent, as its tables describe it."""

    worker: str
    locality: str
    index: int
    ts: float  # its first table's timestamp
    write: list[Row] = field(default_factory=list)
    notif: list[Row] = field(default_factory=list)

    def add(self, ev: TableRow) -> None:
        if ev.operation not in (WRITE, NOTIF):
            return  # a get, an atomic, a tag send: nothing NIXL's WRITE path uses
        rows = self.write if ev.operation == WRITE else self.notif
        if ev.row not in rows:
            rows.append(ev.row)

    def lane(self, desc_bytes: int | None, evidence: str = EVIDENCE_UCX) -> Lane:
        """The lane of a WRITE of ``desc_bytes``-byte descriptors (None: the largest range)."""
        wt, wd = _hops(self.write, desc_bytes)
        nt, nd = _hops(self.notif, NOTIF_BYTES)
        return Lane(wt, wd, nt, nd, self.locality, self.index, evidence)


def _hops(rows: list[Row], size: int | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The transports and devices of the rows that carry a message of ``size`` bytes."""
    chosen = [r for r in rows if (r.covers(size) if size is not None else r.hi is None)]
    tls: list[str] = []
    devs: list[str] = []
    for r in chosen or rows:
        for tl, dev in r.hops:
            if tl not in tls:
                tls.append(tl)
            if dev not in devs:
                devs.append(dev)
    return tuple(tls), tuple(devs)


def attribute(configs: list[EpConfig], contacts: Mapping[str, float]) -> dict[str, int]:
    """Pure: the peer agents new configurations' tables are attributed to (see the module
    docstring of ``kvpush.transport.lanes``): agent -> configuration index, where the agent's
    first contact is the only one within the table's window among the agents not attributed
    yet -- or the only one at or after the table's time, the others stamped in its slack before
    it: a contact follows the table it caused, so one stamped before a table is the cause of an
    earlier table (or of none). Repeated until nothing changes: a table attributed takes its
    agent out of the other tables' windows (each new configuration is caused by one peer, each
    peer causes one)."""
    out: dict[str, int] = {}
    open_ = sorted(configs, key=lambda c: c.ts)
    changed = True
    while changed:
        changed = False
        for c in list(open_):
            inside = [
                (a, t)
                for a, t in contacts.items()
                if a not in out and c.ts - SLACK_S <= t <= c.ts + WINDOW_S
            ]
            after = [a for a, t in inside if t >= c.ts]
            cause = after if len(after) == 1 else [a for a, _ in inside]
            if len(cause) == 1:
                out[cause[0]] = c.index
                open_.remove(c)
                changed = True
    return out


def resolve(
    configs: list[EpConfig],
    index: int | None,
    locality: str | None,
    desc_bytes: int | None,
    contact: float | None = None,
) -> Lane:
    """Pure: a peer's lane from the configuration attributed to it (``attribute``; None: none)
    or else the one known configuration of the locality its address suggests (None: any) --
    of those printed by the peer's first ``contact`` when there are any: a configuration first
    printed later was made by a later peer, and a peer's endpoint keeps the one it got."""
    if index is not None:
        one = next((c for c in configs if c.index == index), None)
        if one is not None:
            return one.lane(desc_bytes)
    fits = [c for c in configs if locality is None or c.locality == locality]
    if contact is not None:
        fits = [c for c in fits if c.ts - SLACK_S <= contact] or fits
    if len(fits) == 1:
        return fits[0].lane(desc_bytes)
    if fits:
        return Lane(evidence="ambiguous: " + "|".join(f"cfg#{c.index}" for c in fits))
    if not configs:
        return unknown("UCX printed no table for this agent's endpoints yet")
    return unknown(f"no UCX endpoint configuration of this peer's locality ({locality})")


class LaneBook:
    """The lanes of one local agent's peers: first contacts in, ``lanes`` out."""

    def __init__(self, worker: str, source: ConfigSource | None, reason: str) -> None:
        self.worker = worker
        self._log = source
        self._reason = reason
        self._contacts: dict[str, float] = {}

    def contact(self, remote: str, t_wall: float | None = None) -> None:
        """The peer agent ``remote`` was heard from or written to at ``t_wall`` (None: now);
        only the first is kept. Owner thread; a dict look-up when known."""
        if remote not in self._contacts and len(self._contacts) < _MAX_CONTACTS:
            self._contacts[remote] = time.time() if t_wall is None else t_wall

    def lanes(self, peers: Mapping[str, tuple[str | None, int | None]]) -> dict[str, Lane]:
        """The lane of each peer agent in ``peers`` (agent -> (locality its address suggests,
        bytes per WRITE descriptor)); reads the log first. Snapshot thread."""
        if self._log is None:
            lane = unknown(self._reason)
            return dict.fromkeys(peers, lane)
        self._log.refresh()
        problem = self._log.problem()
        configs = self._log.configs(self.worker)
        if problem and not configs:
            lane = unknown(problem)
            return dict.fromkeys(peers, lane)
        contacts = self._contacts.copy()
        attributed = attribute(configs, contacts)
        out: dict[str, Lane] = {}
        for agent, (locality, desc_bytes) in peers.items():
            if agent not in contacts:
                out[agent] = unknown("no contact with this peer's agent yet")
            else:
                index = attributed.get(agent)
                out[agent] = resolve(configs, index, locality, desc_bytes, contacts[agent])
        return out

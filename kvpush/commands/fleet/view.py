"""The fleet as ``fleet ls`` and ``fleet watch`` see it: rows of endpoints and the events between.

Owns ``FleetModel``: every registered endpoint of one cluster (its latest record, when this
watcher first saw it, its push rate from successive load summaries), fed the fleet events
``kvpush.fleet.store`` classified -- ``join`` (a new address), ``restart`` (a known address with
a new incarnation: the engine restarted in place, and whoever held its old agent must drop it),
``leave`` (the key went: graceful stop, or the lease lapsed), ``update`` (a new load summary) --
as they are: it classifies nothing again. ``FleetRow`` / ``Change`` are the frozen data the
views draw. The model is pure: it is fed events with the time, it never reads a clock or etcd
itself, so the CLI's watch loop (or a test) drives it. Not thread-safe: one owner (the thread
that reads the watch) applies changes and takes ``rows()``; the render path gets the frozen
rows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvpush.config import Role
from kvpush.fleet.pairs import record_health
from kvpush.fleet.record import EndpointRecord

if TYPE_CHECKING:
    from kvpush.fleet.store import FleetEvent

EventKind = Literal["join", "leave", "restart"]

#: Events the model keeps for the live view's tail.
KEEP_EVENTS = 200


@dataclass(frozen=True)
class Change:
    t: float  # unix time the watcher saw it
    kind: EventKind
    address: str
    role: Role
    host: str
    incarnation: str  # the new one (join, restart) or the last one known (leave)
    previous: str = ""  # restart: the incarnation it replaced

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {
            "event": self.kind,
            "t": round(self.t, 3),
            "address": self.address,
            "role": self.role,
            "host": self.host,
            "incarnation": self.incarnation,
        }
        if self.previous:
            d["previous_incarnation"] = self.previous
        return d


@dataclass(frozen=True)
class FleetRow:
    """One endpoint as the views draw it (``age`` from the record's start time)."""

    record: EndpointRecord
    age_s: float
    health: str
    push_rate: float | None  # pushes (P) / requests answered ok (D) per second; None: not yet

    @property
    def address(self) -> str:
        return self.record.address

    def to_dict(self) -> dict[str, object]:
        r = self.record
        return {
            "role": r.role,
            "address": r.address,
            "host": r.host,
            "pid": r.pid,
            "engine_id": r.engine_id,
            "incarnation": r.incarnation,
            "tp_size": r.tp_size,
            "wire": r.wire,
            "age_s": round(self.age_s, 3),
            "free_blocks": r.load.free_blocks,
            "num_blocks": r.geometry.num_blocks,
            "in_flight": r.load.in_flight,
            "pushes_total": r.load.pushes_total,
            "failures_total": r.load.failures_total,
            "push_rate": self.push_rate,
            "health": self.health,
            "compat_hash": r.compat_hash,
            "kvpush_version": r.kvpush_version,
            "nixl_version": r.nixl_version,
            "metrics_url": r.metrics_url,
            "started_at": r.started_at,
            "updated_at": r.load.updated_at,
        }


@dataclass
class _Entry:
    record: EndpointRecord
    rate: float | None = None
    failing: bool = False


@dataclass
class FleetModel:
    rows_by_address: dict[str, _Entry] = field(default_factory=dict)
    events: deque[Change] = field(default_factory=lambda: deque(maxlen=KEEP_EVENTS))

    def load(self, records: list[EndpointRecord]) -> None:
        """The listing the watch starts from (no events: they were there before)."""
        self.rows_by_address = {r.address: _Entry(r) for r in records}

    def apply(self, ev: FleetEvent, now: float) -> Change | None:
        """One fleet event (``kvpush.fleet.store``'s kinds, taken as they are): a ``join`` or
        ``restart`` is a new row and a ``Change``; an ``update`` refreshes a row (its push
        rate); a ``leave`` drops it (a ``Change``). None for what the views do not list."""
        rec = ev.record
        if ev.kind == "leave":
            old = self.rows_by_address.pop(ev.address, None)
            gone = old.record if old is not None else ev.previous
            return None if gone is None else self._event(now, "leave", gone)
        if rec is None:
            return None
        if ev.kind in ("join", "restart"):
            self.rows_by_address[rec.address] = _Entry(rec)
            prev = ev.previous.incarnation if ev.previous is not None else ""
            kind: EventKind = "join" if ev.kind == "join" else "restart"
            return self._event(now, kind, rec, prev if kind == "restart" else "")
        old = self.rows_by_address.get(rec.address)
        if old is None or old.record.incarnation != rec.incarnation:
            self.rows_by_address[rec.address] = _Entry(rec)  # not seen before: no event to say
            return None
        rate, failing = _rate(old.record, rec)
        self.rows_by_address[rec.address] = _Entry(
            rec, rate if rate is not None else old.rate, failing
        )
        return None

    def _event(
        self, now: float, kind: EventKind, rec: EndpointRecord, previous: str = ""
    ) -> Change:
        ev = Change(now, kind, rec.address, rec.role, rec.host, rec.incarnation, previous)
        self.events.append(ev)
        return ev

    def rows(self, now: float) -> list[FleetRow]:
        """Every endpoint, P first then D, by address."""
        out = []
        for e in self.rows_by_address.values():
            r = e.record
            health = record_health(r, now)
            if health != "stale" and e.failing:
                health = "failing"
            age = max(0.0, now - r.started_at) if r.started_at else 0.0
            out.append(FleetRow(r, age, health, e.rate))
        out.sort(key=lambda row: (row.record.role != Role.PREFILL, row.record.address))
        return out


def _rate(old: EndpointRecord, new: EndpointRecord) -> tuple[float | None, bool]:
    """Pushes per second between two load summaries of one incarnation, and whether failures
    grew while no push succeeded (every recent push failing)."""
    a, b = old.load, new.load
    dt = b.updated_at - a.updated_at
    if dt <= 0:
        return None, False
    done = b.pushes_total - a.pushes_total
    failed = b.failures_total - a.failures_total
    return max(0, done) / dt, failed > 0 and done <= 0


def rows_of(records: list[EndpointRecord], now: float) -> list[FleetRow]:
    """``fleet ls``: the rows of one listing."""
    m = FleetModel()
    m.load(records)
    return m.rows(now)

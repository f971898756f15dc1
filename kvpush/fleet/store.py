"""The endpoints of a cluster as typed records and typed changes, read from etcd, classified once.

Owns the translation of the registry's keys (layout v2: ``kvpush.fleet.record``) into
``EndpointRecord``s -- each membership record joined with its load summary -- and of etcd's
PUT/DELETE events into fleet events: ``join`` (a new address), ``leave`` (its membership key
deleted or expired), ``update`` (same incarnation, new content: the load summary, or ``leaving``),
``restart`` (same address, another incarnation: a new process behind the old address). Every
view (an endpoint's peer watch, ``fleet watch``, ``drive --registry``) consumes these events; none
classifies keys again. A reader that wants no load (``load=False``: an endpoint's own peer watch)
lists and watches the membership prefix alone, so load writes never reach it.

``change``, ``diff`` and ``apply`` are pure; ``Follow`` runs in the thread that iterates it (a
watcher thread, a CLI command) and survives etcd going away: it says ``registry_down`` once,
lists again when etcd is back and reports what changed meanwhile as the same events, then
``registry_up``. ``on_events`` counts what the watch received (every etcd event, classified or
not: ``kvpush_registry_watch_events_total``).

Records that do not decode (another schema, garbage), or whose ``address`` is not their key's,
are skipped with one log line per key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import msgspec

from kvpush.errors import RegistryError, RegistryUnavailable
from kvpush.fleet.etcd import Etcd, WatchEvent
from kvpush.fleet.record import (
    EndpointRecord,
    LoadRecord,
    MemberRecord,
    cluster_prefix,
    decode_load,
    decode_member,
    joined,
    loads_prefix,
    members_prefix,
)

log = logging.getLogger(__name__)

Kind = Literal["join", "leave", "update", "restart", "registry_down", "registry_up"]


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """One change of a cluster. ``record`` is the endpoint now (None for ``leave`` and the
    registry events); ``previous`` is what was known before (None for ``join``)."""

    kind: Kind
    address: str = ""
    record: EndpointRecord | None = None
    previous: EndpointRecord | None = None
    detail: str = ""  # registry_down: why


_bad_keys: set[str] = set()
MAX_BAD_KEYS = 4096  # keys said once each (a flood of bad keys is said again, never grows)


def _decode_or_skip(key: str, raw: bytes, address: str) -> MemberRecord | None:
    """The membership record under ``key`` (whose last part is ``address``); None, said once per
    key, when it does not decode or names another address than its key (a record is data: one
    that claims an address it is not keyed by could hide or impersonate the endpoint there)."""
    try:
        rec = decode_member(raw)
    except ValueError as e:
        _skip(key, str(e))
        return None
    if rec.address != address:
        _skip(key, f"its address {rec.address!r} is not its key's {address!r}")
        return None
    return rec


def _load_or_skip(key: str, raw: bytes) -> LoadRecord | None:
    try:
        return decode_load(raw)
    except ValueError as e:
        _skip(key, str(e))
        return None


def _skip(key: str, why: str) -> None:
    if key not in _bad_keys:
        if len(_bad_keys) >= MAX_BAD_KEYS:
            _bad_keys.clear()
        _bad_keys.add(key)
        log.warning("registry: skipping %s: %s", key, why)


Loads = dict[str, LoadRecord]  # the latest load summary read, by address


@dataclass(frozen=True)
class Listing:
    """One read of a cluster: its records by address, the load summaries read, the revision."""

    records: dict[str, EndpointRecord]
    loads: Loads
    revision: int


def read_cluster(etcd: Etcd, cluster: str, load: bool = True) -> Listing:
    """One range request: every member of ``cluster`` (with its load summary when ``load``) and
    the revision of the read (watch from ``revision + 1`` to miss nothing). RegistryUnavailable
    when etcd is."""
    mp, lp = members_prefix(cluster), loads_prefix(cluster)
    kvs, revision = etcd.get_prefix(cluster_prefix(cluster) if load else mp)
    loads: Loads = {}
    members: list[tuple[str, MemberRecord]] = []
    for k, v in kvs:
        if k.startswith(mp):
            m = _decode_or_skip(k, v, k[len(mp) :])
            if m is not None:
                members.append((m.address, m))
        elif load and k.startswith(lp):
            lr = _load_or_skip(k, v)
            if lr is not None:
                loads[k[len(lp) :]] = lr
    records = {a: joined(m, loads.get(a)) for a, m in members}
    return Listing(records, loads, revision)


def list_endpoints(etcd: Etcd, cluster: str, load: bool = True) -> tuple[list[EndpointRecord], int]:
    """Every endpoint registered in ``cluster`` (sorted by address) and the revision of the
    listing. RegistryUnavailable when etcd is."""
    got = read_cluster(etcd, cluster, load)
    return [got.records[a] for a in sorted(got.records)], got.revision


def count_v1(etcd: Etcd, cluster: str) -> int:
    """How many endpoints of ``cluster`` an older kvpush registered under layout v1 (which this
    kvpush neither reads nor writes)."""
    from kvpush.fleet.record import v1_prefix

    return etcd.count_prefix(v1_prefix(cluster))


def by_address(records: list[EndpointRecord]) -> dict[str, EndpointRecord]:
    return {r.address: r for r in records}


def classify(previous: EndpointRecord | None, now: EndpointRecord) -> Kind:
    if previous is None:
        return "join"
    if previous.incarnation != now.incarnation:
        return "restart"
    return "update"


def change(
    known: dict[str, EndpointRecord], address: str, now: EndpointRecord | None
) -> FleetEvent | None:
    """The event that ``address`` is ``now`` (None: gone), ``known`` updated in place; None
    when nothing a reader sees changed. The one classification every view consumes. Pure."""
    prev = known.get(address)
    if now is None:
        if prev is None:
            return None
        del known[address]
        return FleetEvent("leave", address, None, prev)
    if now == prev:
        return None
    known[address] = now
    return FleetEvent(classify(prev, now), address, now, prev)


def diff(known: dict[str, EndpointRecord], now: dict[str, EndpointRecord]) -> list[FleetEvent]:
    """The events that turn ``known`` into ``now`` (leaves first, then by address). Pure."""
    out = [
        FleetEvent("leave", a, None, known[a], "gone while the registry was not watched")
        for a in sorted(known.keys() - now.keys())
    ]
    for a in sorted(now):
        prev = known.get(a)
        if prev == now[a]:
            continue
        out.append(FleetEvent(classify(prev, now[a]), a, now[a], prev))
    return out


def apply(
    known: dict[str, EndpointRecord], loads: Loads, cluster: str, ev: WatchEvent
) -> FleetEvent | None:
    """The fleet event of one etcd change in ``cluster``, ``known`` and ``loads`` updated in
    place; None when nothing a reader sees changed (a DELETE of an unknown key, an undecodable
    PUT, a load summary of no known member or of another incarnation)."""
    mp, lp = members_prefix(cluster), loads_prefix(cluster)
    if ev.key.startswith(mp):
        address = ev.key[len(mp) :]
        if ev.kind == "DELETE":
            return change(known, address, None)
        m = _decode_or_skip(ev.key, ev.value, address)
        return None if m is None else change(known, address, joined(m, loads.get(address)))
    if not ev.key.startswith(lp):
        return None
    address = ev.key[len(lp) :]
    if ev.kind == "DELETE":
        loads.pop(address, None)  # the membership key's own event says whether it left
        return None
    lr = _load_or_skip(ev.key, ev.value)
    if lr is None:
        return None
    loads[address] = lr
    prev = known.get(address)
    if prev is None or prev.incarnation != lr.incarnation:
        return None  # joined when (if) its membership comes
    return change(known, address, msgspec.structs.replace(prev, load=lr.load))


def watch_endpoints(
    etcd: Etcd,
    cluster: str,
    listing: Listing,
    *,
    load: bool = True,
    on_events: Callable[[int], None] | None = None,
) -> tuple[Iterator[FleetEvent], Callable[[], None]]:
    """Fleet events of ``cluster`` after ``listing`` (whose records and loads are kept up to
    date in place), of its membership alone unless ``load``; and a ``cancel`` callable.
    ``on_events(n)``: ``n`` etcd events received. Raises like ``Etcd.watch_prefix`` when the
    watch breaks."""
    prefix = cluster_prefix(cluster) if load else members_prefix(cluster)
    raw, cancel = etcd.watch_prefix(prefix, listing.revision + 1)

    def events() -> Iterator[FleetEvent]:
        for ev in raw:
            if on_events is not None:
                on_events(1)
            fe = apply(listing.records, listing.loads, cluster, ev)
            if fe is not None:
                yield fe

    return events(), cancel


class Follow:
    """Follow a cluster for as long as the caller iterates: every endpoint at start as a
    ``join`` (except those of ``known``, the caller's own listing: only what changed since),
    then each change; through etcd outages (``registry_down`` once, ``registry_up`` when back,
    the missed changes as events). ``load=False``: membership only (no load summary is read or
    received). ``cancel()`` from any thread ends the iteration."""

    def __init__(
        self,
        etcd: Etcd,
        cluster: str,
        *,
        load: bool = True,
        retry_s: float = 1.0,
        known: dict[str, EndpointRecord] | None = None,
        on_events: Callable[[int], None] | None = None,
    ) -> None:
        self.etcd = etcd
        self.cluster = cluster
        self.load = load
        self.retry_s = retry_s
        self.known: dict[str, EndpointRecord] = dict(known or {})
        self._on_events = on_events
        self._stop = threading.Event()
        self._cancel_watch: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def cancel(self) -> None:
        self._stop.set()
        with self._lock:
            c = self._cancel_watch
        if c is not None:
            c()

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()

    def __iter__(self) -> Iterator[FleetEvent]:
        down: str | None = None
        first = True
        while not self._stop.is_set():
            try:
                listing = read_cluster(self.etcd, self.cluster, self.load)
                events, cancel = watch_endpoints(
                    self.etcd, self.cluster, listing, load=self.load, on_events=self._on_events
                )
            except (RegistryUnavailable, RegistryError) as e:
                if down is None:
                    down = e.message
                    yield FleetEvent("registry_down", detail=e.message)
                self._stop.wait(self.retry_s)
                continue
            with self._lock:
                self._cancel_watch = cancel
            if self._stop.is_set():
                cancel()
                return
            yield from diff(self.known, listing.records)
            self.known = listing.records
            if down is not None or first:
                if down is not None:
                    yield FleetEvent("registry_up")
                down = None
                first = False
            try:
                yield from events
            except (RegistryUnavailable, RegistryError) as e:
                if not self._stop.is_set():
                    down = e.message
                    yield FleetEvent("registry_down", detail=e.message)
                    self._stop.wait(self.retry_s)
            finally:
                with self._lock:
                    self._cancel_watch = None
                cancel()

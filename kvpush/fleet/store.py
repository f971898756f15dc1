"""The endpoints of a cluster as typed records and typed changes, read from etcd.

Owns the translation of the registry's keys into ``EndpointRecord``s and of etcd's PUT/DELETE
events into fleet events: ``join`` (a new address), ``leave`` (its key deleted or expired),
``update`` (same incarnation, new content: the load summary), ``restart`` (same address, another
incarnation: a new process behind the old address). ``diff`` and ``apply`` are pure; ``Follow``
runs in the thread that iterates it (a watcher thread, a CLI command) and survives etcd going
away: it says ``registry_down`` once, lists again when etcd is back and reports what changed
meanwhile as the same events, then ``registry_up``.

Records that do not decode (another schema, garbage), or whose ``address`` is not their key's,
are skipped with one log line per key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from kvpush.errors import RegistryError, RegistryUnavailable
from kvpush.fleet.etcd import Etcd, WatchEvent
from kvpush.fleet.record import EndpointRecord, cluster_prefix, decode

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


def _decode_or_skip(key: str, raw: bytes, address: str) -> EndpointRecord | None:
    """The record under ``key`` (whose last part is ``address``); None, said once per key, when
    it does not decode or names another address than its key (a record is data: one that
    claims an address it is not keyed by could hide or impersonate the endpoint there)."""
    try:
        rec = decode(raw)
    except ValueError as e:
        _skip(key, str(e))
        return None
    if rec.address != address:
        _skip(key, f"its address {rec.address!r} is not its key's {address!r}")
        return None
    return rec


def _skip(key: str, why: str) -> None:
    if key not in _bad_keys:
        if len(_bad_keys) >= MAX_BAD_KEYS:
            _bad_keys.clear()
        _bad_keys.add(key)
        log.warning("registry: skipping %s: %s", key, why)


def list_endpoints(etcd: Etcd, cluster: str) -> tuple[list[EndpointRecord], int]:
    """Every endpoint registered in ``cluster`` (sorted by address) and the revision of the
    listing (watch from ``revision + 1`` to miss nothing). RegistryUnavailable when etcd is."""
    prefix = cluster_prefix(cluster)
    kvs, revision = etcd.get_prefix(prefix)
    out = [r for k, v in kvs if (r := _decode_or_skip(k, v, k[len(prefix) :])) is not None]
    return out, revision


def by_address(records: list[EndpointRecord]) -> dict[str, EndpointRecord]:
    return {r.address: r for r in records}


def classify(previous: EndpointRecord | None, now: EndpointRecord) -> Kind:
    if previous is None:
        return "join"
    if previous.incarnation != now.incarnation:
        return "restart"
    return "update"


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


def apply(known: dict[str, EndpointRecord], prefix: str, ev: WatchEvent) -> FleetEvent | None:
    """The fleet event of one etcd change under ``prefix``, ``known`` updated in place; None
    when nothing a reader sees changed (a DELETE of an unknown key, an undecodable PUT)."""
    if not ev.key.startswith(prefix):
        return None
    address = ev.key[len(prefix) :]
    prev = known.get(address)
    if ev.kind == "DELETE":
        if prev is None:
            return None
        del known[address]
        return FleetEvent("leave", address, None, prev)
    rec = _decode_or_skip(ev.key, ev.value, address)
    if rec is None or rec == prev:
        return None
    known[address] = rec
    return FleetEvent(classify(prev, rec), address, rec, prev)


def watch_endpoints(
    etcd: Etcd, cluster: str, known: dict[str, EndpointRecord], start_revision: int
) -> tuple[Iterator[FleetEvent], Callable[[], None]]:
    """Fleet events of ``cluster`` from ``start_revision`` on, ``known`` (usually the listing
    that gave ``start_revision - 1``) kept up to date in place; and a ``cancel`` callable.
    Raises like ``Etcd.watch_prefix`` when the watch breaks."""
    prefix = cluster_prefix(cluster)
    raw, cancel = etcd.watch_prefix(prefix, start_revision)

    def events() -> Iterator[FleetEvent]:
        for ev in raw:
            fe = apply(known, prefix, ev)
            if fe is not None:
                yield fe

    return events(), cancel


class Follow:
    """Follow a cluster for as long as the caller iterates: every endpoint at start as a
    ``join``, then each change; through etcd outages (``registry_down`` once, ``registry_up``
    when back, the missed changes as events). ``cancel()`` from any thread ends the iteration."""

    def __init__(self, etcd: Etcd, cluster: str, *, retry_s: float = 1.0) -> None:
        self.etcd = etcd
        self.cluster = cluster
        self.retry_s = retry_s
        self.known: dict[str, EndpointRecord] = {}
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
                records, revision = list_endpoints(self.etcd, self.cluster)
                now = by_address(records)
                events, cancel = watch_endpoints(self.etcd, self.cluster, now, revision + 1)
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
            yield from diff(self.known, now)
            self.known = now
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

"""``kvpush fleet watch``'s engine: the listing, then every change of the cluster, as a model.

Owns ``FleetWatch``. ``start`` lists the cluster (``RegistryUnavailable`` -- exit 69 -- when etcd
does not answer then: a watch that never saw the fleet has nothing to show) and starts the
*reader* thread, which iterates ``kvpush.fleet.store.Follow`` (the watch survives etcd going away
and coming back: it re-lists and reports what changed meanwhile) and hands each event to a
bounded queue. ``poll`` runs on the caller's thread: it drains the queue into the
``FleetModel`` (the only thread that touches it) and returns what happened -- joins, leaves and
restarts as ``Change`` s, and the registry going down or coming back as ``Status`` lines.
``stop`` cancels the watch and joins the reader. A full queue drops the oldest load updates
first, never a join, leave or restart.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush.commands.common.registry import RegistrySource
from kvpush.commands.fleet.view import Change, FleetModel, FleetRow
from kvpush.fleet.record import EndpointRecord

if TYPE_CHECKING:
    from kvpush.fleet.store import FleetEvent, Follow

log = logging.getLogger(__name__)

QUEUE_MAX = 10_000


@dataclass(frozen=True)
class Status:
    """The registry went down (``up`` False, with why) or came back."""

    t: float
    up: bool
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "event": "registry_up" if self.up else "registry_down",
            "t": round(self.t, 3),
        }
        if self.detail:
            d["detail"] = self.detail
        return d


class FleetWatch:
    def __init__(self, source: RegistrySource) -> None:
        self.source = source
        self.model = FleetModel()
        self.started_at = 0.0
        self.listed_in_s = 0.0
        self._q: queue.Queue[FleetEvent] = queue.Queue(QUEUE_MAX)
        self._follow: Follow | None = None
        self._thread: threading.Thread | None = None
        self.registry_up = True

    def start(self) -> list[EndpointRecord]:
        """List the cluster (raises when etcd does not answer), then follow it."""
        from kvpush.fleet.store import Follow

        t0 = time.monotonic()
        self.started_at = time.time()
        etcd = self.source.open()
        records = self.source.list(etcd)
        self.listed_in_s = time.monotonic() - t0
        self.model.load(records)
        self._follow = Follow(etcd, self.source.cluster)
        self._thread = threading.Thread(target=self._read, name="fleet-watch", daemon=True)
        self._thread.start()
        return records

    def _read(self) -> None:
        assert self._follow is not None
        try:
            for ev in self._follow:
                try:
                    self._q.put_nowait(ev)
                except queue.Full:
                    if ev.kind == "update":
                        continue  # a newer summary of the same endpoint will come
                    self._q.put(ev)  # a join/leave/restart waits for room, never dropped
        except Exception:
            log.exception("fleet watch reader failed")

    def poll(self, timeout_s: float) -> list[Change | Status]:
        """Apply what arrived (waiting up to ``timeout_s`` for the first) to the model."""
        out: list[Change | Status] = []
        try:
            ev = self._q.get(timeout=timeout_s)
        except queue.Empty:
            return out
        while True:
            now = time.time()
            if ev.kind == "registry_down":
                self.registry_up = False
                out.append(Status(now, False, ev.detail))
            elif ev.kind == "registry_up":
                self.registry_up = True
                out.append(Status(now, True))
            elif ev.kind == "leave":
                ch = self.model.delete(ev.address, now)
                if ch is not None:
                    out.append(ch)
            elif ev.record is not None:
                ch = self.model.put(ev.record, now)
                if ch is not None:
                    out.append(ch)
            try:
                ev = self._q.get_nowait()
            except queue.Empty:
                return out

    def rows(self) -> list[FleetRow]:
        return self.model.rows(time.time())

    def stop(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
        if self._thread is not None:
            self._thread.join(5.0)

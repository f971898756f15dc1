"""``kvpush fleet watch``'s engine: the listing, then every change of the cluster, as a model.

Owns ``FleetWatch``. ``start`` lists the cluster (``RegistryUnavailable`` -- exit 69 -- when
etcd does not answer then: a watch that never saw the fleet has nothing to show) and starts the
*reader* thread, which iterates ``kvpush.fleet.store.Follow`` over the process's one etcd
client, seeded with the listing (so it reports only what changed since; the watch survives etcd
going away and coming back: it re-lists and reports what changed meanwhile), and hands each
fleet event -- classified there, once -- to a bounded queue. ``poll`` runs on the caller's
thread: it drains the queue into the ``FleetModel`` (the only thread that touches it) and
returns what happened -- joins, leaves and restarts as ``Change`` s, and the registry going down
or coming back as ``Status`` lines. ``stop`` cancels the watch and joins the reader. A full
queue drops the oldest load updates first, never a join, leave or restart.

Endpoints listed with ``--endpoints``/``--peer`` (and not registered) have no registry to
follow: the *poller* thread looks at them again every ``poll_s`` (``kvpush.commands.fleet
.sight``, ``concurrency`` at a time) and turns what it saw into the same fleet events with
``kvpush.fleet.store.change``: one that answers is a join, a refresh or -- with another
incarnation -- a restart; one whose port refuses connections left (the data path's proof); one
that is silent or unreachable stays as it was (a silence proves nothing) and is named in a
``Status`` line once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.commands.fleet.sight import sight_all
from kvpush.commands.fleet.source import FleetSource
from kvpush.commands.fleet.view import Change, FleetModel, FleetRow
from kvpush.fleet.record import EndpointRecord

if TYPE_CHECKING:
    from kvpush.fleet.store import FleetEvent, Follow

log = logging.getLogger(__name__)

QUEUE_MAX = 10_000
#: Seconds between two looks at the listed endpoints.
POLL_S = 2.0


@dataclass(frozen=True)
class Note:
    """A listed endpoint that stopped answering (said once until it answers again)."""

    t: float
    detail: str

    def to_dict(self) -> dict[str, object]:
        return {"event": "silent", "t": round(self.t, 3), "detail": self.detail}


@dataclass(frozen=True)
class _Silent:
    """A listed endpoint the poller could not see (nothing proven)."""

    address: str
    detail: str = ""
    kind: str = "silent"


@dataclass(frozen=True)
class Status:
    """The registry went down (``up`` False, with why) or came back."""

    t: float
    up: bool
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {
            "event": "registry_up" if self.up else "registry_down",
            "t": round(self.t, 3),
        }
        if self.detail:
            d["detail"] = self.detail
        return d


class FleetWatch:
    def __init__(self, source: FleetSource, poll_s: float = POLL_S) -> None:
        self.source = source
        self.model = FleetModel()
        self.started_at = 0.0
        self.listed_in_s = 0.0
        self.problems: list[str] = []
        self._poll_s = poll_s
        self._q: queue.Queue[FleetEvent | _Silent] = queue.Queue(QUEUE_MAX)
        self._follow: Follow | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._silent: set[str] = set()
        self._listed: dict[str, EndpointRecord] = {}  # listed, not registered (the poller's)
        self.registry_up = True

    def start(self) -> list[EndpointRecord]:
        """List the fleet (raises when etcd does not answer), then follow it."""
        from kvpush.fleet.store import Follow

        t0 = time.monotonic()
        self.started_at = time.time()
        etcd = self.source.open()
        listed = self.source.list(etcd)
        self.problems = listed.problems
        self.listed_in_s = time.monotonic() - t0
        self.model.load(listed.records)
        if etcd is not None and self.source.registry is not None:
            self._follow = Follow(etcd, self.source.registry.cluster, known=listed.registered)
            self._spawn(self._read, "fleet-watch")
        self._listed = {r.address: r for r in listed.records if r.address not in listed.registered}
        if self.source.listing.entries:
            self._spawn(self._poll_listed, "fleet-poll")
        return listed.records

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _poll_listed(self) -> None:
        """Look at the listed endpoints again every ``poll_s`` (see the module docstring)."""
        from kvpush.fleet.store import change

        src = self.source
        registered = self._follow.known if self._follow is not None else {}
        while not self._stop.wait(self._poll_s):
            todo = [e for e in src.listing.entries if e.address not in registered]
            try:
                seen = sight_all(todo, src.token, src.concurrency, src.timeout_s)
            except Exception:
                log.exception("fleet watch: looking at the listed endpoints failed")
                continue
            for s in seen:
                refused = s.kind == "unreachable" and "(connection refused)" in s.problem
                if s.record is None and not refused:
                    self._q.put(_Silent(s.entry.address, s.problem))
                    continue
                ev = change(self._listed, s.entry.address, s.record)
                if ev is not None:
                    self._q.put(ev)
                elif s.record is not None:
                    self._q.put(_Silent(s.entry.address, ""))  # seen: no longer silent

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

    def poll(self, timeout_s: float) -> list[Change | Status | Note]:
        """Apply what arrived (waiting up to ``timeout_s`` for the first) to the model."""
        out: list[Change | Status | Note] = []
        try:
            ev = self._q.get(timeout=timeout_s)
        except queue.Empty:
            return out
        while True:
            item = self._apply(ev, time.time())
            if item is not None:
                out.append(item)
            try:
                ev = self._q.get_nowait()
            except queue.Empty:
                return out

    def _apply(self, ev: FleetEvent | _Silent, now: float) -> Change | Status | Note | None:
        """One event of the reader or the poller, applied to the model (on ``poll``'s thread)."""
        if isinstance(ev, _Silent):
            if not ev.detail:
                self._silent.discard(ev.address)
                return None
            if ev.address in self._silent:
                return None
            self._silent.add(ev.address)
            return Note(now, f"{ev.detail} (nothing proven: its row stays)")
        if ev.kind in ("registry_down", "registry_up"):
            self.registry_up = ev.kind == "registry_up"
            return Status(now, self.registry_up, ev.detail)
        self._silent.discard(ev.address)
        return self.model.apply(ev, now)

    def rows(self) -> list[FleetRow]:
        return self.model.rows(time.time())

    def stop(self) -> None:
        self._stop.set()
        if self._follow is not None:
            self._follow.cancel()
        for t in self._threads:
            t.join(5.0)

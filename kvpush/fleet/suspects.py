"""Registry hints about peers, checked against the data path's own evidence before anything moves.

A ``leave`` (a key deleted or lapsed) or a ``restart`` (a record of another incarnation) in the
registry is a hint, never proof: a lease lapses when a live process froze past its TTL, when
etcd itself stalled, or when someone deleted the prefix or wiped etcd. Acting on it -- failing
the requests waiting on the peer and freeing their blocks with no fence -- lets a peer that was
only frozen WRITE into blocks already given to other requests (docs/reliability.md, "Proof and
hints"). So a hint only makes the endpoint *look*:

``Suspects`` keeps the peers the registry says left or restarted, and asks each one's side
channel who answers there (``Endpoint.look_at_peer``: ``kvpush.peers.sighting``), at once and
then every ``recheck_s`` while nothing is proven:

- *proven* -- the side channel refuses connections, or another process (another incarnation, a
  vLLM listener, an endpoint still starting) answers there: the endpoint drops the peer
  (``Endpoint.forget_peer``: ``peer_left`` / ``peer_restarted``, with the evidence), and its
  NIXL keys are deleted where they live in etcd (``on_proven``);
- *refuted* -- the same incarnation answers: the peer is alive, nothing changes;
- *silent* -- nothing useful answered in time (frozen, wedged, partitioned): nothing changes,
  the work waiting on it waits as it would without a registry (P resuming completes it; its
  deadline ends it, and its blocks stay quarantined until a fence or the peer's proven end);
- the registry shows the same incarnation again (its lease recovered, the prefix re-written):
  the suspicion ends; a peer the endpoint no longer holds (the data path dropped it: a NIXL
  disconnect, a refused side channel, a heartbeat) is no longer looked at.

Threads: ``registry-suspects`` (its own loop, every ``TICK_S``: ``kvpush.fleet.due``) hands
each due check to a pool of ``workers`` threads (each check bounded by a few seconds), so a
wiped registry's thousand hints are checked concurrently and a frozen peer's check never delays
another's. Nothing here is on the data path: ``forget_peer`` only queues the eviction to the
ranks' owner threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from kvpush.fleet.due import DueRunner
from kvpush.fleet.record import EndpointRecord
from kvpush.peers.sighting import Sighting
from kvpush.telemetry.names import Counter, Failure
from kvpush.telemetry.store import Telemetry

log = logging.getLogger(__name__)

TICK_S = 0.2
RECHECK_S = 2.0
#: Peers suspected at once; past it the oldest suspicion of a peer not held is dropped.
MAX_SUSPECTS = 4096
#: How long a peer the endpoint does not hold (only its NIXL keys in etcd are at stake) is
#: looked at before the suspicion is dropped.
UNHELD_GIVE_UP_S = 600.0

Hint = Literal["left", "restarted"]


class Looker(Protocol):
    """What the checks use of the endpoint (``kvpush.endpoint.Endpoint``)."""

    def holds_peer(self, address: str, incarnation: str | None) -> bool: ...
    def look_at_peer(self, address: str) -> Sighting: ...
    def forget_peer(self, address: str, incarnation: str | None, reason: str, why: str) -> None: ...


@dataclass
class Suspect:
    hint: Hint
    record: EndpointRecord  # what the registry said of the peer before the hint
    held: bool
    since: float
    due: float
    running: bool = False
    checks: int = 0
    said_silent: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.record.address, self.record.incarnation)


class Suspects:
    def __init__(
        self,
        ep: Looker,
        telemetry: Telemetry,
        on_proven: Callable[[EndpointRecord], None],
        *,
        recheck_s: float = RECHECK_S,
        workers: int = 8,
    ) -> None:
        self._ep = ep
        self._tm = telemetry
        self._on_proven = on_proven
        self._recheck = recheck_s
        self._due: DueRunner[tuple[str, str], Suspect] = DueRunner(
            self._check,
            name="registry-suspects",
            pool_name="registry-check",
            workers=workers,
            tick_s=TICK_S,
        )
        self._peers = self._due.items  # under ``self._due.lock``
        telemetry.declare(
            counters=[
                Counter.REGISTRY_HINTS,
                Counter.REGISTRY_HINTS_PROVEN,
                Counter.REGISTRY_HINTS_REFUTED,
            ]
        )

    def start(self) -> None:
        self._due.start()

    def stop(self) -> None:
        self._due.stop()

    # ------------------------------------------------------------------ the watch's thread
    def add(self, hint: Hint, previous: EndpointRecord, held: bool) -> None:
        """The registry says ``previous`` left or restarted: look at it (at once)."""
        now = time.monotonic()
        s = Suspect(hint, previous, held, now, now)
        if held:
            self._tm.inc(Counter.REGISTRY_HINTS)
        with self._due.lock:
            if s.key in self._peers:
                return
            if len(self._peers) >= MAX_SUSPECTS:
                unheld = [k for k, v in self._peers.items() if not v.held]
                if not unheld and not held:
                    return
                if unheld:
                    del self._peers[min(unheld, key=lambda k: self._peers[k].since)]
            self._peers[s.key] = s

    def clear(self, address: str, incarnation: str) -> bool:
        """The registry shows ``address`` with ``incarnation`` again: that suspicion ends."""
        with self._due.lock:
            s = self._peers.pop((address, incarnation), None)
        if s is not None and s.held:
            log.info(
                "registry: %s is registered again (incarnation %s): no longer suspected",
                address,
                incarnation[:12],
            )
        return s is not None

    def count(self) -> int:
        return self._due.count()

    # ------------------------------------------------------------------ checker threads
    def _check(self, s: Suspect) -> float | None:
        """One look at ``s`` (a checker thread): None when it is settled, else when to look
        again."""
        try:
            return self._look(s)
        except Exception:  # a check that fails must not leave the suspect stuck
            log.exception("registry: checking %s failed", s.record.address)
            return self._recheck

    def _look(self, s: Suspect) -> float | None:
        rec = s.record
        address, inc = rec.address, rec.incarnation
        if s.held and not self._ep.holds_peer(address, inc):
            # The data path dropped it meanwhile (a disconnect, a refused side channel): its
            # own evidence settled the work; only NIXL keys in etcd may still matter.
            s.held = False
            if rec.nixl_metadata != "etcd":
                return None
        s.checks += 1
        seen = self._ep.look_at_peer(address)
        if seen.proves_gone(inc):
            self._drop(s)
            why = Failure.PEER_LEFT if seen.kind == "refused" else Failure.PEER_RESTARTED
            if s.held:
                self._tm.inc(Counter.REGISTRY_HINTS_PROVEN)
                log.info(
                    "registry: %s %s and its side channel confirms it (%s): dropping it",
                    address,
                    s.hint,
                    seen.detail,
                )
                self._ep.forget_peer(address, inc, why.value, f"registry {s.hint}; {seen.detail}")
            self._on_proven(rec)
        elif seen.kind == "answers":
            self._drop(s)
            if s.held:
                self._tm.inc(Counter.REGISTRY_HINTS_REFUTED)
                log.info(
                    "registry: %s %s, but it answers on its side channel with the same "
                    "incarnation %s: kept (a lapsed lease or a deleted key is not a departure)",
                    address,
                    s.hint,
                    inc[:12],
                )
        else:
            if s.held and not s.said_silent:
                s.said_silent = True
                log.warning(
                    "registry: %s %s, and its side channel does not answer (%s): nothing is "
                    "proven; the work waiting on it waits for its own evidence (its completions, "
                    "a fence, a disconnect, a deadline); looking again every %gs",
                    address,
                    s.hint,
                    seen.detail,
                    self._recheck,
                )
            if not s.held and time.monotonic() - s.since > UNHELD_GIVE_UP_S:
                return None
            return self._recheck
        return None

    def _drop(self, s: Suspect) -> None:
        """Settled: out of the table now, before what follows (a new hint is a new suspect)."""
        self._due.drop(s.key, s)

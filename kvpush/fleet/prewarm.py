"""``serve-* --prewarm``: every compatible pair handshaken before its first request.

Owns ``Prewarmer``. The endpoint's peer watch (``kvpush.fleet.member``) hands it every member of
the cluster it sees join, restart or change (``want``) and every one that leaves (``forget``). A
member of the other role that could work with this endpoint -- both on kvpush's wire, not
leaving, no compatibility field differing (``kvpush.fleet.pairs.pair_differences``) -- becomes a
*target*: its handshakes are started from every rank (``Endpoint.warm_peer``:
``kvpush.peers.warm``; P -> D full, D -> P of D's ``--handshake`` mode), exactly the ones a request
would start, and waited for here. A registry join is only a hint that someone may be there: the
handshake itself is the evidence, and nothing is dropped or failed on the registry's word.

- warm: every rank connected to that incarnation -> ``prewarms`` counted, one log line, the
  target done. A pair unused for ``--peer-idle-ttl`` is forgotten like any idle pair.
- failed (refused, silent, a handshake error): ``prewarms_failed`` counted, said (a warning the
  first time and whenever the reason changes; the failed handshake is a row of the peer table
  with its error) and tried again after ``RETRY_FIRST_S``, doubling up to ``RETRY_MAX_S``, for as
  long as the member stays registered; an incompatible answer ends the target (said once).
- a connection to an older incarnation at that address (a restart the data path has not proven
  yet): not warm, tried again later; the prewarmer evicts nothing.

Never on the data path: at most ``concurrency`` warm-ups run at once, each on a worker of its own
pool, and a warm-up only starts handshakes on the handshake manager's own threads (a request
for the same peer meanwhile joins that handshake, single-flight; pushes to other peers do not
wait for it). Threads: ``registry-prewarm`` (schedules, every ``TICK_S``) and ``prewarm-N``
workers (``kvpush.fleet.due``); ``want``/``forget`` on the peer watch's thread; one lock for
the targets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol

from kvpush.config import Role
from kvpush.errors import IncompatiblePeerError, KvpushError
from kvpush.fleet.due import DueRunner
from kvpush.fleet.pairs import format_differences, pair_differences
from kvpush.fleet.record import EndpointRecord, MemberRecord, joined
from kvpush.peers.handshakes import PeerConn
from kvpush.telemetry.names import Counter
from kvpush.telemetry.store import Telemetry

log = logging.getLogger(__name__)

TICK_S = 0.1
CONCURRENCY = 4
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0


class Warmer(Protocol):
    """What the prewarmer uses of its endpoint (``kvpush.endpoint.Endpoint``)."""

    def warm_peer(
        self, address: str, tp_size: int, engine_id: str
    ) -> Sequence[Future[PeerConn] | PeerConn]: ...


def why_not(own: MemberRecord, peer: MemberRecord) -> str:
    """Why ``own`` does not warm ``peer`` ("" when it does): the same role, a wire that is not
    kvpush's, a record that says it is leaving, a compatibility field that differs."""
    if peer.role == own.role:
        return "same role"
    if own.wire != "kvpush" or peer.wire != "kvpush":
        return "not on kvpush's wire"
    if peer.leaving:
        return "leaving"
    p, d = (own, peer) if own.role == Role.PREFILL else (peer, own)
    diffs = pair_differences(_full(p), _full(d))
    return f"incompatible: {format_differences(diffs)}" if diffs else ""


def _full(rec: MemberRecord) -> EndpointRecord:
    return rec if isinstance(rec, EndpointRecord) else joined(rec, None)


@dataclass
class _Target:
    record: EndpointRecord
    due: float
    tries: int = 0
    running: bool = False
    said: str = ""  # the last failure said (said again only when it changes)
    since: float = 0.0


class Prewarmer:
    def __init__(
        self,
        ep: Warmer,
        own: MemberRecord,
        telemetry: Telemetry,
        *,
        wait_s: float,
        concurrency: int = CONCURRENCY,
    ) -> None:
        self._ep = ep
        self._own = own
        self._tm = telemetry
        self._wait_s = wait_s
        self._due: DueRunner[str, _Target] = DueRunner(
            self._warm,
            name="registry-prewarm",
            pool_name="prewarm",
            workers=concurrency,
            tick_s=TICK_S,
            limit=concurrency,
        )
        telemetry.declare(counters=[Counter.PREWARMS, Counter.PREWARMS_FAILED])

    def start(self) -> None:
        self._due.start()

    def stop(self) -> None:
        self._due.stop()

    # ------------------------------------------------------------------ the peer watch's thread
    def want(self, rec: EndpointRecord) -> None:
        """``rec`` is registered now: warm it if it is a compatible peer (and not warm yet)."""
        if why_not(self._own, rec):
            self.forget(rec.address)
            return
        now = time.monotonic()
        with self._due.lock:
            t = self._due.items.get(rec.address)
            if t is not None and t.record.incarnation == rec.incarnation:
                return
            self._due.items[rec.address] = _Target(rec, now, since=now)

    def forget(self, address: str) -> None:
        with self._due.lock:
            self._due.items.pop(address, None)

    def pending(self) -> int:
        """Targets not warm yet."""
        return self._due.count()

    # ------------------------------------------------------------------ workers
    def _warm(self, t: _Target) -> float | None:
        """One warm-up of ``t`` (a worker): None when it is done, else when to try again."""
        rec = t.record
        t0 = time.monotonic()
        try:
            waiting, started = self._try(rec)
        except IncompatiblePeerError as e:
            log.warning("prewarm: %s %s is not warmed: %s", rec.role, rec.address, e.message)
            return None
        except Exception as e:  # a failed or silent handshake: said, tried again later
            return self._failed(t, e)
        if waiting:
            return 1.0  # an older incarnation's connection: the data path settles it
        if not started:
            return None  # every rank was connected already (a request came first)
        self._tm.inc(Counter.PREWARMS)
        log.info(
            "prewarm: handshaken with %s %s (incarnation %s) in %.0f ms, before any request%s",
            rec.role,
            rec.address,
            rec.incarnation[:12],
            (time.monotonic() - t0) * 1e3,
            f" ({t.tries} failed tries before)" if t.tries else "",
        )
        return None

    def _try(self, rec: EndpointRecord) -> tuple[bool, bool]:
        """Warm ``rec`` from every rank (raises what a handshake raised): whether a rank still
        holds an older incarnation there (not warm yet), and whether a handshake was started."""
        waiting = started = False
        deadline = time.monotonic() + self._wait_s
        for w in self._ep.warm_peer(rec.address, rec.tp_size, rec.engine_id):
            if isinstance(w, Future):
                started = True
                self._wait(w, deadline)  # whoever answers there now: connected
            else:
                waiting |= w.metadata.incarnation != rec.incarnation
        return waiting, started

    def _wait(self, fut: Future[PeerConn], deadline: float) -> None:
        """``fut``'s result (raises its error), in short slices: a stopping endpoint does not
        wait out a silent peer's handshake deadline."""
        while True:
            try:
                fut.result(min(0.5, max(0.01, deadline - time.monotonic())))
                return
            except FutureTimeout:
                if self._due.stopping() or time.monotonic() >= deadline:
                    raise

    def _failed(self, t: _Target, e: Exception) -> float:
        """Count and say a failed warm-up; the back-off before the next try."""
        self._tm.inc(Counter.PREWARMS_FAILED)
        why = e.message if isinstance(e, KvpushError) else f"{type(e).__name__}: {e}"
        t.tries += 1
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** (t.tries - 1))
        say = log.warning if why != t.said else log.debug
        t.said = why
        say(
            "prewarm: %s %s not handshaken (try %d): %s; trying again in %gs",
            t.record.role,
            t.record.address,
            t.tries,
            why,
            delay,
        )
        return delay

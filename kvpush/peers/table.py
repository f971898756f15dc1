"""The peer table: one row per peer rank (connected, connecting, degraded, down or failed).

Owns the rows (``PeerEntry``, one per ``PeerKey``) and every decision made on them: what a new
``ensure`` joins or starts (``begin``: single-flight, at most ``MAX_PEER_ROWS`` rows), how a
handshake's end shows (``succeeded`` / ``failed``), the queries the roles and telemetry ask, the
eviction bookkeeping (``evict``, ``forget``, ``idle``, ``down``) and the transport-error policy.
It owns no NIXL resource: the handshake runner (``kvpush.peers.handshakes``) loads and releases
agents, the owner thread releases what an eviction returns.

Threads: any. Every row is read and written under one lock, taken by the owner threads (queries,
evictions, transport errors), the handshake threads (a handshake's end) and the peer watch
(``kvpush.peers.watch``: one thread per table, from the first connected peer to ``close``; it
finds a quiet peer's side channel refusing connections and marks its row ``down``).

Transport-error policy. A transport error on an established peer (``transport_error``) is counted
by NIXL status and moves it to *degraded*; it is evicted at once when the error says the remote
agent is gone (disconnected, not found), else after ``error_limit`` consecutive errors of which
the last is one NIXL reported; one success (``transport_ok``) makes it connected again. A WRITE or
fence that only *timed out* (a frozen, slow or partitioned peer) degrades the peer but never
evicts it: its bytes may still be on the way, and only a fence on the same connection proves they
landed (a fence through a fresh agent after an eviction could free D's blocks before the old bytes
arrive: measured, tests/faults/test_faults_netns.py). A handshake that finds a new incarnation at
an address it knew counts ``peer_restarts``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from kvpush.config import HandshakeMode
from kvpush.errors import HandshakeError, KvpushError, PeerUnreachableError, ShuttingDownError
from kvpush.peers.state import PeerConn, PeerEntry, PeerGone, PeerKey, peer_name
from kvpush.peers.validation import mode_satisfies
from kvpush.peers.vllm_peer import PeerHint
from kvpush.peers.watch import PeerWatch, Target
from kvpush.ratelog import RateLimitedLog
from kvpush.telemetry.names import Counter, Failure, PeerState, transport_error_counter
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import GONE, TransferError, TransferKind

log = logging.getLogger(__name__)

#: Rows of the peer table (one per peer rank, connected, connecting or failed). At the cap the
#: oldest failed rows are forgotten; when all are live a new peer is refused (too_many_peers).
MAX_PEER_ROWS = 4096
#: Consecutive transport errors after which a degraded peer is evicted (the default).
TRANSPORT_ERROR_LIMIT = 3
#: Transfer-error kinds that say the remote agent is gone: the peer is evicted on the first.
_GONE = GONE
#: Transfer-error kinds that only say nothing completed in time: they degrade, never evict.
_SLOW = frozenset({TransferKind.TIMEOUT})
#: Incarnations remembered per peer address (to tell a restart from a first contact).
_MAX_INCARNATIONS = 4096
_LIVE = (PeerState.CONNECTED, PeerState.DEGRADED)

#: Called under the table's lock when a handshake is about to start: reserves a handshake slot
#: for the key, or says why none is free (the runner's bound on handshakes in flight).
TakeSlot = Callable[[PeerKey], KvpushError | None]


def failed_future(error: BaseException) -> Future[PeerConn]:
    """A handshake refused before it started: its future, already failed with ``error``."""
    f: Future[PeerConn] = Future()
    f.set_exception(error)
    return f


class PeerTable:
    def __init__(
        self,
        telemetry: Telemetry,
        *,
        error_limit: int = TRANSPORT_ERROR_LIMIT,
        watch_name: str = "peer-watch",
    ) -> None:
        self._tm = telemetry
        self._lock = threading.Lock()
        self._peers: dict[PeerKey, PeerEntry] = {}
        self._closed = False
        self._rl = RateLimitedLog(log)
        self._watch: PeerWatch | None = None  # started with the first connected peer
        self._watch_name = watch_name
        self._error_limit = max(1, error_limit)
        self._incarnations: dict[PeerKey, str] = {}

    # ------------------------------------------------------------------ queries
    def get(self, key: PeerKey) -> PeerConn | None:
        e = self._peers.get(key)
        if e is not None and e.state in _LIVE and e.conn is not None:
            e.conn.last_used = time.monotonic()
            return e.conn
        return None

    def by_agent(self, agent_name: str) -> PeerConn | None:
        with self._lock:
            for e in self._peers.values():
                if e.conn is not None and e.conn.agent_name == agent_name:
                    return e.conn
        return None

    def gone(self, g: PeerGone) -> list[PeerKey]:
        """The peers ``g`` names (connected, or connected before a handshake now running)."""
        with self._lock:
            return [k for k, e in self._peers.items() if e.conn is not None and g.matches(e.conn)]

    def connected(self) -> list[PeerConn]:
        """Every peer connected now."""
        with self._lock:
            return [e.conn for e in self._peers.values() if e.state in _LIVE and e.conn is not None]

    def rows(self) -> list[dict[str, object]]:
        """Per-peer telemetry rows."""
        now = time.monotonic()
        with self._lock:
            entries = list(self._peers.values())
        rows: list[dict[str, object]] = []
        for e in entries:
            rows.append(
                {
                    "peer": peer_name(e.key),
                    "engine_id": e.conn.metadata.engine_id if e.conn else "",
                    "role": e.conn.metadata.role if e.conn else "",
                    "mode": e.mode.value,
                    "state": e.state,
                    "duration_s": round(
                        e.duration_s if e.state != PeerState.CONNECTING else now - e.started, 6
                    ),
                    "failures": e.failures,
                    "last_error": e.last_error,
                }
            )
        return rows

    def counts(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = dict.fromkeys(PeerState, 0)
            for e in self._peers.values():
                out[e.state] = out.get(e.state, 0) + 1
            return out

    # ------------------------------------------------------------------ a handshake's row
    def begin(
        self, key: PeerKey, mode: HandshakeMode, hint: PeerHint, take_slot: TakeSlot
    ) -> Future[PeerConn] | PeerEntry | None:
        """``ensure``'s decision, under the lock: None when ``key`` is connected in a mode that
        satisfies ``mode``; a future when a handshake for it already runs (single-flight) or
        none may start (already failed); else the new *connecting* row, whose handshake the
        caller must run."""
        with self._lock:
            e = self._peers.get(key)
            if self._closed or (e is not None and e.state == PeerState.DOWN):
                # (down: its process is gone; evicted at the owner's next housekeeping)
                return failed_future(self._unusable(key, e))
            if e is not None and mode_satisfies(e.mode, mode):
                if e.state in _LIVE and e.conn is not None:
                    e.conn.last_used = time.monotonic()
                    return None
                if e.state == PeerState.CONNECTING:
                    return e.future
            # An upgrade notif -> full goes on from here: the owner keeps using the old conn
            # until the new one replaces it; the old agent is the same name, so no remove.
            refused = self._no_room(key, e) or take_slot(key)
            if refused is not None:
                return failed_future(refused)
            fut: Future[PeerConn] = Future()
            fut.set_running_or_notify_cancel()
            new = PeerEntry(
                key,
                mode,
                PeerState.CONNECTING,
                fut,
                time.monotonic(),
                conn=e.conn if e is not None else None,
                failures=e.failures if e is not None else 0,
                hint=hint,
            )
            self._peers[key] = new
        return new

    def _unusable(self, key: PeerKey, e: PeerEntry | None) -> KvpushError:
        """Why no handshake with ``key`` may start: the table is closed, or the peer is down."""
        if self._closed:
            return ShuttingDownError("endpoint is shutting down")
        why = e.last_error if e is not None else ""
        return PeerUnreachableError(f"{peer_name(key)} is down: {why}")

    def _no_room(self, key: PeerKey, e: PeerEntry | None) -> KvpushError | None:
        """A new row at the cap (under the lock): room made, or why there is none."""
        if e is not None or len(self._peers) < MAX_PEER_ROWS or self._make_room():
            return None
        self._tm.fail(Failure.TOO_MANY_PEERS)
        return HandshakeError(
            peer_name(key),
            f"{MAX_PEER_ROWS} peers already known (too_many_peers)",
            "idle peers are forgotten after --peer-idle-ttl; if this persists, "
            "a peer may be naming many addresses",
        )

    def _make_room(self) -> bool:
        """At the row cap: forget the oldest failed rows that hold no connection (under the
        lock). False when every row is live or connecting."""
        failed = sorted(
            (e.started, k)
            for k, e in self._peers.items()
            if e.state == PeerState.FAILED and e.conn is None
        )
        for _, k in failed[: max(1, MAX_PEER_ROWS // 16)]:
            del self._peers[k]
        return len(self._peers) < MAX_PEER_ROWS

    def failed(self, e: PeerEntry, err: KvpushError) -> None:
        """Handshake thread: ``e``'s handshake failed with ``err``."""
        with self._lock:
            e.state = PeerState.FAILED
            e.failures += 1
            e.last_error = str(err)
            e.duration_s = time.monotonic() - e.started
            # a previous connection (e.g. notif before a failed upgrade) stays usable
            if e.conn is not None:
                e.state = PeerState.CONNECTED
                e.mode = e.conn.mode

    def succeeded(self, e: PeerEntry, conn: PeerConn) -> bool:
        """Handshake thread: ``e``'s handshake connected ``conn``. True when the table was
        closed meanwhile (nobody owns ``conn``: the caller releases it)."""
        inc = conn.metadata.incarnation
        with self._lock:
            e.conn = conn
            e.state = PeerState.CONNECTED
            e.errors = 0
            e.duration_s = time.monotonic() - e.started
            closed = self._closed
            if self._watch is None and not closed:
                self._watch = PeerWatch(self._quiet_peers, self._mark_down, name=self._watch_name)
                self._watch.start()
            before = self._incarnations.pop(e.key, "")
            if inc:
                self._incarnations[e.key] = inc
                if len(self._incarnations) > _MAX_INCARNATIONS:
                    del self._incarnations[next(iter(self._incarnations))]
        if before and inc and before != inc:
            self._tm.inc(Counter.PEER_RESTARTS)
            log.info(
                "peer %s restarted: incarnation %s -> %s", peer_name(e.key), before[:12], inc[:12]
            )
        return closed

    # ------------------------------------------------------------------ transport health
    def transport_error(self, key: PeerKey, err: TransferError) -> bool:
        """A NIXL operation on ``key``'s connection failed: count it by status, mark the peer
        degraded; True when the caller must evict it now (its agent is gone, or this is the
        ``error_limit``-th error in a row and not a timeout: see the module's docstring)."""
        self._tm.inc(transport_error_counter(err.status))
        with self._lock:
            e = self._peers.get(key)
            if e is None or e.conn is None:
                return err.kind in _GONE
            e.errors += 1
            e.last_error = str(err)[:300]
            first = e.state == PeerState.CONNECTED
            if first:
                e.state = PeerState.DEGRADED
            n = e.errors
            evict = err.kind in _GONE or (n >= self._error_limit and err.kind not in _SLOW)
            decided = evict and not e.doomed
            e.doomed = e.doomed or evict
        if first:
            self._tm.inc(Counter.PEERS_DEGRADED)
        if decided:
            self._tm.inc(Counter.PEERS_EVICTED_TRANSPORT)
        self._rl.warning(
            "transport",
            "transport error %d/%d on %s (%s): %s%s",
            n,
            self._error_limit,
            peer_name(key),
            err.status,
            err,
            "; evicting it" if evict else "; degraded",
        )
        return evict

    def transport_ok(self, key: PeerKey) -> None:
        """A NIXL operation on ``key``'s connection succeeded: a degraded peer is connected."""
        e = self._peers.get(key)
        if e is None or not e.errors:
            return
        with self._lock:
            e.errors = 0
            if e.state == PeerState.DEGRADED:
                e.state = PeerState.CONNECTED

    # ------------------------------------------------------------------ eviction
    def evict(self, key: PeerKey, reason: str) -> PeerConn | None:
        """Forget a peer; return its connection for the owner to release."""
        with self._lock:
            e = self._peers.pop(key, None)
        if e is None:
            return None
        log.info("evicting peer %s: %s", peer_name(key), reason)
        self._tm.inc(Counter.PEERS_EVICTED)
        if e.conn is not None:
            e.conn.evicted = True
        return e.conn

    def forget(self, key: PeerKey) -> PeerConn | None:
        """Drop a connection that serves no data path (a D rank's handshake with P's rank 0
        that only told it P's TP size): no row, no eviction counted; the owner releases what
        is returned. A handshake still under way is left alone (its thread would finish a
        connection nobody releases)."""
        with self._lock:
            e = self._peers.get(key)
            if e is None or e.state != PeerState.CONNECTED:
                return None
            del self._peers[key]
        return e.conn

    def down(self) -> list[tuple[PeerKey, str]]:
        """Peers marked down (their process is gone), with why: for the owner to evict."""
        with self._lock:
            return [(k, e.last_error) for k, e in self._peers.items() if e.state == PeerState.DOWN]

    def _quiet_peers(self, quiet_s: float) -> list[Target]:
        """Watch thread: the connected peers no one used for ``quiet_s``."""
        now = time.monotonic()
        with self._lock:
            return [
                (e, e.key[0], e.key[1])
                for e in self._peers.values()
                if e.state == PeerState.CONNECTED
                and e.conn is not None
                and now - e.conn.last_used > quiet_s
            ]

    def _mark_down(self, token: object, why: str) -> None:
        """Watch thread: the peer of row ``token`` refused a connection: its row reads down."""
        with self._lock:
            e = self._peers.get(token.key) if isinstance(token, PeerEntry) else None
            if e is not token or e is None or e.state != PeerState.CONNECTED:
                return  # replaced, evicted or no longer connected meanwhile
            e.state, e.last_error = PeerState.DOWN, why
        log.info("peer %s is down: %s", peer_name(e.key), why)

    def idle(self, ttl_s: float) -> list[PeerKey]:
        now = time.monotonic()
        with self._lock:
            return [
                k
                for k, e in self._peers.items()
                if (e.conn is not None and now - e.conn.last_used > ttl_s)
                or (e.state == PeerState.FAILED and e.conn is None and now - e.started > ttl_s)
            ]

    def close(self) -> list[PeerConn]:
        """Refuse new handshakes, stop the watch; return every known connection for release.
        Handshakes still running find the table closed when they end (``succeeded``)."""
        with self._lock:
            self._closed = True
            entries = list(self._peers.values())
            self._peers.clear()
            if self._watch is not None:
                self._watch.stop()
        return [e.conn for e in entries if e.conn is not None]

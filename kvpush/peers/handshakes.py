"""Handshakes with peers: ``ensure(peer, mode) -> Future | None`` and the peer table.

A handshake fetches the peer's metadata over the side channel (deadline-bound), checks the
compatibility hash *before* decoding the metadata, checks geometry field by field
(``kvpush.peers.validation``), and only then hands the peer's NIXL metadata to
``add_remote_agent``. A *notif-only* handshake loads the peer's connection-only metadata (no
memory regions): enough to send notifications. A *full*
handshake loads full metadata and prepares the remote descriptor list for every block of every
region (region-major, built with numpy) -- the expensive part, which therefore always runs here,
on a handshake thread, never on the caller's (writer's) thread.

Threads: one short-lived thread per in-flight handshake (bounded by a semaphore), so a peer that
never answers only ties up its own thread until its deadline and never delays a healthy peer
(vLLM runs one handshake at a time). The peer table is guarded by one lock. Evicting a peer only
removes it from the table; releasing its NIXL resources is the owner thread's job
(``release_conn``), because the owner may still be using its descriptor list.

A connected peer whose process is gone shows as such at once: ``kvpush.peers.watch`` (one
thread per manager, from the first connection to ``close``) finds a quiet peer's side channel
refusing connections and marks its row ``down``; a handshake to it fails at once; the owner
evicts it at its next housekeeping (``down()``), as it evicts a peer whose heartbeat, PUSH_REG
or WRITE failed.

Handshakes to one peer are single-flight: while one is under way for a key, ``ensure`` returns
its future to every other caller (ranks, requests), so the same remote agent is never added
twice at once (LightLLM #1470). A transport error on an established peer (``transport_error``)
is counted by NIXL status and moves it to *degraded*; it is evicted at once when the error says
the remote agent is gone (disconnected, not found), else after ``error_limit`` consecutive
errors of which the last is one NIXL reported; one success (``transport_ok``) makes it
connected again. A WRITE or fence that only *timed out* (a frozen, slow or partitioned peer)
degrades the peer but never evicts it: its bytes may still be on the way, and only a fence on
the same connection proves they landed (a fence through a fresh agent after an eviction could
free D's blocks before the old bytes arrive: measured, tests/faults/test_faults_netns.py).
A handshake that finds a new incarnation at an address it knew counts ``peer_restarts``.

What differs between the wires -- how the peer's metadata is fetched and checked -- is the
endpoint's dialect's (``kvpush.peers.dialect``); loading it into NIXL is shared.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from kvpush.config import HandshakeMode, Role, Timeouts
from kvpush.errors import (
    HandshakeError,
    IncompatiblePeerError,
    KvpushError,
    PeerUnreachableError,
    ShuttingDownError,
)
from kvpush.memory.descriptors import block_descs
from kvpush.peers.dialect import Ask, Dialect, Fetched, KvpushDialect
from kvpush.peers.state import PeerConn, PeerEntry, PeerGone, PeerKey, peer_key, peer_name
from kvpush.peers.tp import Slice, check_ratio, write_slice
from kvpush.peers.validation import mode_satisfies
from kvpush.peers.vllm_peer import PeerHint
from kvpush.peers.watch import PeerWatch, Target
from kvpush.ratelog import RateLimitedLog
from kvpush.telemetry.names import Counter, Failure, Hist, PeerState, transport_error_counter
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import GONE, Agent, DList, TransferError, TransferKind
from kvpush.transport.client import SideChannelClient
from kvpush.wire import protocol
from kvpush.wire.auth import Authenticator

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


def _failed(error: BaseException) -> Future[PeerConn]:
    """A handshake refused before it started: its future, already failed with ``error``."""
    f: Future[PeerConn] = Future()
    f.set_exception(error)
    return f


class HandshakeManager:
    def __init__(
        self,
        agent: Agent,
        local_md: protocol.EndpointMetadata,
        auth: Authenticator,
        timeouts: Timeouts,
        telemetry: Telemetry,
        *,
        max_concurrent: int = 64,
        max_pending: int = 256,
        dialect: Dialect | None = None,
        error_limit: int = TRANSPORT_ERROR_LIMIT,
    ) -> None:
        # How a peer's metadata is fetched and checked: the endpoint's wire (kvpush's by default).
        self._dialect: Dialect = dialect or KvpushDialect(auth)
        self._agent = agent
        self._local = local_md
        self._local_hash = protocol.compat_hash(local_md)
        self._auth = auth
        self._timeouts = timeouts
        self._tm = telemetry
        self._sem = threading.BoundedSemaphore(max_concurrent)
        # Handshake threads alive at once (running or waiting for the semaphore): bounded, so
        # a flood naming many addresses (e.g. unauthenticated Pings) cannot start a thread each.
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self._peers: dict[PeerKey, PeerEntry] = {}
        self._closed = False
        self._rl = RateLimitedLog(log)
        self._watch: PeerWatch | None = None  # started with the first connected peer
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

    # ------------------------------------------------------------------ ensure
    def ensure(
        self, key: PeerKey, mode: HandshakeMode, hint: PeerHint | None = None
    ) -> Future[PeerConn] | None:
        """None if already connected in a sufficient mode, else the (new or joined) future.

        ``hint``: what the caller knows of a vLLM peer (its engine id, checked like vLLM does,
        and its TP size); ignored on kvpush's wire, where the peer tells both."""
        with self._lock:
            if self._closed:
                return _failed(ShuttingDownError("endpoint is shutting down"))
            e = self._peers.get(key)
            if e is not None and e.state == PeerState.DOWN:
                down = PeerUnreachableError(f"{peer_name(key)} is down: {e.last_error}")
                return _failed(
                    down
                )  # its process is gone: evicted at the owner's next housekeeping
            if e is not None:
                if e.state in _LIVE and e.conn is not None and mode_satisfies(e.mode, mode):
                    e.conn.last_used = time.monotonic()
                    return None
                if e.state == PeerState.CONNECTING and mode_satisfies(e.mode, mode):
                    return e.future
                if e.state in _LIVE:
                    # Upgrade notif -> full: the owner keeps using the old conn until the new
                    # one replaces it; the old agent is the same name, so no remove is needed.
                    pass
            if e is None and len(self._peers) >= MAX_PEER_ROWS and not self._make_room():
                self._tm.fail(Failure.TOO_MANY_PEERS)
                return _failed(
                    HandshakeError(
                        peer_name(key),
                        f"{MAX_PEER_ROWS} peers already known (too_many_peers)",
                        "idle peers are forgotten after --peer-idle-ttl; if this persists, "
                        "a peer may be naming many addresses",
                    )
                )
            if self._pending >= self._max_pending:
                self._tm.fail(Failure.HANDSHAKE_OVERLOAD)
                return _failed(
                    HandshakeError(
                        peer_name(key),
                        f"{self._pending} handshakes already in flight",
                        "retry later; if this persists, a peer may be flooding this endpoint",
                    )
                )
            self._pending += 1
            fut: Future[PeerConn] = Future()
            fut.set_running_or_notify_cancel()
            failures = e.failures if e is not None else 0
            old = e.conn if e is not None else None
            new = PeerEntry(
                key,
                mode,
                PeerState.CONNECTING,
                fut,
                time.monotonic(),
                conn=old,
                failures=failures,
                hint=hint or PeerHint(),
            )
            self._peers[key] = new
        self._tm.inc(Counter.HANDSHAKES_STARTED)
        t = threading.Thread(
            target=self._run, args=(new,), name=f"handshake-{key[0]}:{key[1]}", daemon=True
        )
        t.start()
        return fut

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

    def handshake_sync(self, key: PeerKey, mode: HandshakeMode, timeout_s: float) -> PeerConn:
        fut = self.ensure(key, mode)
        if fut is None:
            conn = self.get(key)
            assert conn is not None
            return conn
        return fut.result(timeout_s)

    def _run(self, e: PeerEntry) -> None:
        try:
            self._run_one(e)
        finally:
            with self._lock:
                self._pending -= 1

    def _run_one(self, e: PeerEntry) -> None:
        peer = peer_name(e.key)
        try:
            with self._sem:
                conn = self._handshake(e.key, e.mode, e.hint)
        except BaseException as exc:
            err = self._as_typed(exc, peer)
            with self._lock:
                e.state = PeerState.FAILED
                e.failures += 1
                e.last_error = str(err)
                e.duration_s = time.monotonic() - e.started
                # a previous connection (e.g. notif before a failed upgrade) stays usable
                if e.conn is not None:
                    e.state = PeerState.CONNECTED
                    e.mode = e.conn.mode
            # A counter, not a failure kind: the writer / receiver count "handshake_failed" once
            # per push or request dropped because of it (one place per failure kind).
            self._tm.inc(Counter.HANDSHAKES_FAILED)
            self._rl.warning("handshake_failed", "%s", err)
            e.future.set_exception(err)
            return
        inc = conn.metadata.incarnation
        with self._lock:
            e.conn = conn
            e.state = PeerState.CONNECTED
            e.errors = 0
            e.duration_s = time.monotonic() - e.started
            closed = self._closed
            if self._watch is None and not closed:
                self._watch = PeerWatch(
                    self._quiet_peers, self._mark_down, name=f"peer-watch-{self._local.tp_rank}"
                )
                self._watch.start()
            before = self._incarnations.pop(e.key, "")
            if inc:
                self._incarnations[e.key] = inc
                if len(self._incarnations) > _MAX_INCARNATIONS:
                    del self._incarnations[next(iter(self._incarnations))]
        if before and inc and before != inc:
            self._tm.inc(Counter.PEER_RESTARTS)
            log.info("peer %s restarted: incarnation %s -> %s", peer, before[:12], inc[:12])
        self._tm.inc(Counter.HANDSHAKES_OK)
        self._tm.observe(Hist.HANDSHAKE_DURATION, e.duration_s)
        log.info(
            "handshake %s with %s (%s) done in %.1f ms: %s",
            e.mode.value,
            peer,
            conn.metadata.engine_id,
            e.duration_s * 1e3,
            ", ".join(f"{k}={v * 1e3:.2f}ms" for k, v in conn.timings.items()),
        )
        if closed:
            self.release_conn(conn)  # nobody owns it any more
            e.future.set_exception(ShuttingDownError("endpoint is shutting down"))
            return
        e.future.set_result(conn)

    @staticmethod
    def _as_typed(exc: BaseException, peer: str) -> KvpushError:
        if isinstance(exc, (PeerUnreachableError, IncompatiblePeerError, HandshakeError)):
            return exc
        if isinstance(exc, KvpushError):
            return HandshakeError(peer, exc.message, exc.hint or None)
        return HandshakeError(peer, f"{type(exc).__name__}: {exc}")

    def _handshake(self, key: PeerKey, mode: HandshakeMode, hint: PeerHint) -> PeerConn:
        """Fetch and check the peer rank's metadata in this endpoint's dialect, then load it."""
        host, port, rank = key
        peer = peer_name(key)
        deadline = time.monotonic() + self._timeouts.handshake_s
        timeout = min(self._timeouts.side_channel_s, self._timeouts.handshake_s)
        ask = Ask(peer, rank, mode, hint, self._local, self._local_hash)
        t0 = time.perf_counter()
        w0 = time.time()
        with SideChannelClient(host, port, auth=self._auth, timeout_s=timeout) as client:
            try:
                got = self._dialect.fetch(client, ask)
            except PeerUnreachableError as e:
                raise PeerUnreachableError(f"handshake with {peer} failed: {e}") from None
        t1 = time.perf_counter()
        w1 = time.time()
        offset = got.server_clock - (w0 + w1) / 2
        return self._load(key, mode, got, deadline, t0=t0, t1=t1, clock_offset=offset)

    def _load(
        self,
        key: PeerKey,
        mode: HandshakeMode,
        got: Fetched,
        deadline: float,
        *,
        t0: float,
        t1: float,
        clock_offset: float,
    ) -> PeerConn:
        """Both wires: load the peer's agent (from its answer, or NIXL's etcd backend), prepare
        the remote descriptor list (full mode) and warm the connection; undone on failure.
        ``t0``/``t1``: when the side-channel fetch began and ended."""
        md, peer = got.metadata, peer_name(key)
        p_tp, d_tp = self._tp_sizes(md)
        check_ratio(p_tp, d_tp, peer)
        if time.monotonic() > deadline:
            raise HandshakeError(peer, f"deadline of {self._timeouts.handshake_s:g}s passed")
        name, from_etcd = self._add_agent(got, deadline)
        t2 = time.perf_counter()
        dlist: DList | None = None
        sl: Slice | None = None  # P -> D full: this rank's part of each of D's pages
        try:
            if md.agent_name and name != md.agent_name:
                raise HandshakeError(
                    peer, f"NIXL agent name {name!r} differs from the announced {md.agent_name!r}"
                )
            if mode == HandshakeMode.FULL:
                sl = self._write_slice(md, p_tp, d_tp, peer)
                dlist = self._prep_remote(name, md, sl, got.block_strides)
            t3 = time.perf_counter()
            # Warm the connection now, not on the request path (UCX wire-up costs 4-9 RTT).
            self._agent.make_connection(name)
            t4 = time.perf_counter()
        except BaseException:
            if dlist is not None:
                self._agent.release_dlist(dlist)
            self._agent.remove_remote(name)
            raise
        timings = {
            "side_channel_s": t1 - t0,
            "load_s": t2 - t1,
            "prep_s": t3 - t2,
            "warm_s": t4 - t3,
            "total_s": t4 - t0,
        }
        if from_etcd:
            timings["etcd_load_s"] = t2 - t1  # the agent came from NIXL's etcd backend
        rtt = t1 - t0
        return PeerConn(
            key=key,
            metadata=md,
            agent_name=name,
            mode=mode,
            remote_dlist=dlist,
            timings=timings,
            write=sl,
            rtt_s=rtt,
            clock_offset_s=clock_offset,
        )

    def _tp_sizes(self, md: protocol.EndpointMetadata) -> tuple[int, int]:
        """(P's TP size, D's TP size) of this endpoint and the peer ``md`` describes."""
        if self._local.role == Role.PREFILL:
            return self._local.tp_size, md.tp_size
        return md.tp_size, self._local.tp_size

    def _add_agent(self, got: Fetched, deadline: float) -> tuple[str, bool]:
        """Load the peer's agent from its answer, or with --nixl-metadata etcd from NIXL's etcd
        backend (a vLLM peer's answer names no agent: it always comes from the answer); its
        name, and whether it came from etcd."""
        md = got.metadata
        if self._agent.etcd_metadata and md.agent_name:
            left = max(0.1, deadline - time.monotonic())
            return self._agent.fetch_remote(md.agent_name, left), True
        return self._agent.add_remote(got.agent_metadata), False

    def _write_slice(
        self, md: protocol.EndpointMetadata, p_tp: int, d_tp: int, peer: str
    ) -> Slice | None:
        """P -> D: what this P rank writes of each of that D rank's pages (its share, or a
        chunk); None for any other full handshake (D measuring one, kvpush probe)."""
        if self._local.role != Role.PREFILL or md.role != Role.DECODE:
            return None
        try:
            return write_slice(
                self._local.tp_rank,
                md.tp_rank,
                p_tp,
                d_tp,
                self._local.block_bytes,
                md.block_bytes,
                self._local.kv_heads == 1,
            )
        except ValueError as e:
            raise IncompatiblePeerError(
                f"{peer} is incompatible: {e}",
                [],
                "give --kv-heads as the model's KV heads over all ranks, and check "
                "--block-bytes on both sides",
            ) from None

    def _prep_remote(
        self, name: str, md: protocol.EndpointMetadata, sl: Slice | None, strides: list[int] | None
    ) -> DList:
        """The remote descriptor list of every block of every region: whole pages, or the
        slice of each page this rank writes."""
        offset, length = (sl.remote_offset, sl.length) if sl is not None else (0, md.block_bytes)
        descs = block_descs(
            md.region_base_addrs,
            md.num_blocks,
            length,
            md.device_id,
            strides or [md.block_bytes] * md.regions,
            offset,
        )
        return self._agent.prep_remote(name, descs, md.device_kind)

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

    def release_conn(self, conn: PeerConn) -> None:
        """Release a peer's NIXL resources (owner thread only)."""
        if conn.released:
            return
        conn.released = True
        if conn.remote_dlist is not None:
            self._agent.release_dlist(conn.remote_dlist)
        self._agent.remove_remote(conn.agent_name)
        if conn.evicted:
            self._tm.inc(Counter.STALE_AGENTS_REMOVED)
            log.info("removed the agent %s of evicted peer %s", conn.agent_name, conn.address)

    def close(self) -> list[PeerConn]:
        """Refuse new handshakes; return every known connection for release."""
        with self._lock:
            self._closed = True
            entries = list(self._peers.values())
            self._peers.clear()
            if self._watch is not None:
                self._watch.stop()
        # Handshakes still running finish by their deadline, see _closed and release their own
        # connection (see _run).
        return [e.conn for e in entries if e.conn is not None]


__all__ = ["HandshakeManager", "PeerConn", "PeerGone", "PeerKey", "peer_key", "peer_name"]

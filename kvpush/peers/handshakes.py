"""Handshakes with peers: ``ensure(peer, mode) -> Future | None``, run on threads of their own.

A handshake fetches the peer's metadata over the side channel (deadline-bound), checks the
compatibility hash *before* decoding the metadata, checks geometry field by field
(``kvpush.peers.validation``), and only then hands the peer's NIXL metadata to
``add_remote_agent``. A *notif-only* handshake loads the peer's connection-only metadata (no
memory regions): enough to send notifications. A *full*
handshake loads full metadata and prepares the remote descriptor list for every block of every
region (region-major, built with numpy) -- the expensive part, which therefore always runs here,
on a handshake thread, never on the caller's (writer's) thread.

Owns the runner: single-flight starts, the handshake threads and their bound, loading a peer into
NIXL and releasing it (``release_conn``). The rows, their queries, eviction bookkeeping and the
transport-error policy are the peer table's (``kvpush.peers.table``); ``HandshakeManager`` hands
those verbs through, so a role asks one object for both.

Threads: one short-lived thread per in-flight handshake (bounded by a semaphore), so a peer that
never answers only ties up its own thread until its deadline and never delays a healthy peer
(vLLM runs one handshake at a time). Evicting a peer only removes it from the table; releasing its
NIXL resources is the owner thread's job (``release_conn``), because the owner may still be using
its descriptor list. A connected peer whose process is gone is marked ``down`` by the table's
watch; a handshake to it fails at once and the owner evicts it at its next housekeeping
(``down()``), as it evicts a peer whose heartbeat, PUSH_REG or WRITE failed.

Handshakes to one peer are single-flight: while one is under way for a key, ``ensure`` returns
its future to every other caller (ranks, requests), so the same remote agent is never added
twice at once (LightLLM #1470).

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
    PeerShuttingDownError,
    PeerUnreachableError,
    ShuttingDownError,
)
from kvpush.memory.descriptors import block_descs
from kvpush.peers.dialect import Ask, Dialect, Fetched, KvpushDialect
from kvpush.peers.state import PeerConn, PeerEntry, PeerGone, PeerKey, peer_key, peer_name
from kvpush.peers.table import TRANSPORT_ERROR_LIMIT, PeerTable
from kvpush.peers.tp import Slice, check_ratio, write_slice
from kvpush.peers.vllm_peer import PeerHint
from kvpush.ratelog import RateLimitedLog
from kvpush.telemetry.names import Counter, Failure, Hist
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import Agent, DList, TransferError
from kvpush.transport.client import SideChannelClient
from kvpush.wire import protocol
from kvpush.wire.auth import Authenticator

log = logging.getLogger(__name__)


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
        self._slots = threading.Lock()  # guards _pending
        self._rl = RateLimitedLog(log)
        self._table = PeerTable(
            telemetry, error_limit=error_limit, watch_name=f"peer-watch-{local_md.tp_rank}"
        )

    # ------------------------------------------------------------------ the table's verbs
    def get(self, key: PeerKey) -> PeerConn | None:
        return self._table.get(key)

    def by_agent(self, agent_name: str) -> PeerConn | None:
        return self._table.by_agent(agent_name)

    def gone(self, g: PeerGone) -> list[PeerKey]:
        """The peers ``g`` names (connected, or connected before a handshake now running)."""
        return self._table.gone(g)

    def connected(self) -> list[PeerConn]:
        """Every peer connected now."""
        return self._table.connected()

    def rows(self) -> list[dict[str, object]]:
        """Per-peer telemetry rows."""
        return self._table.rows()

    def counts(self) -> dict[str, int]:
        return self._table.counts()

    def transport_error(self, key: PeerKey, err: TransferError) -> bool:
        """True when the caller must evict ``key`` now (``PeerTable.transport_error``)."""
        return self._table.transport_error(key, err)

    def transport_ok(self, key: PeerKey) -> None:
        self._table.transport_ok(key)

    def evict(self, key: PeerKey, reason: str) -> PeerConn | None:
        """Forget a peer; return its connection for the owner to release."""
        return self._table.evict(key, reason)

    def forget(self, key: PeerKey) -> PeerConn | None:
        """Drop a connection that serves no data path (``PeerTable.forget``)."""
        return self._table.forget(key)

    def down(self) -> list[tuple[PeerKey, str]]:
        """Peers marked down (their process is gone), with why: for the owner to evict."""
        return self._table.down()

    def idle(self, ttl_s: float) -> list[PeerKey]:
        return self._table.idle(ttl_s)

    # ------------------------------------------------------------------ ensure
    def ensure(
        self, key: PeerKey, mode: HandshakeMode, hint: PeerHint | None = None
    ) -> Future[PeerConn] | None:
        """None if already connected in a sufficient mode, else the (new or joined) future.

        ``hint``: what the caller knows of a vLLM peer (its engine id, checked like vLLM does,
        and its TP size); ignored on kvpush's wire, where the peer tells both."""
        got = self._table.begin(key, mode, hint or PeerHint(), self._take_slot)
        if not isinstance(got, PeerEntry):
            return got
        self._tm.inc(Counter.HANDSHAKES_STARTED)
        t = threading.Thread(
            target=self._run, args=(got,), name=f"handshake-{key[0]}:{key[1]}", daemon=True
        )
        t.start()
        return got.future

    def _take_slot(self, key: PeerKey) -> KvpushError | None:
        """Under the table's lock, before a handshake starts: one more thread in flight, or
        why not (too many already)."""
        with self._slots:
            if self._pending >= self._max_pending:
                self._tm.fail(Failure.HANDSHAKE_OVERLOAD)
                return HandshakeError(
                    peer_name(key),
                    f"{self._pending} handshakes already in flight",
                    "retry later; if this persists, a peer may be flooding this endpoint",
                )
            self._pending += 1
        return None

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
            with self._slots:
                self._pending -= 1

    def _run_one(self, e: PeerEntry) -> None:
        peer = peer_name(e.key)
        try:
            with self._sem:
                conn = self._handshake(e.key, e.mode, e.hint)
        except BaseException as exc:
            err = self._as_typed(exc, peer)
            self._table.failed(e, err)
            # A counter, not a failure kind: the writer / receiver count "handshake_failed" once
            # per push or request dropped because of it (one place per failure kind).
            self._tm.inc(Counter.HANDSHAKES_FAILED)
            self._rl.warning("handshake_failed", "%s", err)
            e.future.set_exception(err)
            return
        closed = self._table.succeeded(e, conn)
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
        typed = (PeerUnreachableError, IncompatiblePeerError, HandshakeError, PeerShuttingDownError)
        if isinstance(exc, typed):
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

    # ------------------------------------------------------------------ release
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
        # Handshakes still running finish by their deadline, find the table closed and release
        # their own connection (see _run_one).
        return self._table.close()


__all__ = ["HandshakeManager", "PeerConn", "PeerGone", "PeerKey", "peer_key", "peer_name"]

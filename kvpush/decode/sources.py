"""D's connections to the P ranks a request draws from: P's TP size learnt, one connection each.

Which of P's ranks write into this D rank follows from P's TP size (``kvpush.peers.tp.sources``).
That size comes from the request (a vLLM P's kv_transfer_params), from an earlier request to the
same P (``ctx.peer_tp``, shared by this endpoint's ranks) or from a handshake with P's rank 0.
``connect`` makes sure every source rank is connected, never waiting for a handshake: one under
way parks the request (``HANDSHAKING``) and its done-callback hands the request back through the
receiver's ``ready`` inbox, which connects it again. Connections of another TP size than the
request assumed (P restarted at another size) make the request learn P's size afresh and start
over, at most twice; a handshake that failed while the size was an earlier request's is retried
from P's rank 0 once (``relearn_after_failure``). A P restarted under another engine id (vLLM's
router says so) loses its old connection first.

Thread: the receiver's owner thread (``Receiver`` calls it); ``_handshake_done`` runs on the
handshake thread and only hands the request back.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from kvpush.address import format_address
from kvpush.config import HandshakeMode, Role
from kvpush.decode.outcomes import Outcomes
from kvpush.decode.peers import PrefillPeers
from kvpush.decode.requests import RequestTable, Waiting, WaitPhase
from kvpush.errors import IncompatiblePeerError
from kvpush.peers.handshakes import PeerConn, PeerKey
from kvpush.peers.tp import check_ratio, sources
from kvpush.peers.vllm_peer import PeerHint
from kvpush.runtime.context import EndpointContext
from kvpush.runtime.inbox import Inbox
from kvpush.runtime.owner import OwnerThread
from kvpush.telemetry.names import Failure

log = logging.getLogger(__name__)

#: What the receiver's ``ready`` inbox carries: a request whose handshake ended, and its error.
Ready = tuple[Waiting, BaseException | None]


class Sources:
    def __init__(
        self,
        ctx: EndpointContext,
        table: RequestTable,
        out: Outcomes,
        peers: PrefillPeers,
        owner: OwnerThread,
        ready: Inbox[Ready],
    ) -> None:
        self._ctx = ctx
        self._table = table
        self._out = out
        self._peers = peers
        self._owner = owner
        self._ready = ready

    def connect(self, w: Waiting) -> bool:
        """True when every P rank the request draws from is connected, all at P's TP size (the
        receiver registers it then); False while a handshake is under way, or when the request
        failed.

        Re-entered after each handshake this request waited for; every step is idempotent.
        P's TP size comes from the request, from an earlier handshake with that P, or from P's
        rank 0 (which this D rank's rank-0 sibling draws from anyway)."""
        while True:
            if not w.ranks.sources and not self._learn_sources(w):
                return False  # waiting for the handshake, or failed
            if not self._connect_sources(w):
                return False  # waiting for a handshake, or failed
            ranks = w.ranks
            stale = [s for s, c in ranks.conns.items() if c.metadata.tp_size != ranks.p_tp]
            if not stale:
                self._ctx.peer_tp[ranks.addr] = ranks.p_tp
                return True
            if not self._relearn_tp(w, stale):
                return False  # failed
            # P's size re-learnt: start over

    def _learn_sources(self, w: Waiting) -> bool:
        """Learn P's TP size and so the P ranks that write into this D rank; False while the
        handshake that tells it is under way, or when the request failed."""
        ranks = w.ranks
        tp = ranks.p_tp
        if not tp:
            tp = self._ctx.peer_tp.get(ranks.addr, 0)
            ranks.tp_cached = bool(tp)
        if not tp:
            conn = self._conn_or_wait(w, ranks.key(0))
            if conn is None:
                return False
            tp = conn.metadata.tp_size
            ranks.conns.setdefault(0, conn)
        try:
            check_ratio(tp, self._ctx.cfg.tp_size, ranks.addr)
        except IncompatiblePeerError as e:
            self._out.fail(w, Failure.INCOMPATIBLE, str(e))
            return False
        ranks.p_tp = tp
        ranks.sources = sources(self._ctx.cfg.tp_rank, self._ctx.cfg.tp_size, tp)
        for s in list(ranks.conns):
            if s not in ranks.sources:
                del ranks.conns[s]  # the discovery connection to rank 0 is not a source
        if 0 not in ranks.sources:
            self._forget_discovery(w, tp)
        return True

    def _connect_sources(self, w: Waiting) -> bool:
        """A connection to every source rank; False while one is under way, or when the
        request failed.

        A TP size the request claims (vLLM's remote_tp_size) is not trusted: P's ranks are
        asked one at a time, the first one's answer is checked against the claim, and the
        first rank that is not served ends the request (no handshake, no row, per claimed
        rank; a vLLM listener dies on a rank it does not serve)."""
        ranks = w.ranks
        waiting = False
        claimed = bool(w.req.p_engine_id)
        for s in ranks.sources:
            if s in ranks.conns:
                continue
            conn = self._conn_or_wait(w, ranks.key(s), attach=not waiting)
            if conn is None:
                if w.phase is WaitPhase.ENDED:
                    return False
                waiting = True
                if claimed:
                    break
                continue
            if claimed and conn.metadata.tp_size != ranks.p_tp:
                self._out.fail(
                    w,
                    Failure.INCOMPATIBLE,
                    f"{format_address(*ranks.addr)} has {conn.metadata.tp_size} TP "
                    f"rank(s), the request claims {ranks.p_tp} (remote_tp_size)",
                )
                return False
            ranks.conns[s] = conn
        return not waiting

    def _forget_discovery(self, w: Waiting, tp: int) -> None:
        """A handshake with P's rank 0, when this D rank draws nothing from it, only told P's
        TP size: keep the size, drop the connection (no peer row stands for it, nothing
        outlives that P). One still connecting is dropped by the request that waits on it, when
        it comes back here; requests that waited on the same handshake find the size."""
        self._ctx.peer_tp[w.ranks.addr] = tp
        conn = self._ctx.handshakes.forget(w.ranks.key(0))
        if conn is not None:
            self._ctx.handshakes.release_conn(conn)

    def _relearn_tp(self, w: Waiting, stale: list[int]) -> bool:
        """P answered at another TP size than the request assumed (it restarted at another
        one): the newest connection tells P's size now; the connections of another size (an
        older incarnation's) are forgotten and the request starts over (True) -- at most
        twice; False when the request failed."""
        ranks = w.ranks
        assumed = ranks.p_tp
        newest = max(ranks.conns.values(), key=lambda c: c.connected_at)
        got = newest.metadata.tp_size
        # A vLLM router names P's TP size in the request (kv_transfer_params): that stands.
        given = self._ctx.dialect.kv_transfer_params and not ranks.tp_cached
        if w.registered or ranks.relearns >= 2 or (given and got != assumed):
            other = ranks.conns[stale[0]].metadata.tp_size
            self._out.fail(
                w, Failure.INCOMPATIBLE, f"P's TP size changed from {assumed} to {other}"
            )
            return False
        ranks.relearns += 1
        if got != assumed:
            log.info(
                "P %s is at TP %d now (was %d): re-learnt",
                format_address(*ranks.addr),
                got,
                assumed,
            )
        self._ctx.peer_tp[ranks.addr] = got
        rid = w.req.request_id
        for s, c in list(ranks.conns.items()):
            if c.metadata.tp_size != got:
                del ranks.conns[s]
                if not c.evicted:
                    self._peers.evict(ranks.key(s), "P's TP size changed", keep=rid)
        ranks.p_tp, ranks.sources, ranks.tp_cached = got, (), False
        return True

    def relearn_after_failure(self, w: Waiting) -> bool:
        """A handshake to a P rank failed while the request assumed P's TP size from an earlier
        request: P may have restarted with fewer ranks; learn its size afresh from rank 0,
        once (True: the caller connects the request again). A connection to rank 0 that still
        claims the failed size is an older incarnation's: it is forgotten first. False when
        that does not apply."""
        ranks = w.ranks
        if not ranks.tp_cached or ranks.relearns >= 2 or w.registered:
            return False
        ranks.relearns += 1
        failed = ranks.p_tp
        self._ctx.peer_tp.pop(ranks.addr, None)
        conn0 = self._ctx.handshakes.get(ranks.key(0))
        if conn0 is not None and conn0.metadata.tp_size == failed:
            self._peers.evict(ranks.key(0), "stale: P's TP size changed", keep=w.req.request_id)
        ranks.p_tp, ranks.sources, ranks.tp_cached = 0, (), False
        ranks.conns.clear()
        return True

    def _conn_or_wait(self, w: Waiting, key: PeerKey, attach: bool = True) -> PeerConn | None:
        """The connection to ``key``, or None: a handshake is under way (the request comes back
        through ``ready`` when it ends, if ``attach``) or it failed (the request is failed)."""
        req = w.req
        conn = self._ctx.handshakes.get(key)
        if conn is not None and req.p_engine_id and conn.metadata.engine_id != req.p_engine_id:
            # The router names another engine at this address (vLLM's kv_transfer_params): P
            # restarted there. Its old agent goes before anything is sent (vLLM PR #50047).
            self._peers.evict(key, "P restarted: another engine id", keep=req.request_id)
            conn = None
        mode = self._ctx.cfg.handshake_mode
        if conn is None or (mode == HandshakeMode.FULL and conn.mode != HandshakeMode.FULL):
            hint = PeerHint(req.p_engine_id, req.p_tp_size, role=Role.PREFILL)
            fut = self._ctx.handshakes.ensure(key, mode, hint)
            if fut is not None:
                self._table.move(w, WaitPhase.HANDSHAKING)
                if attach:
                    fut.add_done_callback(lambda f: self._handshake_done(w, f))
                return None
            conn = self._ctx.handshakes.get(key)
        if conn is None:
            self._out.fail(w, Failure.HANDSHAKE_FAILED, "P not connected after handshake")
        return conn

    def _handshake_done(self, w: Waiting, fut: Future[PeerConn]) -> None:
        """Runs on the handshake thread: hand the request back; never lose it."""
        try:
            item = (w, fut.exception())
        except BaseException as e:
            item = (w, e)
        self._owner.hand_off(
            self._ready,
            item,
            lambda e: self._out.fail(w, Failure.CALLBACK_ERROR, repr(e)),
        )

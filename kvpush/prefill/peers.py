"""P's view of the D ranks it writes to: the connection a leg is written on, and a D rank that is
gone, idle, down or restarted.

``connection`` is the full connection to the D incarnation that registered, or the handshake's
future while one runs. The one incarnation check is ``heard_from`` (a PUSH_REG's and a Cancel's):
a PUSH_REG whose incarnation died since fails its push (``stale_registration``); a D restarted at
the same address is evicted before its new incarnation is connected (``peer_restarted``).
``evict`` forgets a D rank: its legs in flight fail, or -- a peer evicted for transport errors,
which may still be alive -- are abandoned as bytes that may still land while its fences stay
owed; its connection is released. ``forget`` evicts every rank of a D proven gone;
``housekeeping`` the idle ones (once a second) and those the peer watch found down.

Thread: the writer's owner thread (``PushWriter`` calls it). It calls ``Legs``, ``Fences`` and
``Outcomes`` (the writer's other collaborators), never back up into the writer.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from kvpush.config import HandshakeMode, Role
from kvpush.peers.handshakes import PeerConn, PeerGone, PeerKey
from kvpush.peers.vllm_peer import PeerHint
from kvpush.prefill.context import WriterContext
from kvpush.prefill.fences import Fences
from kvpush.prefill.legs import Legs
from kvpush.prefill.outcomes import Outcomes
from kvpush.prefill.table import Push, Registration
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol


class DecodePeers:
    def __init__(self, ctx: WriterContext, out: Outcomes, legs: Legs, fences: Fences) -> None:
        self._ctx = ctx
        self._out = out
        self._legs = legs
        self._fences = fences
        self._next_idle = 0.0

    def connections(self, push: Push) -> dict[int, PeerConn] | Future[PeerConn] | None:
        """The full connection to each target D rank of ``push``, by D rank; the first pending
        handshake's future while any runs (each target's handshake is started); None when
        the push failed (D told)."""
        conns: dict[int, PeerConn] = {}
        pending: Future[PeerConn] | None = None
        for r in push.registrations:
            got = self.connection(push, r)
            if got is None:
                return None
            if isinstance(got, Future):
                pending = pending or got
            else:
                conns[r.reg.decode_tp_rank] = got
        return pending if pending is not None else conns

    def connection(
        self, push: Push, r: Registration, again: bool = False
    ) -> PeerConn | Future[PeerConn] | None:
        """The full connection ``r``'s leg is written on, of the incarnation that registered;
        the handshake's future while it runs; None when the push failed (D told)."""
        key = r.peer
        conn = self._ctx.handshakes.get(key)
        if again and (conn is None or conn.remote_dlist is None):
            # The handshake said connected, yet there is no full connection.
            self._out.fail(push, Failure.HANDSHAKE_FAILED, "peer not connected")
            return None
        if not self.heard_from(key, r.reg.decode_incarnation, r.t_arrived, again):
            # Writing would hit blocks that belong to someone else now.
            self._out.fail(push, Failure.STALE_REGISTRATION, "D restarted after this PUSH_REG")
            return None
        conn = self._ctx.handshakes.get(key)  # (None when an older incarnation was just dropped)
        if conn is not None and conn.remote_dlist is not None:
            return conn
        hint = PeerHint(r.reg.decode_engine_id, r.reg.decode_tp_size, role=Role.DECODE)
        fut = self._ctx.handshakes.ensure(key, HandshakeMode.FULL, hint)
        return fut if fut is not None else self.connection(push, r, again=True)

    def heard_from(
        self, key: PeerKey, incarnation: str, t_arrived: float, connected_since: bool = False
    ) -> bool:
        """The one incarnation check, for a message (a PUSH_REG, a Cancel) from D rank ``key``'s
        ``incarnation`` that arrived at ``t_arrived``. False when it comes from an incarnation
        that has since died: P connected to another one at that address after it arrived
        (``connected_since``: P just did); evicting the live one would fail its pushes. True
        otherwise -- P holds that incarnation, none, or (D restarted at the same address) an
        older one, which is evicted first (``peer_restarted``). A message naming no
        incarnation (an older kvpush D, vLLM) matches any."""
        conn = self._ctx.handshakes.get(key)
        if conn is None or not incarnation or conn.metadata.incarnation == incarnation:
            return True
        if connected_since or conn.connected_at > time.time() - (time.monotonic() - t_arrived):
            return False
        self.evict(key, f"new incarnation {incarnation}", Failure.PEER_RESTARTED)
        return True

    def cancelled(self, msg: protocol.Cancel) -> None:
        """A Cancel from the D rank it names: the incarnation check, before P acknowledges."""
        if msg.decode_port:
            key = (msg.decode_host, msg.decode_port, msg.decode_tp_rank)
            self.heard_from(key, msg.decode_incarnation, time.monotonic())

    def forget(self, g: PeerGone) -> None:
        """A D proven gone or replaced: evict every rank of it (its legs fail with ``g.reason``)."""
        for key in self._ctx.handshakes.gone(g):
            self.evict(key, g.detail, g.reason)

    def evict(self, key: PeerKey, reason: str, failure: Failure | bool = Failure.PEER_DEAD) -> None:
        """Forget a peer. ``failure`` is what its legs in flight fail with, or True for a
        peer evicted for transport errors that may still be alive: its legs are abandoned as
        bytes that may still land, and its fences stay owed (sent once connected again)."""
        conn = self._ctx.handshakes.evict(key, reason)
        if failure is True:
            self._legs.peer_unhealthy(key, reason)
        else:
            self._legs.peer_gone(key, reason, failure or Failure.PEER_DEAD)
            self._fences.forget_peer(key)
            self._out.acks.forget(key, conn)
        if conn is not None:
            self._ctx.handshakes.release_conn(conn)

    def housekeeping(self, now: float) -> None:
        """Evict idle peers (a pass over the peer rows once a second) and peers found down."""
        if now >= self._next_idle:
            self._next_idle = now + 1.0
            idle = self._ctx.handshakes.idle(self._ctx.cfg.timeouts.peer_idle_ttl_s)
            busy = self._ctx.table.peers_in_flight() if idle else set()
            for key in idle:
                if key not in busy:
                    self.evict(key, "idle")
        for key, why in self._ctx.handshakes.down():  # its process is gone (kvpush.peers.watch)
            self.evict(key, f"down: {why}")

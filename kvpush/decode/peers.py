"""D's view of the P ranks its requests draw on: heartbeats, a P that is gone, a P that stopped.

Heartbeats renew P's leases of the requests D waits for and, sent to a P rank that only holds
abandoned requests' blocks, check that it is alive. A P rank that is gone (a heartbeat or a
PUSH_REG found it disconnected, it restarted, or it sat idle) is evicted: the requests it was
to write fail with ``prefill_dead`` (its other ranks are told to drop them) and what it left
quarantined is settled. A P rank that said it stopped (its drain is over) ends what still
draws on it with its reason at once, and is evicted too.

Thread: the receiver's owner thread (``Receiver`` calls it).
"""

from __future__ import annotations

from kvpush.decode.outcomes import Outcomes
from kvpush.decode.requests import RequestTable
from kvpush.peers.handshakes import PeerGone, PeerKey
from kvpush.runtime.context import EndpointContext
from kvpush.telemetry.names import Counter, Failure
from kvpush.transport.agent import TransferError
from kvpush.wire import protocol

HEARTBEAT_BATCH = 4096  # transfer ids per Heartbeat notification


class PrefillPeers:
    def __init__(self, ctx: EndpointContext, table: RequestTable, out: Outcomes) -> None:
        self._ctx = ctx
        self._table = table
        self._out = out

    def stopped(self, sender: str, msg: protocol.Failure) -> None:
        """A P rank said it stopped (its drain is over: it writes nothing more): every request
        still waiting on it ends now with P's reason, not when a heartbeat finds it gone."""
        conn = self._ctx.handshakes.by_agent(sender)
        if conn is None:
            return  # not a P this D knows: nothing draws on it
        reason = Failure.parse(msg.reason) or Failure.PREFILL_FAILED
        rank = conn.key[2]
        waiting, _ = self._table.of_peer(conn.key)
        for r in waiting:
            self._out.fail(r, reason, msg.detail or str(reason), settled={rank}, told={rank})
        # Its connection is of no use any more: the next request to that address handshakes
        # afresh (and finds P unreachable, or a new P there).
        self.evict(conn.key, f"P stopped: {msg.reason}")

    def forget(self, g: PeerGone) -> None:
        """A P proven gone or replaced (a registry hint, checked: ``kvpush.fleet.suspects``):
        drop every rank of it this D holds."""
        for key in self._ctx.handshakes.gone(g):
            self.evict(key, g.detail, why=g.reason)

    def heartbeat(self) -> None:
        # An abandoned request whose P rank's connection is gone (evicted on a path that did
        # not come through ``evict``, e.g. a restart found at a handshake) waits on a fence
        # that cannot come: settle it as ``evict`` would (no block quarantined on a peer that
        # can never fence it).
        for ab, rank in self._table.held_by_gone():
            if rank in ab.outstanding:  # a request of two gone ranks is released once
                self._out.settle_abandoned(ab, rank, "P connection gone")
        for conn, tids in self._table.heartbeat_groups():
            for i in range(0, max(len(tids), 1), HEARTBEAT_BATCH):
                try:
                    self._ctx.agent.send_notif(
                        conn.agent_name,
                        self._ctx.codec.encode(
                            protocol.Heartbeat(transfer_ids=tids[i : i + HEARTBEAT_BATCH])
                        ),
                    )
                    self._ctx.telemetry.inc(Counter.HEARTBEATS_SENT)
                    self._ctx.handshakes.transport_ok(conn.key)
                except TransferError as e:
                    if not conn.evicted and self._ctx.handshakes.transport_error(conn.key, e):
                        self.evict(conn.key, f"heartbeat failed: {e.status}")
                        break

    def evict(
        self, key: PeerKey, reason: str, keep: str = "", why: Failure = Failure.PREFILL_DEAD
    ) -> None:
        """A P rank is gone (or restarted): fail the requests it writes for with ``why`` (the
        other ranks are told to drop them), settle what it left quarantined."""
        conn = self._ctx.handshakes.evict(key, reason)
        rank = key[2]
        waiting, abandoned = self._table.of_peer(key)
        for w in waiting:
            if rank in w.registered and w.req.request_id != keep:
                w.ranks.conns.pop(rank, None)
                self._out.fail(w, why, reason, settled={rank})
        for ab in abandoned:
            self._out.settle_abandoned(ab, rank, "P removed")
        if conn is not None:
            self._ctx.handshakes.release_conn(conn)

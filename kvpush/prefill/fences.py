"""Fences: how P frees blocks of WRITEs it abandoned while their bytes may still be moving.

Releasing an in-flight NIXL transfer does not stop its bytes (DESIGN.md section 3). So an
abandoned WRITE quarantines P's blocks and tells D ``may_have_written``; D quarantines its blocks
too. A *fence* -- a one-block WRITE with a ``Fence`` notification to the same peer, which
completes only after every earlier WRITE to that peer has landed -- then frees both sides: P's
blocks when the fence WRITE completes, D's when the fence notification arrives.

``Fences`` keeps the entries waiting for a fence per peer and posts one fence per peer from the
writer's housekeeping; a fence that times out (peer frozen) puts its entries back to fence again
later, a fence to a dead peer releases them (nothing can land any more). Runs on the writer
thread only.
"""

from __future__ import annotations

import logging
import time

from kvpush.config import HandshakeMode
from kvpush.peers.handshakes import PeerKey
from kvpush.peers.state import peer_name
from kvpush.prefill.context import WriterContext
from kvpush.prefill.plan import fence_plan
from kvpush.prefill.table import FenceEntry, FenceWrite, Leg
from kvpush.ratelog import RateLimitedLog
from kvpush.telemetry.names import Counter, Failure
from kvpush.transport.agent import XFER_DONE, DList, TransferError
from kvpush.wire import protocol

log = logging.getLogger(__name__)

MAX_PER_FENCE = 4096  # one Fence notification names at most this many requests


def entry_of(leg: Leg) -> FenceEntry:
    """What a fence of ``leg``'s abandoned WRITE covers: one of its D blocks, of the D
    incarnation it went to."""
    reg = leg.registration.reg
    d_block = int(reg.local_block_ids[0][0])
    return FenceEntry(leg.push.key, d_block, reg.request_id, leg.conn.metadata.incarnation)


class Fences:
    def __init__(self, ctx: WriterContext) -> None:
        self._ctx = ctx
        self._timeout_s = ctx.cfg.timeouts.fence_s
        self._pending: dict[PeerKey, list[FenceEntry]] = {}
        self._reconnect_at: dict[PeerKey, float] = {}  # next handshake for owed fences
        self._seq = 0
        self._rl = RateLimitedLog(log)

    def add(self, peer: PeerKey, entry: FenceEntry) -> None:
        self._pending.setdefault(peer, []).append(entry)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def forget_peer(self, peer: PeerKey) -> None:
        """The peer is gone: nothing can land any more, its quarantined blocks are free."""
        self._reconnect_at.pop(peer, None)
        for e in self._pending.pop(peer, []):
            self._ctx.pool.allocator.release_quarantined(e.key)

    def completed(self, fw: FenceWrite) -> None:
        for e in fw.entries:
            self._ctx.pool.allocator.release_quarantined(e.key)
        self._ctx.telemetry.inc(Counter.FENCES_OK)

    def failed(self, fw: FenceWrite, peer_dead: bool) -> None:
        self._ctx.telemetry.fail(Failure.FENCE_FAILED)
        if peer_dead:  # nothing can land any more
            for e in fw.entries:
                self._ctx.pool.allocator.release_quarantined(e.key)
        else:  # peer stalled (e.g. frozen): fence again later; blocks stay quarantined
            self._pending.setdefault(fw.conn.key, []).extend(fw.entries)

    def _drop_replaced(
        self, peer: PeerKey, entries: list[FenceEntry], incarnation: str
    ) -> list[FenceEntry]:
        """The entries whose D incarnation is the one now connected at ``peer``; the others'
        incarnation was replaced at that address (a new one answered P's handshake there):
        nothing of theirs can land any more, so their blocks are free -- and a fence must never
        carry them, for it would write onto a block the new incarnation may have given to
        another request."""
        keep = [e for e in entries if not e.incarnation or e.incarnation == incarnation]
        if len(keep) < len(entries):
            for e in entries:
                if e.incarnation and e.incarnation != incarnation:
                    self._ctx.pool.allocator.release_quarantined(e.key)
            log.info(
                "fences: %d owed to a replaced incarnation of %s dropped (nothing can land)",
                len(entries) - len(keep),
                peer_name(peer),
            )
            if keep:
                self._pending[peer] = keep
            else:
                del self._pending[peer]
        return keep

    def send(self, local_dlist: DList) -> list[FenceWrite]:
        """Post one fence per peer with pending entries; return those already DONE at post."""
        done: list[FenceWrite] = []
        for peer, entries in list(self._pending.items()):
            conn = self._ctx.handshakes.get(peer)
            if conn is None or conn.remote_dlist is None:
                # Reconnecting, or evicted for transport errors while fences are owed: connect
                # again (a peer that is really gone fails its handshake and is evicted for good
                # once idle, which releases the blocks).
                now = time.monotonic()
                if now >= self._reconnect_at.get(peer, 0.0):
                    self._reconnect_at[peer] = now + self._timeout_s
                    self._ctx.handshakes.ensure(peer, HandshakeMode.FULL)
                continue
            entries = self._drop_replaced(peer, entries, conn.metadata.incarnation)
            if not entries:
                continue
            del self._pending[peer]
            if len(entries) > MAX_PER_FENCE:
                self._pending[peer] = entries[MAX_PER_FENCE:]
                entries = entries[:MAX_PER_FENCE]
            # Write one of P's quarantined blocks onto one of D's blocks of the same abandoned
            # request: D keeps those quarantined until this very fence lands. The source only
            # needs to be readable: P's own block 0 when the abandoned blocks are gone.
            src, remote_block = 0, entries[0].d_block
            for e in entries:
                held = self._ctx.pool.allocator.blocks_of(e.key)
                if len(held):
                    src, remote_block = int(held[0]), e.d_block
                    break
            self._seq += 1
            fence_id = f"fence-{self._seq}"
            plan = fence_plan(src, remote_block, conn.metadata, self._ctx.geom)
            notif = self._ctx.codec.encode(
                protocol.Fence(fence_id=fence_id, request_ids=[e.d_request_id for e in entries])
            )
            try:
                xfer, st = self._ctx.agent.post_write(
                    local_dlist, plan.local_idx, conn.remote_dlist, plan.remote_idx, notif
                )
            except TransferError as e:
                self._rl.warning("fence", "fence to %s failed to post: %s", conn.address, e)
                self._pending.setdefault(peer, []).extend(entries)
                continue
            t = time.monotonic()
            fw = FenceWrite(fence_id, xfer, conn, t, t + self._timeout_s, plan.nbytes, entries)
            self._ctx.table.fence_posted(fw)
            self._ctx.telemetry.inc(Counter.FENCES_SENT)
            if st == XFER_DONE:
                done.append(fw)
        return done

"""What P tells D, and D's cancels: one place for every Failure notification P sends.

``fail`` is the one path of a push that will not complete: it counts the reason, logs it
(rate-limited), quarantines or frees P's blocks and sends D a ``Failure`` naming the reason (the
closed set ``kvpush.telemetry.names.Failure``) with the detail beside it. ``on_cancel`` handles
D's ``Cancel`` of a registered transfer and acknowledges it once nothing can be written any more.
Runs on the writer thread; handshake callbacks hand their work back through the tasks inbox.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvpush.address import format_address
from kvpush.config import Role
from kvpush.peers.handshakes import PeerConn
from kvpush.prefill.acks import OwedAcks
from kvpush.prefill.context import WriterContext
from kvpush.prefill.events import EvictPeer
from kvpush.prefill.limits import MAX_DECLINED_IDS
from kvpush.prefill.table import (
    AwaitingHandshake,
    CancelledEarly,
    Leg,
    Push,
    PushOutcome,
    Registered,
    Registration,
    Waiting,
    Writing,
)
from kvpush.ratelog import RateLimitedLog
from kvpush.runtime.decline import Decliner
from kvpush.runtime.inbox import Inbox
from kvpush.runtime.owner import OwnerThread
from kvpush.telemetry.names import Counter, Failure
from kvpush.transport.agent import GONE, TransferError
from kvpush.wire import protocol

log = logging.getLogger(__name__)

MAX_EARLY_CANCELS = MAX_DECLINED_IDS
#: Back-off step between handshakes for owed cancel acknowledgements (x attempt).
ACK_RETRY_S = 1.0


class Outcomes:
    def __init__(
        self,
        ctx: WriterContext,
        owner: OwnerThread,
        tasks: Inbox[Callable[[], None]],
        decliner: Decliner | None = None,
    ) -> None:
        self._ctx = ctx
        self._codec = ctx.codec
        self._decliner = decliner
        self._rl = RateLimitedLog(log)
        # A cancel acknowledged once its handshake is up comes back through ``tasks``.
        self.acks = OwedAcks(ctx, owner, tasks, self.notify, ACK_RETRY_S)
        # Peers a failed notification said to evict, with the connection it failed on: the
        # writer evicts them after its pass (``take_evictions``), not in the middle of it.
        self._evictions: list[tuple[PeerConn, EvictPeer]] = []

    def fail(self, push: Push, reason: Failure, detail: str) -> None:
        """A push that fails before any of its WRITEs was posted: every target D rank is told,
        P's blocks go back (nothing can have moved)."""
        st = self._ctx.table.get(push.key)
        if isinstance(st, AwaitingHandshake) and st.push.finished is push.finished:
            self._ctx.table.pop(push.key)
        self._ctx.telemetry.fail(reason)
        self._rl.warning(str(reason), "push %s failed (%s): %s", push.key, reason, detail)
        for r in push.registrations:
            self.tell(r, None, reason, detail, may_have_written=False)
        self.settle(push, reason, detail, quarantine=False)

    def fail_leg(self, leg: Leg, reason: Failure, detail: str, may_have_written: bool) -> None:
        """One WRITE of a push will not complete normally: its D rank is told; the push's
        blocks are settled when its last leg ends (``settle``)."""
        self._ctx.telemetry.fail(reason)
        self._rl.warning(str(reason), "push %s failed (%s): %s", leg.push.key, reason, detail)
        leg.writing.failed[leg.d_rank] = (reason, may_have_written)
        self.tell(leg.registration, leg.conn, reason, detail, may_have_written)

    def settle(self, push: Push, reason: str, detail: str, *, quarantine: bool) -> None:
        """A failed push is over: count it once, report it, quarantine or free its blocks."""
        self._ctx.telemetry.inc(Counter.PUSHES_FAILED)
        self._ctx.report(
            PushOutcome(push.finished.transfer_id, False, reason, detail, peer=push.peer)
        )
        if quarantine:
            self._ctx.pool.allocator.quarantine(push.key, reason)
        else:
            self._ctx.pool.allocator.release(push.key)

    def tell(
        self,
        r: Registration,
        conn: PeerConn | None,
        reason: Failure,
        detail: str,
        may_have_written: bool,
    ) -> None:
        conn = conn or self._ctx.handshakes.get(r.peer)
        told = conn is not None and self._notify_failure(
            conn, r, reason, detail[:1000], may_have_written
        )
        if not told and conn is not None and not may_have_written:
            # The transport to D is gone (the notification failed too): tell D over its side
            # channel, so it fails the request now, not at its deadline. Only when nothing was
            # written: a decline frees D's blocks at once.
            self.decline(r, reason, detail)

    def notify(self, conn: PeerConn, msg: protocol.Notif) -> bool:
        """Send ``msg`` if this wire has a form for it (vLLM's has no failures or cancels)."""
        if not self._codec.carries(msg):
            return False
        try:
            self._ctx.agent.send_notif(conn.agent_name, self._codec.encode(msg))
            return True
        except TransferError as e:
            self._rl.warning("notify", "notification to %s failed: %s", conn.address, e)
            if not conn.evicted and self._ctx.handshakes.transport_error(conn.key, e):
                # NIXL said its agent is gone (or errors piled up): evicted after this pass.
                soft = e.kind not in GONE
                reason = f"notification failed: {e.status}"
                self._evictions.append((conn, EvictPeer(conn.key, reason, soft)))
            return False

    def take_evictions(self) -> Sequence[EvictPeer]:
        """The peers failed notifications said to evict since the last call whose connection
        is still the one that failed (a newer one at that key is not evicted)."""
        if not self._evictions:
            return ()  # the writer asks after every pass: nothing allocated when none is due
        out, self._evictions = self._evictions, []
        hs = self._ctx.handshakes
        return [ev for conn, ev in out if not conn.evicted and hs.get(ev.key) is conn]

    def stopping(self, reason: Failure, detail: str) -> None:
        """This P rank writes nothing more: a request-less ``Failure`` to every connected D
        (kvpush's wire only; vLLM's has no such form and sees P's agent go)."""
        note = protocol.Failure(request_id="", transfer_id="", reason=reason, detail=detail)
        for conn in self._ctx.handshakes.connected():
            self.notify(conn, note)

    def refuse_registration(self, r: Registration, reason: Failure, detail: str) -> None:
        """Tell D (when connected) that a registration that never met its blocks is dropped;
        nothing was written, so D can free its blocks at once."""
        conn = self._ctx.handshakes.get(r.peer)
        told = conn is not None and self._notify_failure(conn, r, reason, detail, False)
        if not told:
            self.decline(r, reason, detail)

    def _notify_failure(
        self, conn: PeerConn, r: Registration, reason: Failure, detail: str, may_have_written: bool
    ) -> bool:
        """Tell ``r``'s D rank over NIXL that its request failed; False when not sent."""
        note = protocol.Failure(
            request_id=r.reg.request_id,
            transfer_id=r.reg.transfer_id,
            reason=reason,
            detail=detail,
            may_have_written=may_have_written,
        )
        return self.notify(conn, note)

    def decline(self, r: Registration, reason: str, detail: str) -> None:
        """Tell a registration's D over its side channel (no NIXL connection needed) that P
        will not serve it, so D fails the request at once instead of at its deadline."""
        if self._decliner is None:
            return
        reg = r.reg
        self._decliner.decline(
            format_address(reg.decode_host, reg.decode_port),
            protocol.DeclineReq(
                transfer_id=reg.transfer_id or reg.request_id,
                request_id=reg.request_id,
                reason=reason,
                detail=detail[:1000],
                origin=Role.PREFILL,
            ),
        )

    # ------------------------------------------------------------------ cancels
    def on_cancel(self, msg: protocol.Cancel, sender: str) -> None:
        """D abandoned a request after its PUSH_REG. Drop it; if no byte can land any more,
        acknowledge with Failure(cancelled, may_have_written=False) so D frees its blocks; if a
        WRITE is in flight, its own completion notification tells D when the bytes landed.

        Only the agent that sent the registration may cancel it (a PUSH_REG always precedes its
        Cancel on the same connection): a Cancel from anyone else is counted as forged."""
        key = msg.transfer_id or msg.request_id
        st = self._ctx.table.get(key)
        owners = self._ctx.table.senders(key)
        if (owners and sender not in owners) or (not owners and isinstance(st, Waiting)):
            # Not its D, or blocks waiting that nobody registered.
            self._ctx.telemetry.fail(Failure.FORGED_NOTIF)
            self._rl.warning("forged", "ignored a Cancel for %s from %s (not its D)", key, sender)
            return
        if isinstance(st, Waiting):
            # Some of its D ranks registered, P's blocks are here, nothing was written yet.
            self._ctx.table.pop(key)
            self._ctx.pool.allocator.release(key)
            self._ctx.report(
                PushOutcome(st.finished.transfer_id, False, Failure.CANCELLED, "cancelled by D")
            )
            self.ack_cancel(msg, sender)
        elif isinstance(st, Registered):
            # P has not finished its blocks yet: free them when they do, instead of holding
            # them until their lease lapses (a burst of aborts exhausted P).
            if self._ctx.table.count(CancelledEarly) < MAX_EARLY_CANCELS:
                self._ctx.table.cancel_early(key, time.monotonic())
            else:
                self._ctx.table.pop(key)
            self.ack_cancel(msg, sender)
        elif isinstance(st, AwaitingHandshake):
            st.cancelled = True  # dropped (and acknowledged) when its handshake returns
        elif isinstance(st, Writing):
            return  # the WRITE's own completion notification tells D when bytes landed
        else:
            # Unknown here (finished already, or never seen): nothing will be written for it.
            self.ack_cancel(msg, sender)

    def ack_cancel(self, msg: protocol.Cancel, sender: str) -> None:
        """Tell D that nothing was (or will be) written for a cancelled request. Without a
        connection to D yet, handshake to the address the Cancel carries -- in the background,
        like a push -- and acknowledge from this thread once it is up."""
        ack = protocol.Failure(
            request_id=msg.request_id,
            transfer_id=msg.transfer_id,
            reason=Failure.CANCELLED,
            detail="cancel acknowledged; nothing was written",
            may_have_written=False,
        )
        conn = self._ctx.handshakes.by_agent(sender)
        if conn is not None:
            self.notify(conn, ack)
            return
        if not msg.decode_port:
            self._ctx.telemetry.fail(Failure.CANCEL_UNACKNOWLEDGED)
            return
        # Owed until a connection is up: handshakes again if one fails (kvpush.prefill.acks).
        self.acks.add((msg.decode_host, msg.decode_port, msg.decode_tp_rank), ack, sender)

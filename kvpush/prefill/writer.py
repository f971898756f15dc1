"""P's push writer: the role loop that owns WRITE submission, on the endpoint's ``OwnerThread``.

Wake model. The owner thread sleeps on one event shared by the writer's inboxes: *finished* (P's
blocks are ready), *deferred* (pushes whose P->D handshake completed) and *tasks* (small jobs
other threads hand over, e.g. a cancel acknowledgement once its handshake is up). Each pass
drains them, polls NIXL notifications (PUSH_REG, heartbeat, cancel, ping), polls each peer's
in-flight WRITEs oldest first up to the first still in progress and, every few milliseconds,
polls every in-flight WRITE, expires leases and deadlines and sends fences. It spins while WRITEs
are in flight and backs off when idle: with NIXL's progress thread off, this polling *is* progress.
Pushes matched in a pass are posted at its end, one WRITE per D rank (``kvpush.prefill.coalesce``).

Never blocking on the network. When the P->D handshake is not ready, the handshake-wait strategy
(``kvpush.prefill.strategy``) parks the push and returns; ``Instruments.writer`` waits instead, for
comparison only. A transfer's whole state is one typed entry of the ``PushTable``. This module
decides *what* to write and when (matching, TP ranks, which WRITEs to poll when, shutdown); posting
the WRITEs, polling one and ending each exactly once is ``kvpush.prefill.legs``; which D ranks a
PUSH_REG stands for is ``kvpush.prefill.ranks``; the connection each leg is written on (handshakes,
the one incarnation check) and evicting a D rank is ``kvpush.prefill.peers``; transfers declined
before they are written are ``kvpush.prefill.declines``; which lane carries each D's KV is
``kvpush.prefill.lanestats``. The writer is handed its rank's ``EndpointContext``; it and its
collaborators (``Outcomes``, ``Fences``, ``Legs``, ``DecodePeers``, ``Declines``) share one
``WriterContext`` built from it (``kvpush.prefill.context``), and they never call back up: what the
writer must act on (a peer to evict, blocks to wait again) comes back as an event
(``kvpush.prefill.events``) that ``_dispatch`` acts on.

Every failure goes through ``Outcomes.fail`` (``kvpush.prefill.outcomes``: count, rate-limited log,
Failure notification to D, blocks released or quarantined). P's blocks return to the pool when
their WRITE completes or their lease lapses. A WRITE abandoned while its bytes may still be moving
quarantines P's blocks and tells D ``may_have_written``; a fence (``kvpush.prefill.fences``) then
frees both sides.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from kvpush.config import Role
from kvpush.instruments import WriterMode
from kvpush.peers.handshakes import PeerGone
from kvpush.peers.validation import handshake_failure
from kvpush.prefill.context import WriterContext
from kvpush.prefill.declines import Declines
from kvpush.prefill.events import Event, EvictPeer
from kvpush.prefill.fences import Fences
from kvpush.prefill.lanestats import PeerLanes
from kvpush.prefill.legs import Legs
from kvpush.prefill.limits import MAX_PENDING_REGISTRATIONS
from kvpush.prefill.outcomes import Outcomes
from kvpush.prefill.peers import DecodePeers
from kvpush.prefill.ranks import RankRouter, Refused
from kvpush.prefill.strategy import BlockingWait, Deferred, DeferredWait, HandshakeWait
from kvpush.prefill.table import (
    AwaitingHandshake,
    CancelledEarly,
    DuplicateError,
    Finished,
    Push,
    PushOutcome,
    PushTable,
    Registered,
    Registration,
    Waiting,
    Writing,
)
from kvpush.ratelog import RateLimitedLog
from kvpush.runtime.context import EndpointContext
from kvpush.runtime.owner import OwnerThread, RankCrash, drain_notifications
from kvpush.telemetry.names import Counter, Failure, Gauge
from kvpush.transport import lanes
from kvpush.wire import protocol

log = logging.getLogger(__name__)


class PushWriter:
    def __init__(
        self,
        ep: EndpointContext,
        owner: OwnerThread,
        on_outcome: Callable[[PushOutcome], None] | None = None,
    ) -> None:
        self.cfg = ep.cfg
        self._instruments = ep.instruments
        self._on_ping = ep.on_ping
        self._owner = owner
        t = ep.cfg.timeouts
        self.table = PushTable(lease_s=t.lease_s, reg_ttl_s=t.request_deadline_s)
        # What the writer shares with its collaborators. The dialect is the wire's: transfer
        # keys (vLLM's: base request ids), WRITE deadlines (vLLM's: none, no fence could tell a
        # vLLM D that a late WRITE is over), which D ranks a PUSH_REG names.
        self._ctx = ctx = WriterContext.of(ep, self.table, on_outcome or _ignore)
        self.finished = owner.inbox("finished", 1 << 16, self._on_finished, self._item_failed)
        self.deferred = owner.inbox("deferred", 1 << 16, self._on_deferred, self._item_failed)
        self.tasks = owner.inbox("tasks", 1 << 16, self._task, self._item_failed)
        self._wait: HandshakeWait = (
            BlockingWait(t.handshake_s + 1)
            if ep.instruments.writer == WriterMode.BLOCKING
            else DeferredWait(self.table, owner, lambda: self.deferred, self._lost)
        )
        self._out = Outcomes(ctx, owner, self.tasks, ep.decliner)
        self._fences = Fences(ctx)
        # Which lane carries each D's KV (read off the hot path, at snapshot time).
        self._lanes = PeerLanes(
            lanes.book_for(ep.metadata.agent_name, ep.cfg.agent.lanes), ep.cfg.host
        )
        ep.telemetry.peer_extras_fn(self._lanes.fields)
        self._legs = Legs(ctx, self._out, self._fences, self._lanes)
        self._peers = DecodePeers(ctx, self._out, self._legs, self._fences)
        self._declines = Declines(ctx, self._out)
        self._rl = RateLimitedLog(log)
        self._n_finished = 0
        self._ranks = RankRouter(
            self.cfg.tp_rank, self.cfg.tp_size, ep.dialect, t.request_deadline_s
        )
        owner.attach(self)

    # ------------------------------------------------------------------ OwnerLoop
    def on_start(self) -> None:
        self._legs.open()

    def poll(self) -> int:
        n = drain_notifications(
            self._ctx.agent, self._ctx.codec, self._ctx.telemetry, self._rl, self._on_notif
        )
        self._flush()  # the pass's matched pushes: coalesced per D rank, posted now
        n = n + self._poll_legs() if self.table.has_inflight() else n
        for ev in self._out.take_evictions():  # a notification found its agent gone
            self._dispatch(ev)
        return n

    def _flush(self) -> None:
        """Post this pass's matched legs, one WRITE per D rank (before anything sees them)."""
        while self._legs.ready:
            for group in self._legs.ready.take():
                ev = self._legs.post_ready(group)
                if ev is not None:
                    self._dispatch(ev)

    def _task(self, task: Callable[[], None]) -> None:
        self._flush()
        task()

    def _poll_legs(self) -> int:
        """Each peer's WRITEs oldest first, up to the first one still in progress: WRITEs on one
        connection complete in order, so a pass costs one ``check_xfer_state`` per busy peer,
        not one per WRITE (the raw loop's way). ``housekeeping`` polls them all, so an
        out-of-order completion waits at most one housekeeping period, and every deadline is
        enforced there; the oldest one's deadline here too. A peer to evict is evicted at once,
        before its queue is looked at again (the eviction ends its other WRITEs)."""
        n = 0
        now = time.monotonic()
        for q in self.table.queues():
            while q:
                entry = next(iter(q.values()))
                ended = self._legs.check(entry, now)
                if ended is None:
                    break
                if isinstance(ended, EvictPeer):
                    self._dispatch(ended)
                if q and next(iter(q.values())) is entry:
                    break
                n += 1
        return n

    def _sweep(self, now: float) -> None:
        """Poll every in-flight WRITE and fence, and enforce every deadline."""
        for entry in self.table.inflight():
            # (an earlier entry's eviction may have ended this one meanwhile)
            if self.table.tracks(entry):
                ended = self._legs.check(entry, now)
                if isinstance(ended, EvictPeer):
                    self._dispatch(ended)

    def _dispatch(self, event: Event) -> None:
        """Act on what a collaborator returned (``kvpush.prefill.events``)."""
        if isinstance(event, EvictPeer):
            self._peers.evict(event.key, event.reason, True if event.soft else Failure.PEER_DEAD)
        else:  # Rewait: a forged PUSH_REG was refused; the blocks wait for the real one
            self._on_finished(event.finished)

    def pending(self) -> bool:
        return self.table.has_inflight()

    def gauges(self) -> dict[str, float]:
        tb = self.table
        return {
            Gauge.FINISHED_WAITING_REG: tb.count(Waiting),
            Gauge.REGS_WAITING_BLOCKS: tb.count(Registered),
            Gauge.DEFERRED: tb.count(AwaitingHandshake) + len(self.deferred),
            Gauge.INFLIGHT_WRITES: tb.count(Writing),
            Gauge.INBOX_FINISHED: len(self.finished),
        }

    def housekeeping(self, now: float) -> None:
        self._flush()
        if self.table.has_inflight():
            self._sweep(now)
        fins, regs = self.table.expire(now)
        for f in fins:
            self._ctx.telemetry.fail(Failure.LEASE_EXPIRED)
            self._rl.warning("lease", "lease of %s lapsed before D registered", f.key)
            self._ctx.pool.allocator.release(f.key)
            self._ctx.report(PushOutcome(f.transfer_id, False, Failure.LEASE_EXPIRED))
        for r in regs:
            self._ctx.telemetry.fail(Failure.REGISTRATION_EXPIRED)
            self._out.refuse_registration(r, Failure.NO_BLOCKS, "P never finished blocks for it")
        if self._fences and self._legs.local_dlist is not None:
            for fw in self._fences.send(self._legs.local_dlist):
                self._legs.complete(fw)
        self._out.acks.retry(now)
        for ev in self._out.take_evictions():
            self._dispatch(ev)
        self._peers.housekeeping(now)

    # ------------------------------------------------------------------ inbox handlers
    def _item_failed(self, item: object, e: Exception) -> None:
        """An unexpected error fails that item, never the thread."""
        self._ctx.telemetry.fail(Failure.INTERNAL_ERROR)
        log.exception("writer: handling %r failed", item)
        push = item.push if isinstance(item, Deferred) else item
        if isinstance(push, Push):
            self._out.fail(push, Failure.INTERNAL_ERROR, repr(e))

    def _lost(self, push: Push, e: BaseException) -> None:
        self._out.fail(push, Failure.CALLBACK_ERROR, f"handshake callback failed: {e!r}")

    def _on_finished(self, f: Finished) -> None:
        self._n_finished += 1
        try:
            got = self.table.add_finished(f, time.monotonic())
        except DuplicateError as e:
            self._ctx.telemetry.fail(Failure.DUPLICATE_TRANSFER)
            self._rl.warning("dup", "writer: %s", e)
            return
        if isinstance(got, CancelledEarly):
            self._ctx.pool.allocator.release(f.key)
            self._ctx.report(PushOutcome(f.transfer_id, False, got.reason, got.detail))
        elif got is not None:
            self._start_push(got)
        self._crash_check()

    def _on_registration(self, r: Registration) -> None:
        got = self._ranks.route(r, time.monotonic())
        if isinstance(got, Refused):
            self._ctx.telemetry.fail(Failure.UNEXPECTED_RANK)
            self._rl.warning(
                "rank",
                "writer: dropped PUSH_REG for %s from D rank %d of %d: P rank %d of %d "
                "does not write it",
                r.key,
                got.d_rank,
                got.d_tp,
                self.cfg.tp_rank,
                self.cfg.tp_size,
            )
            return
        if not got.registrations:
            log.debug("writer: PUSH_REG of %s from another D rank: already fanned out", r.key)
        for one in got.registrations:
            self._register(one, got.expected)

    def _register(self, r: Registration, expected: int) -> None:
        if (
            self.table.get(r.key) is None
            and self.table.count(Registered) >= MAX_PENDING_REGISTRATIONS
        ):
            self._ctx.telemetry.fail(Failure.TOO_MANY_REGISTRATIONS)
            self._rl.warning(
                "regcap",
                "writer: declined PUSH_REG of %s: %d registrations already wait for blocks",
                r.key,
                MAX_PENDING_REGISTRATIONS,
            )
            self._out.decline(
                r,
                Failure.TOO_MANY_REGISTRATIONS,
                f"{MAX_PENDING_REGISTRATIONS} registrations already wait for P's blocks",
            )
            return
        try:
            got = self.table.add_registration(r, expected=expected)
        except DuplicateError as e:  # (refused before the table changed: ids as they were)
            self._ctx.telemetry.fail(Failure.DUPLICATE_REGISTRATION)
            self._rl.warning("dupreg", "writer: %s", e)
            if r.reg.request_id not in self.table.request_ids(r.key):
                # The same transfer under another request id: that request can never be
                # served, so its D hears it now instead of at its deadline.
                why = "is already registered by another request"
                tid = r.reg.transfer_id or r.key
                self._out.decline(r, Failure.DUPLICATE_REGISTRATION, f"transfer {tid} {why}")
            return
        if isinstance(got, Push):
            self._start_push(got)
        elif isinstance(got, CancelledEarly) and got.refused:
            self._out.decline(r, got.reason, got.detail)  # P refused it before D registered

    # ------------------------------------------------------------------ declines (tasks)
    def declined_by_d(self, transfer_id: str, reason: str, detail: str) -> None:
        """D cannot take ``transfer_id`` (``kvpush.prefill.declines``): its blocks go now."""
        self._declines.by_d(transfer_id, reason, detail)

    def refused_by_p(self, transfer_id: str, reason: str, detail: str) -> None:
        """P refused the prefill of ``transfer_id``: every D rank that registered is told."""
        self._declines.by_p(transfer_id, reason, detail)

    def _on_deferred(self, d: Deferred) -> None:
        st = self.table.get(d.push.key)
        cancelled = False
        if isinstance(st, AwaitingHandshake):
            cancelled = st.cancelled
            self.table.pop(d.push.key)
        if cancelled:
            self._ctx.pool.allocator.release(d.push.key)
            reg = d.push.registration
            # With D's address: when the handshake failed there is no connection yet, and the
            # acknowledgement is owed until one is up (kvpush.prefill.acks), not dropped.
            self._out.ack_cancel(protocol.Cancel.of(reg.reg), reg.sender)
        elif d.error is not None:
            self._out.fail(d.push, handshake_failure(d.error, Role.DECODE), str(d.error))
        elif self._owner.stopping:
            self._out.fail(d.push, *self._stop_why())
        else:
            self._start_push(d.push)

    # ------------------------------------------------------------------ pushing
    def _start_push(self, push: Push) -> None:
        """Make sure every target D rank is connected (full handshake), then post the legs."""
        conns = self._peers.connections(push)  # by D rank, or a pending handshake
        if conns is None:
            return  # the push failed (D told)
        if isinstance(conns, Future):
            if push.attempt >= 3 + len(push.registrations):
                self._out.fail(push, Failure.HANDSHAKE_FAILED, "peer kept disconnecting")
                return
            if isinstance(self._wait, BlockingWait):
                self._flush()  # (what was matched before is not held up by this wait)
            try:
                if not self._wait.pending(push, conns):
                    return  # parked: it comes back through the deferred inbox
            except BaseException as e:
                self._out.fail(push, handshake_failure(e, Role.DECODE), str(e))
                return
            self._start_push(push.retry())  # blocking wait: another target may be pending
            return
        events = self._legs.start(push, conns)
        if events:  # (the hot path returns the shared empty tuple: nothing to iterate)
            for event in events:
                self._dispatch(event)

    # ------------------------------------------------------------------ notifications
    def _on_notif(self, sender: str, msg: protocol.Notif) -> None:
        self._lanes.heard(sender)  # its first is the peer's first contact (lanes)
        if isinstance(msg, protocol.PushReg | protocol.PushRegs):
            # PushRegs: several registrations, each handled as if it had come alone, in order
            regs = msg.expand() if isinstance(msg, protocol.PushRegs) else (msg,)
            self._ctx.telemetry.inc(Counter.PUSH_REGS_RECEIVED, len(regs))
            now, key_of = time.monotonic(), self._ctx.dialect.registration_key  # (for them all)
            for reg in regs:
                r = Registration(key_of(reg), reg, sender, now)
                if self._owner.stopping:  # too late: D hears why now, not when P's agent is gone
                    self._out.refuse_registration(r, *self._stop_why())
                else:
                    self._on_registration(r)
        elif isinstance(msg, protocol.Heartbeat):
            self._ctx.telemetry.inc(Counter.HEARTBEATS_RECEIVED)
            keys = [self._ctx.dialect.transfer_key(t) for t in msg.transfer_ids]
            self.table.renew(keys, time.monotonic())
        elif isinstance(msg, protocol.Cancel):
            self._ctx.telemetry.inc(Counter.CANCELS_RECEIVED)
            self._flush()  # a push matched earlier in this pass is posted first, as it was
            self._peers.cancelled(msg)  # (acknowledged to the incarnation that cancelled)
            self._out.on_cancel(msg, sender)
        elif isinstance(msg, protocol.Ping):
            self._on_ping(sender, msg)
        else:
            self._ctx.telemetry.fail(Failure.UNEXPECTED_NOTIF)
            self._rl.warning("unexpected", "unexpected %s from %s", type(msg).__name__, sender)

    # ------------------------------------------------------------------ peers and shutdown
    def forget(self, g: PeerGone) -> None:
        """From any thread: a D proven gone or replaced (a registry hint, checked); dropped at once
        (its WRITEs in flight fail with ``g.reason``). Dropped when the writer is stopping."""
        self._owner.hand_off(self.tasks, lambda: self._peers.forget(g), _ignore)

    def drain(self, deadline: float) -> None:
        """Stop intake, fail what cannot finish, wait for in-flight WRITEs until the deadline.
        Every transfer still held ends in an outcome (the owner's stop reason, else
        ``shutting_down``); every D that registered is told, so it frees its blocks at once."""
        reason, detail = self._stop_why()
        self._flush()
        for f in self.finished.close():
            self._ctx.pool.allocator.release(f.key)
            self._ctx.report(PushOutcome(f.transfer_id, False, reason, detail))
        fins, regs = self.table.drain_waiting()
        for f in fins:
            self._ctx.pool.allocator.release(f.key)
            self._ctx.report(PushOutcome(f.transfer_id, False, reason, detail))
        for r in regs:
            self._out.refuse_registration(r, reason, detail)
        while (
            self.table.has_inflight() or self.table.count(AwaitingHandshake) or len(self.deferred)
        ) and time.monotonic() < deadline:
            for d in self.deferred.drain():
                try:
                    self._on_deferred(d)
                except Exception as e:
                    self._item_failed(d, e)
            self.poll()
            time.sleep(0.0005 if not self.table.has_inflight() else 0)
        # PUSH_REGs that came since the last pass are refused now (``stopping`` below tells
        # only the Ds this rank is connected to).
        c = self._ctx
        drain_notifications(c.agent, c.codec, c.telemetry, self._rl, self._on_notif)
        self.deferred.close()
        for entry in self.table.inflight():
            self._legs.abandon(entry, reason, f"{detail}: the WRITE did not complete")
        for st in self.table.waiting_handshake():
            self._out.fail(st.push, reason, f"{detail}: the handshake was pending")
        self.tasks.close()
        self._legs.close()
        # Nothing more is written from here on: every D this rank is connected to hears it
        # (and why), so requests that drew on this rank end with that reason at once --
        # including the ones whose PUSH_REG is still on its way or not yet sent.
        self._out.stopping(reason, detail)

    def _stop_why(self) -> tuple[Failure, str]:
        """Why work still held ends now: the owner's stop reason (a failed rank), else a stop."""
        return self._owner.stop_reason or (Failure.SHUTTING_DOWN, "P is shutting down")

    def abort(self, error: BaseException) -> None:
        """This rank's loop died: fail every push now (in-flight WRITEs get a short grace to
        land, so D is told a clear outcome rather than left quarantined)."""
        why = f"P rank {self.cfg.tp_rank} failed: {type(error).__name__}: {error}"
        # Every path of the drain reads it (a deferred push, a PUSH_REG its last pass reads).
        self._owner.stop_reason = (Failure.RANK_FAILED, why)
        self.drain(time.monotonic() + 1.0)

    def _crash_check(self) -> None:
        """Fault hook (tests): this rank's loop dies after its Nth finished transfer."""
        rank, after = self._instruments.crash_rank_after
        if rank == self.cfg.tp_rank and 0 < after <= self._n_finished:
            raise RankCrash(f"fault injection: rank {rank} crashed after {after} transfers")


def _ignore(_: object) -> None:
    """An outcome nobody asked for, or a task that could not be queued (the writer is stopping
    and releases every peer)."""

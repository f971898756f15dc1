"""P's push writer: the role loop that owns WRITE submission, on the endpoint's ``OwnerThread``.

Wake model. The owner thread sleeps on one event shared by the writer's inboxes: *finished* (P's
blocks are ready), *deferred* (pushes whose P->D handshake completed) and *tasks* (small jobs
other threads hand over, e.g. a cancel acknowledgement once its handshake is up). Each pass
drains them, polls NIXL notifications (PUSH_REG, heartbeat, cancel, ping), polls in-flight WRITEs
and, every few milliseconds, expires leases and deadlines and sends fences. It spins while WRITEs
are in flight and backs off when idle: with NIXL's progress thread off, this polling *is* progress.

Never blocking on the network. When the P->D handshake is not ready, the handshake-wait strategy
(``kvpush.prefill.strategy``) parks the push and returns; ``--writer blocking`` waits instead,
for comparison only. A transfer's whole state is one typed entry of the ``PushTable``.

Every failure goes through ``Outcomes.fail`` (``kvpush.prefill.outcomes``: count, rate-limited
log, Failure notification to D, blocks released or quarantined). P's blocks return to the pool
when their WRITE completes or their lease lapses. A WRITE abandoned while its bytes may still be
moving quarantines P's blocks and tells D ``may_have_written``; a fence
(``kvpush.prefill.fences``) then frees both sides.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from kvpush.config import EndpointConfig, HandshakeMode, Wire, WriterMode
from kvpush.memory.pool import KvPool
from kvpush.peers.handshakes import HandshakeManager, PeerConn, PeerKey
from kvpush.peers.validation import handshake_failure
from kvpush.peers.vllm_peer import PeerHint
from kvpush.prefill.fences import Fences
from kvpush.prefill.outcomes import Outcomes
from kvpush.prefill.plan import LocalGeometry, PlanError, plan_write
from kvpush.prefill.strategy import BlockingWait, Deferred, DeferredWait, HandshakeWait
from kvpush.prefill.table import (
    AwaitingHandshake,
    CancelledEarly,
    DuplicateError,
    FenceEntry,
    FenceWrite,
    Finished,
    InFlight,
    Push,
    PushOutcome,
    PushTable,
    Registered,
    Registration,
    Waiting,
    Writing,
    reg_key,
    transfer_key,
)
from kvpush.ratelog import RateLimitedLog
from kvpush.runtime.owner import OwnerThread, drain_notifications
from kvpush.telemetry.names import Counter, Failure, Gauge, Hist
from kvpush.telemetry.store import Telemetry
from kvpush.transport.nixl import DList, NixlAgent, TransferError
from kvpush.wire import protocol
from kvpush.wire.notifs import Codec

log = logging.getLogger(__name__)


class PushWriter:
    def __init__(
        self,
        cfg: EndpointConfig,
        agent: NixlAgent,
        pool: KvPool,
        handshakes: HandshakeManager,
        codec: Codec,
        telemetry: Telemetry,
        owner: OwnerThread,
        on_ping: Callable[[str, protocol.Ping], None] | None = None,
        on_outcome: Callable[[PushOutcome], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self._agent = agent
        self._pool = pool
        self._hs = handshakes
        self._codec = codec
        self._tm = telemetry
        self._owner = owner
        self._on_ping = on_ping
        self._on_outcome = on_outcome or _ignore
        # vLLM's wire: matched by base request id, no WRITE deadline (vLLM has none and no fence
        # could tell a vLLM D that a late WRITE is over), no kvpush notifications.
        self._vllm = cfg.wire == Wire.VLLM
        t = cfg.timeouts
        self.table = PushTable(lease_s=t.lease_s, reg_ttl_s=t.request_deadline_s)
        self.finished = owner.inbox("finished", 1 << 16, self._on_finished, self._item_failed)
        self.deferred = owner.inbox("deferred", 1 << 16, self._on_deferred, self._item_failed)
        self.tasks = owner.inbox("tasks", 1 << 16, _call, self._item_failed)
        self._wait: HandshakeWait = (
            BlockingWait(t.handshake_s + 1)
            if cfg.writer_mode == WriterMode.BLOCKING
            else DeferredWait(self.table, owner, lambda: self.deferred, self._lost)
        )
        self._geom = LocalGeometry(pool.cfg.num_blocks, pool.cfg.regions, pool.cfg.block_bytes)
        self._out = Outcomes(
            agent,
            pool,
            self.table,
            handshakes,
            codec,
            telemetry,
            owner,
            self.tasks,
            self._on_outcome,
        )
        self._fences = Fences(
            agent, pool, self.table, handshakes, codec, telemetry, self._geom, t.fence_s
        )
        self._rl = RateLimitedLog(log)
        self._local_dlist: DList | None = None
        owner.attach(self)

    # ------------------------------------------------------------------ OwnerLoop
    def on_start(self) -> None:
        self._local_dlist = self._agent.prep_local(
            self._pool.all_block_descs(), self._pool.device_kind
        )

    def poll(self) -> int:
        n = drain_notifications(self._agent, self._codec, self._tm, self._rl, self._on_notif)
        return n + self._poll_inflight()

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
        fins, regs = self.table.expire(now)
        for f in fins:
            self._tm.fail(Failure.LEASE_EXPIRED)
            self._rl.warning("lease", "lease of %s lapsed before D registered", f.key)
            self._pool.allocator.release(f.key)
            self._on_outcome(PushOutcome(f.transfer_id, False, Failure.LEASE_EXPIRED))
        for r in regs:
            self._tm.fail(Failure.REGISTRATION_EXPIRED)
            self._out.refuse_registration(r, Failure.NO_BLOCKS, "P never finished blocks for it")
        if self._fences and self._local_dlist is not None:
            for fw in self._fences.send(self._local_dlist):
                self._complete(fw)
        busy = self.table.peers_in_flight()
        for key in self._hs.idle(self.cfg.timeouts.peer_idle_ttl_s):
            if key not in busy:
                self._evict(key, "idle")

    # ------------------------------------------------------------------ inbox handlers
    def _item_failed(self, item: object, e: Exception) -> None:
        """An unexpected error fails that item, never the thread."""
        self._tm.fail(Failure.INTERNAL_ERROR)
        log.exception("writer: handling %r failed", item)
        push = item.push if isinstance(item, Deferred) else item
        if isinstance(push, Push):
            self._out.fail(push, Failure.INTERNAL_ERROR, repr(e))

    def _lost(self, push: Push, e: BaseException) -> None:
        self._out.fail(push, Failure.CALLBACK_ERROR, f"handshake callback failed: {e!r}")

    def _on_finished(self, f: Finished) -> None:
        try:
            got = self.table.add_finished(f, time.monotonic())
        except DuplicateError as e:
            self._tm.fail(Failure.DUPLICATE_TRANSFER)
            self._rl.warning("dup", "writer: %s", e)
            return
        if isinstance(got, CancelledEarly):
            self._pool.allocator.release(f.key)
        elif got is not None:
            self._start_push(got)

    def _on_registration(self, r: Registration) -> None:
        try:
            got = self.table.add_registration(r)
        except DuplicateError as e:
            self._tm.fail(Failure.DUPLICATE_REGISTRATION)
            self._rl.warning("dupreg", "writer: %s", e)
            return
        if isinstance(got, Push):
            self._start_push(got)

    def _on_deferred(self, d: Deferred) -> None:
        st = self.table.get(d.push.key)
        cancelled = False
        if isinstance(st, AwaitingHandshake):
            cancelled = st.cancelled
            self.table.pop(d.push.key)
        if cancelled:
            self._pool.allocator.release(d.push.key)
            reg = d.push.registration
            cancel = protocol.Cancel(request_id=reg.reg.request_id, transfer_id=reg.reg.transfer_id)
            self._out.ack_cancel(cancel, reg.sender)
        elif d.error is not None:
            self._out.fail(d.push, handshake_failure(d.error, "decode"), str(d.error))
        elif self._owner.stopping:
            self._out.fail(d.push, Failure.SHUTTING_DOWN, "P is shutting down")
        else:
            self._start_push(d.push)

    # ------------------------------------------------------------------ pushing
    def _start_push(self, push: Push) -> None:
        reg = push.registration.reg
        key = push.peer
        conn = self._hs.get(key)
        if (
            conn is not None
            and reg.decode_incarnation
            and conn.metadata.incarnation != reg.decode_incarnation
        ):
            arrived_wall = time.time() - (time.monotonic() - push.registration.t_arrived)
            if conn.connected_at > arrived_wall:
                # We connected to this incarnation after the PUSH_REG arrived: it comes from
                # an incarnation that has since died. Evicting the live one would fail its
                # pushes; writing would hit blocks that now belong to someone else.
                self._out.fail(push, Failure.STALE_REGISTRATION, "D restarted after this PUSH_REG")
                return
            # D restarted at the same address: forget the old incarnation first.
            self._evict(key, f"new incarnation {reg.decode_incarnation}")
            conn = None
        if conn is None or conn.remote_dlist is None:
            hint = PeerHint(reg.decode_engine_id, reg.decode_tp_size)
            fut = self._hs.ensure(key, HandshakeMode.FULL, hint)
            if fut is not None:
                if push.attempt >= 3:
                    self._out.fail(push, Failure.HANDSHAKE_FAILED, "peer kept disconnecting")
                    return
                try:
                    if not self._wait.pending(push, fut):
                        return  # parked: it comes back through the deferred inbox
                except BaseException as e:
                    self._out.fail(push, handshake_failure(e, "decode"), str(e))
                    return
            conn = self._hs.get(key)
            if conn is None or conn.remote_dlist is None:
                self._out.fail(push, Failure.HANDSHAKE_FAILED, "peer not connected after handshake")
                return
        self._post(push, conn)

    def _post(self, push: Push, conn: PeerConn) -> None:
        reg = push.registration.reg
        if reg.decode_incarnation and conn.metadata.incarnation != reg.decode_incarnation:
            # Reconnected to a newer incarnation than the one that registered.
            self._out.fail(push, Failure.STALE_REGISTRATION, "D restarted after this PUSH_REG")
            return
        sender = push.registration.sender
        if sender and sender != conn.agent_name:
            # The PUSH_REG did not come from the D it names: a third agent trying to redirect
            # this WRITE into someone else's blocks. Refuse it (no Failure to the real D) and
            # let the blocks wait for the real registration.
            self._tm.fail(Failure.FORGED_NOTIF)
            self._rl.warning(
                "forged",
                "PUSH_REG for %s from %s, not from %s: ignored",
                push.key,
                sender,
                conn.agent_name,
            )
            self._on_finished(push.finished)
            return
        try:
            plan = plan_write(push.finished.block_ids, reg, conn.metadata, self._geom)
        except PlanError as e:
            self._out.fail(push, e.reason, e.detail)
            return
        notif = self._codec.encode(
            protocol.Completion(
                request_id=reg.request_id,
                transfer_id=reg.transfer_id,
                p_tp_size=self.cfg.tp_size,
                p_tp_rank=self.cfg.tp_rank,
                nbytes=plan.nbytes,
            )
        )
        assert self._local_dlist is not None and conn.remote_dlist is not None
        # INFLIGHT before the post: from the moment bytes may move, nothing frees these blocks
        # except a completion, a fence or the peer's death.
        self._pool.allocator.mark_inflight(push.key)
        t_post = time.monotonic()
        try:
            xfer, state = self._agent.post_write(
                self._local_dlist, plan.local_idx, conn.remote_dlist, plan.remote_idx, notif
            )
        except TransferError as e:
            self._out.fail(push, Failure.WRITE_POST_FAILED, str(e), conn=conn)
            if e.kind in ("peer_dead", "peer_unknown"):
                self._evict(conn.key, f"WRITE post failed: {e.kind}")
            return
        deadline = (
            math.inf if self._vllm else t_post + self.cfg.timeouts.write_deadline_s(plan.nbytes)
        )
        w = Writing(push, xfer, conn, t_post, deadline, plan.nbytes)
        self.table.writing(w)
        if state == "DONE":
            self._complete(w)
        elif state == "ERR":
            self._abandon(w, Failure.WRITE_ERROR, "transfer() returned ERR")

    def _poll_inflight(self) -> int:
        if not self.table.has_inflight():
            return 0
        n = 0
        now = time.monotonic()
        for entry in self.table.inflight():
            try:
                st = self._agent.state(entry.xfer)
            except TransferError as e:
                dead = e.kind == "peer_dead"
                self._abandon(entry, Failure.PEER_DEAD if dead else Failure.WRITE_ERROR, str(e))
                if dead:
                    self._evict(entry.conn.key, "transfer failed: peer disconnected")
                n += 1
                continue
            if st == "DONE":
                self._complete(entry)
                n += 1
            elif st == "ERR":
                self._abandon(entry, Failure.WRITE_ERROR, "transfer state ERR")
                n += 1
            elif now > entry.deadline:
                self._abandon(
                    entry,
                    Failure.WRITE_TIMEOUT,
                    f"WRITE of {entry.nbytes} bytes not done after {now - entry.t_post:.1f}s",
                )
                n += 1
        return n

    def _complete(self, entry: InFlight) -> None:
        self.table.done(entry)
        self._agent.release(entry.xfer)
        if isinstance(entry, FenceWrite):
            self._fences.completed(entry)
            return
        now = time.monotonic()
        push = entry.push
        self._pool.allocator.release(push.key)
        self._tm.inc(Counter.PUSHES_OK)
        self._on_outcome(PushOutcome(push.finished.transfer_id, True, nbytes=entry.nbytes))
        self._tm.inc(Counter.BYTES_PUSHED, entry.nbytes)
        self._tm.observe(Hist.WRITE_DURATION, now - entry.t_post)
        t_match = max(push.finished.t_finished, push.registration.t_arrived)
        self._tm.observe(Hist.PUSH_LATENCY, now - t_match)

    def _abandon(self, entry: InFlight, reason: Failure, detail: str) -> None:
        """A WRITE (or fence) that will not complete normally."""
        self.table.done(entry)
        released = self._agent.release(entry.xfer)
        dead = reason == Failure.PEER_DEAD
        if isinstance(entry, FenceWrite):
            self._fences.failed(entry, peer_dead=dead)
            return
        push = entry.push
        # Bytes may still be moving unless the peer is gone: quarantine until a fence.
        may_have_written = not dead
        if not released:
            log.warning("writer: NIXL could not cancel the WRITE of %s; fencing", push.key)
        self._out.fail(push, reason, detail, conn=entry.conn, may_have_written=may_have_written)
        if may_have_written:
            reg = push.registration.reg
            self._fences.add(
                entry.conn.key, FenceEntry(push.key, int(reg.local_block_ids[0][0]), reg.request_id)
            )

    # ------------------------------------------------------------------ notifications
    def _on_notif(self, sender: str, msg: protocol.Notif) -> None:
        if isinstance(msg, protocol.PushReg):
            self._tm.inc(Counter.PUSH_REGS_RECEIVED)
            if not self._owner.stopping:
                key = transfer_key(msg.request_id, True) if self._vllm else reg_key(msg)
                self._on_registration(Registration(key, msg, sender, time.monotonic()))
        elif isinstance(msg, protocol.Heartbeat):
            self._tm.inc(Counter.HEARTBEATS_RECEIVED)
            keys = [transfer_key(t, self._vllm) for t in msg.transfer_ids]
            self.table.renew(keys, time.monotonic())
        elif isinstance(msg, protocol.Cancel):
            self._tm.inc(Counter.CANCELS_RECEIVED)
            self._out.on_cancel(msg, sender)
        elif isinstance(msg, protocol.Ping):
            if self._on_ping is not None:
                self._on_ping(sender, msg)
        else:
            self._tm.fail(Failure.UNEXPECTED_NOTIF)
            self._rl.warning("unexpected", "unexpected %s from %s", type(msg).__name__, sender)

    # ------------------------------------------------------------------ peers and shutdown
    def _evict(self, key: PeerKey, reason: str) -> None:
        conn = self._hs.evict(key, reason)
        for entry in self.table.inflight():
            if entry.conn.key != key:
                continue
            self.table.done(entry)
            self._agent.release(entry.xfer)
            if isinstance(entry, Writing):
                self._out.fail(entry.push, Failure.PEER_DEAD, reason)
            else:
                for e in entry.entries:
                    self._pool.allocator.release_quarantined(e.key)
        self._fences.forget_peer(key)
        if conn is not None:
            self._hs.release_conn(conn)

    def drain(self, deadline: float) -> None:
        """Stop intake, fail what cannot finish, wait for in-flight WRITEs until the deadline."""
        for f in self.finished.close():
            self._pool.allocator.release(f.key)
        fins, regs = self.table.drain_waiting()
        for f in fins:
            self._pool.allocator.release(f.key)
        for r in regs:
            self._out.refuse_registration(r, Failure.SHUTTING_DOWN, "P is shutting down")
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
        self.deferred.close()
        for entry in self.table.inflight():
            self._abandon(entry, Failure.SHUTTING_DOWN, "P stopped before the WRITE completed")
        for st in self.table.waiting_handshake():
            self._out.fail(
                st.push, Failure.SHUTTING_DOWN, "P stopped while the handshake was pending"
            )
        self.tasks.close()
        if self._local_dlist is not None:
            self._agent.release_dlist(self._local_dlist)
            self._local_dlist = None


def _call(task: Callable[[], None]) -> None:
    task()


def _ignore(outcome: PushOutcome) -> None:
    pass

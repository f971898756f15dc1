"""D's receiver: the role loop that owns D's side of NIXL, on the endpoint's ``OwnerThread``.

For each new request it makes sure a handshake to P exists (notif-only by default: D only ever
notifies P), deferred through a done-callback exactly like P's writer and never blocking; then it
sends PUSH_REG (saying it takes ``Completions`` unless ``--no-coalesce``; several in one
notification to a P that takes them: ``kvpush.decode.registrar``), counts completion notifications
(expected = max(1, P_tp / D_tp); a ``Completions`` counts once for each request it names), sends
heartbeats for waiting requests and enforces each request's deadline. A whole request goes to the
completer (verification off this thread). A request that fails after its PUSH_REG went out tells P
(``Cancel``) and keeps its blocks quarantined until P's fence or the WRITE's own completion says no
more bytes can land (vLLM's C1: never hand them to the next request before); how a failed request
ends and when its blocks come back is ``kvpush.decode.outcomes``; heartbeats and P ranks that are
gone or stopped are ``kvpush.decode.peers``; which P ranks a request draws from, and a connection to
each, is ``kvpush.decode.sources``.

Seams: everything it touches is handed in (the rank's ``EndpointContext``: agent, pool,
handshakes, codec, telemetry, the local metadata; and the completer), so component tests drive
it with the one fake agent. ``Outcomes``, ``PrefillPeers`` and ``Sources`` share that context and
its table.
"""

from __future__ import annotations

import logging

from kvpush.address import format_address
from kvpush.config import Role
from kvpush.decode.completer import Completer
from kvpush.decode.outcomes import Outcomes, failed_rep
from kvpush.decode.peers import PrefillPeers
from kvpush.decode.registrar import Registrar
from kvpush.decode.requests import (
    Abandoned,
    Delay,
    DRequest,
    PRanks,
    RequestTable,
    Waiting,
    WaitPhase,
)
from kvpush.decode.sources import Sources
from kvpush.errors import NoFreeBlocksError
from kvpush.peers.handshakes import PeerConn, PeerGone
from kvpush.peers.validation import handshake_failure
from kvpush.ratelog import RateLimitedLog
from kvpush.runtime.context import EndpointContext
from kvpush.runtime.owner import OwnerThread, RankCrash, drain_notifications
from kvpush.telemetry import phases
from kvpush.telemetry.names import Counter, Failure, Gauge
from kvpush.transport.agent import TransferError
from kvpush.wire import protocol

log = logging.getLogger(__name__)


class Receiver:
    def __init__(self, ctx: EndpointContext, completer: Completer, owner: OwnerThread) -> None:
        self.cfg = ctx.cfg
        # The rank's collaborators, read through ``ctx``; P's TP size by side-channel address
        # is ``ctx.peer_tp``, shared by this endpoint's ranks.
        self._ctx = ctx
        self._completer = completer
        self._owner = owner
        self.table = RequestTable()
        self.new = owner.inbox("decode-new", 1 << 16, self._on_new, self._item_failed)
        self.ready = owner.inbox("decode-ready", 1 << 16, self._on_ready, self._item_failed)
        self.cancels = owner.inbox("decode-cancel", 1 << 16, self._on_cancel, self._item_failed)
        self.declines = owner.inbox("decode-decline", 1 << 16, self._on_decline, self._item_failed)
        self.gone = owner.inbox("decode-gone", 1 << 10, self._on_gone, self._item_failed)
        self._rl = RateLimitedLog(log)
        self._out = Outcomes(ctx, self.table)
        self._peers = PrefillPeers(ctx, self.table, self._out)
        self._sources = Sources(ctx, self.table, self._out, self._peers, owner, self.ready)
        self._regs = Registrar(ctx, self.table, self.cfg.coalesce, self._push_reg_failed)
        self._next_hb = 0.0
        self._next_idle = 0.0
        self._n_new = 0
        owner.attach(self)

    # ------------------------------------------------------------------ OwnerLoop
    def on_start(self) -> None:
        pass

    def poll(self) -> int:
        self._regs.flush()  # what this pass's inboxes registered, before P's answers are read
        return drain_notifications(
            self._ctx.agent, self._ctx.codec, self._ctx.telemetry, self._rl, self._on_notif
        )

    def pending(self) -> bool:
        return False

    def gauges(self) -> dict[str, float]:
        return {
            Gauge.D_WAITING: self.table.n_waiting,
            Gauge.D_QUARANTINED_REQUESTS: self.table.n_abandoned,
            Gauge.INBOX_DECODE_NEW: len(self.new),
        }

    def housekeeping(self, now: float) -> None:
        for ab in self.table.quarantine_over(now):
            self._out.release_abandoned(ab, "P's lease is over: nothing can land any more")
        for w, delay in self.table.due_for_blocks(now):
            self._allocate_and_register(w, delay)
        for w in self.table.expired(now):
            self._out.fail(
                w, Failure.DEADLINE, f"no KV after {now - w.req.t_start:.1f}s", notify_p=True
            )
        if now >= self._next_hb:
            self._next_hb = now + self.cfg.timeouts.heartbeat_s
            self._peers.heartbeat()
        if now >= self._next_idle:
            # Once a second, and a pass over the table only when some peer is idle.
            self._next_idle = now + 1.0
            idle = self._ctx.handshakes.idle(self.cfg.timeouts.peer_idle_ttl_s)
            busy = self.table.busy_among(idle)
            for key in idle:
                if key not in busy:
                    self._peers.evict(key, "idle")
            for ab in self.table.long_quarantined(now):
                self._report_quarantine(ab, now)
        for key, why in self._ctx.handshakes.down():  # its process is gone (kvpush.peers.watch)
            self._peers.evict(key, f"down: {why}")
        self._regs.flush()

    def _report_quarantine(self, ab: Abandoned, now: float) -> None:
        """Say (once) what a long-quarantined request's blocks wait for."""

        def on(rank: int) -> str:
            conn = ab.ranks.conns.get(rank)
            state = (
                "no connection"
                if conn is None
                else "its connection evicted"
                if conn.evicted
                else f"agent {conn.agent_name}"
            )
            return f"{format_address(*ab.req.p_addr)} rank {rank} ({state})"

        self._ctx.telemetry.inc(Counter.QUARANTINES_LONG)
        self._rl.warning(
            "quarantine",
            "blocks of %s (%d) quarantined for %.0fs, waiting for a fence, late completion or "
            "the end of: %s",
            ab.req.request_id,
            len(ab.block_ids),
            now - ab.t_abandoned,
            "; ".join(on(r) for r in sorted(ab.outstanding)) or "nothing",
        )

    def drain(self, deadline: float) -> None:
        """Stop: fail what is still waiting (P is told), fail what never reached this thread."""
        self._fail_all(*(self._owner.stop_reason or (Failure.SHUTTING_DOWN, "D stopped")))

    def abort(self, error: BaseException) -> None:
        self._fail_all(
            Failure.RANK_FAILED,
            f"D rank {self.cfg.tp_rank} failed: {type(error).__name__}: {error}",
        )

    def _fail_all(self, reason: Failure, detail: str) -> None:
        self._regs.clear()  # never sent: P knows nothing of those requests
        for w in self.table.all_waiting():
            self._out.fail(w, reason, detail, notify_p=True)
        for item in self._owner.close_inboxes():
            queued = item[0] if isinstance(item, tuple) else item
            if not isinstance(queued, Waiting):
                continue
            live = queued.phase in (WaitPhase.NEW, WaitPhase.HANDSHAKING)
            if live and not queued.req.future.done():
                self._ctx.pool.allocator.release(queued.req.request_id)
                queued.req.answer(failed_rep(self._ctx.telemetry, queued.req, reason, detail))

    def _crash_check(self) -> None:
        """Fault hook (tests): this rank's loop dies after its Nth request."""
        rank, after = self._ctx.instruments.crash_rank_after
        if rank == self.cfg.tp_rank and 0 < after <= self._n_new:
            raise RankCrash(f"fault injection: rank {rank} crashed after {after} requests")

    # ------------------------------------------------------------------ inbox handlers
    def _item_failed(self, item: object, e: Exception) -> None:
        self._ctx.telemetry.fail(Failure.INTERNAL_ERROR)
        log.exception("receiver: handling %r failed", item)
        w = item[0] if isinstance(item, tuple) else item
        if isinstance(w, Waiting) and w.phase is not WaitPhase.ENDED:
            self._out.fail(w, Failure.INTERNAL_ERROR, repr(e))

    def _on_new(self, w: Waiting) -> None:
        self._n_new += 1
        self.table.add(w)
        self._connect_and_register(w)
        self._crash_check()

    def _on_gone(self, g: PeerGone) -> None:
        self._peers.forget(g)

    def _on_cancel(self, request_id: str) -> None:
        w = self.table.waiting(request_id)
        if w is not None:
            self._out.fail(w, Failure.CANCELLED, "cancelled by D", notify_p=True)

    def _on_decline(self, msg: protocol.DeclineReq) -> None:
        """P will not serve this request (it said so over the side channel): fail it now with
        P's reason; P wrote nothing for it, so its blocks are free at once."""
        w = self.table.waiting(msg.request_id) if msg.request_id else None
        if w is None or w.req.transfer_id != msg.transfer_id:
            return
        reason = Failure.parse(msg.reason) or Failure.PREFILL_FAILED
        self._out.fail(
            w, reason, f"P declined: {msg.detail}", settled=set(w.registered), notify_p=False
        )

    def _connect_and_register(self, w: Waiting) -> None:
        """Connect to every P rank the request draws from (``kvpush.decode.sources``), then
        register with each. Re-entered after each handshake this request waited for."""
        if self._sources.connect(w):
            self._register(w)

    def _on_ready(self, item: tuple[Waiting, BaseException | None]) -> None:
        w, error = item
        if w.phase is WaitPhase.ENDED:
            return
        if error is not None:
            if self._sources.relearn_after_failure(w):
                self._connect_and_register(w)
                return
            self._out.fail(w, handshake_failure(error, Role.PREFILL), str(error))
            return
        self._connect_and_register(w)

    def _allocate_and_register(self, w: Waiting, delay: Delay) -> None:
        """A held-back request's time has come: allocate its blocks, then register them."""
        try:
            block_ids = self._ctx.pool.allocator.allocate(w.req.request_id, delay.num_blocks)
        except NoFreeBlocksError as e:
            self._ctx.telemetry.fail(Failure.NO_FREE_BLOCKS)
            self._out.fail(w, Failure.NO_FREE_BLOCKS, str(e), notify_p=False)
            return
        self.table.allocated(w, block_ids)
        phases.stamp(w.req.phases, phases.D_ALLOCATED)
        self._register(w)

    def _register(self, w: Waiting) -> None:
        """PUSH_REG to every source P rank not registered with yet (``kvpush.decode.registrar``)."""
        if w.delay is not None:
            # Held in D's queue: P's lease is heartbeated meanwhile, blocks come later.
            self.table.move(w, WaitPhase.WAITING_BLOCKS)
            return
        self._regs.register(w)

    def _push_reg_failed(self, w: Waiting, s: int, conn: PeerConn, e: TransferError) -> None:
        """A PUSH_REG to source rank ``s`` could not be sent: P restarted or vanished. Forget
        that rank and handshake afresh once; else the request fails."""
        key = w.ranks.key(s)
        # (a connection evicted meanwhile is stale: its key may hold a new one)
        stale = conn.evicted
        evict = stale or self._ctx.handshakes.transport_error(key, e)
        if evict and w.ranks.attempts < 1:
            w.ranks.attempts += 1
            del w.ranks.conns[s]
            if not stale:
                self._peers.evict(key, f"PUSH_REG failed: {e.status}", keep=w.req.request_id)
            self._connect_and_register(w)
            return
        if evict and not stale:
            self._peers.evict(key, f"PUSH_REG failed: {e.status}")
        self._out.fail(w, Failure.PREFILL_UNREACHABLE, str(e))

    # ------------------------------------------------------------------ notifications
    def _source(self, req: DRequest, ranks: PRanks, sender: str) -> int | None:
        """The source P rank ``sender`` is; anyone else may not complete or fail ``req``:
        counted (another rank of the same P: ``unexpected_rank``; else ``forged_notif``)."""
        s = ranks.source_of(sender)
        if s is not None:
            return s
        other = any(
            (c := self._ctx.handshakes.get(ranks.key(r))) is not None and c.agent_name == sender
            for r in range(max(ranks.p_tp, 1))
        )
        self._ctx.telemetry.fail(Failure.UNEXPECTED_RANK if other else Failure.FORGED_NOTIF)
        self._rl.warning(
            "forged",
            "ignored a notification for %s from %s (%s)",
            req.request_id,
            sender,
            "a P rank that does not write into this D rank" if other else "not its P",
        )
        return None

    def _settle(self, ab: Abandoned, sender: str, why: str) -> None:
        """``sender`` says it writes nothing more into an abandoned request's blocks."""
        s = self._source(ab.req, ab.ranks, sender)
        if s is not None:
            self._out.settle_abandoned(ab, s, why)

    def _on_notif(self, sender: str, msg: protocol.Notif) -> None:
        if isinstance(msg, protocol.Completion):
            self._on_completion(sender, msg.request_id)
        elif isinstance(msg, protocol.Completions):
            # One WRITE carried several requests' blocks: each named request completes
            # exactly as if its own Completion had come, in the order P wrote them; those it
            # ends are answered together (their blocks back in one pass first: ``Completer``).
            ended = [
                w for d in msg.done if (w := self._completed(sender, d.request_id)) is not None
            ]
            self._completer.submit_many([(w.req, w.block_ids) for w in ended])
        elif isinstance(msg, protocol.Failure):
            self._on_failure(sender, msg)
        elif isinstance(msg, protocol.Fence):
            self._ctx.telemetry.inc(Counter.FENCES_RECEIVED)
            for rid in msg.request_ids:
                ab = self.table.abandoned(rid)
                if ab is not None:
                    self._settle(ab, sender, "fenced")
        elif isinstance(msg, protocol.Ping):
            self._ctx.on_ping(sender, msg)
        else:
            self._ctx.telemetry.fail(Failure.UNEXPECTED_NOTIF)

    def _on_completion(self, sender: str, request_id: str) -> None:
        w = self._completed(sender, request_id)
        if w is not None:
            self._completer.submit(w.req, w.block_ids)

    def _completed(self, sender: str, request_id: str) -> Waiting | None:
        """``sender``'s completion of ``request_id``: the request when that was its last (out
        of the table, for the completer), else None (more to come, or refused, or late)."""
        w = self.table.waiting(request_id)
        if w is not None:
            s = self._source(w.req, w.ranks, sender)
            if s is None:
                return None
            n = w.completions.get(s, 0)
            if n >= w.req.p_pp_size or s not in w.registered:
                # A P rank completing twice (or unasked) would hand D bytes it cannot trust.
                self._ctx.telemetry.fail(Failure.DUPLICATE_COMPLETION)
                self._rl.warning(
                    "dupcompl",
                    "refused a second completion of %s from P rank %d",
                    w.req.request_id,
                    s,
                )
                return None
            w.completions[s] = n + 1
            if w.received >= w.expected:
                phases.stamp(w.req.phases, phases.COMPLETION_RECEIVED)
                self.table.finish(w)
                return w
            return None
        ab = self.table.abandoned(request_id)
        if ab is not None:
            # That rank's abandoned WRITE completed: its bytes have landed.
            self._settle(ab, sender, "completed late")
            return None
        self._ctx.telemetry.fail(Failure.UNKNOWN_COMPLETION)
        return None

    def _on_failure(self, sender: str, msg: protocol.Failure) -> None:
        if not msg.request_id:
            self._peers.stopped(sender, msg)
            return
        w = self.table.waiting(msg.request_id)
        if w is None:
            ab = self.table.abandoned(msg.request_id)
            if ab is not None and not msg.may_have_written:
                self._settle(ab, sender, f"P: {msg.reason}")  # e.g. cancel acknowledged
            return
        s = self._source(w.req, w.ranks, sender)
        if s is None:
            return
        reason = Failure.parse(msg.reason)
        detail = msg.detail if reason is not None else f"{msg.reason}: {msg.detail}"
        if len(w.ranks.sources) > 1:
            detail = f"P rank {s}: {detail}"
        self._out.fail(
            w,
            reason or Failure.PREFILL_FAILED,
            detail,
            settled=set() if msg.may_have_written else {s},
            told={s},
        )

"""D's receiver: the role loop that owns D's side of NIXL, on the endpoint's ``OwnerThread``.

For each new request it makes sure a handshake to P exists (notif-only by default: D only ever
notifies P), deferred through a done-callback exactly like P's writer and never blocking; then
it sends PUSH_REG, counts completion notifications (expected = max(1, P_tp / D_tp)), sends
heartbeats for waiting requests and enforces each request's deadline. A whole request goes to
the completer (verification off this thread). A request that fails after its PUSH_REG went out
tells P (``Cancel``) and keeps its blocks quarantined until P's fence or the WRITE's own
completion says no more bytes can land (vLLM's C1: never hand them to the next request before).

Seams: everything it touches is handed in (agent, pool, handshakes, codec, telemetry, the local
metadata, the completer), so component tests drive it with the one fake agent.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from kvpush.config import EndpointConfig, HandshakeMode
from kvpush.decode.completer import Completer
from kvpush.decode.requests import DRequest, DState, RequestTable
from kvpush.errors import NoFreeBlocksError
from kvpush.memory.pool import KvPool
from kvpush.peers.handshakes import HandshakeManager, PeerConn, PeerKey
from kvpush.peers.validation import handshake_failure
from kvpush.peers.vllm_peer import PeerHint
from kvpush.ratelog import RateLimitedLog
from kvpush.runtime.owner import OwnerThread, drain_notifications
from kvpush.telemetry.names import Counter, Failure, Gauge
from kvpush.telemetry.store import Telemetry
from kvpush.transport.nixl import NixlAgent, TransferError
from kvpush.wire import protocol
from kvpush.wire.notifs import Codec

log = logging.getLogger(__name__)

HEARTBEAT_BATCH = 4096  # transfer ids per Heartbeat notification


class Receiver:
    def __init__(
        self,
        cfg: EndpointConfig,
        agent: NixlAgent,
        pool: KvPool,
        handshakes: HandshakeManager,
        codec: Codec,
        telemetry: Telemetry,
        metadata: protocol.EndpointMetadata,
        completer: Completer,
        owner: OwnerThread,
        on_ping: Callable[[str, protocol.Ping], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self._agent = agent
        self._pool = pool
        self._hs = handshakes
        self._codec = codec
        self._tm = telemetry
        self._md = metadata
        self._completer = completer
        self._owner = owner
        self._on_ping = on_ping
        self.table = RequestTable()
        self.new = owner.inbox("decode-new", 1 << 16, self._on_new, self._item_failed)
        self.ready = owner.inbox("decode-ready", 1 << 16, self._on_ready, self._item_failed)
        self.cancels = owner.inbox("decode-cancel", 1 << 16, self._on_cancel, self._item_failed)
        self._rl = RateLimitedLog(log)
        self._next_hb = 0.0
        owner.attach(self)

    # ------------------------------------------------------------------ OwnerLoop
    def on_start(self) -> None:
        pass

    def poll(self) -> int:
        return drain_notifications(self._agent, self._codec, self._tm, self._rl, self._on_notif)

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
            self._release_abandoned(ab, "P's lease is over: nothing can land any more")
        for req in self.table.due_for_blocks(now):
            self._allocate_and_register(req)
        for req in self.table.expired(now):
            self._finish_failed(
                req, Failure.DEADLINE, f"no KV after {now - req.t_start:.1f}s", notify_p=True
            )
        if now >= self._next_hb:
            self._next_hb = now + self.cfg.timeouts.heartbeat_s
            self._heartbeat()
        busy = self.table.busy_peers()
        for key in self._hs.idle(self.cfg.timeouts.peer_idle_ttl_s):
            if key not in busy:
                self._evict(key, "idle")

    def drain(self, deadline: float) -> None:
        """Stop: fail what is still waiting (P is told), fail what never reached this thread."""
        for req in self.table.all_waiting():
            self._finish_failed(req, Failure.SHUTTING_DOWN, "D stopped", notify_p=True)
        for item in self._owner.close_inboxes():
            if isinstance(item, DRequest) and item.state is DState.NEW:
                self._pool.allocator.release(item.request_id)
                item.future.set_result(
                    failed_rep(self._tm, item, Failure.SHUTTING_DOWN, "D stopped")
                )

    # ------------------------------------------------------------------ inbox handlers
    def _item_failed(self, item: object, e: Exception) -> None:
        self._tm.fail(Failure.INTERNAL_ERROR)
        log.exception("receiver: handling %r failed", item)
        req = item[0] if isinstance(item, tuple) else item
        if isinstance(req, DRequest) and req.state not in (DState.DONE, DState.ABANDONED):
            self._finish_failed(req, Failure.INTERNAL_ERROR, repr(e))

    def _on_new(self, req: DRequest) -> None:
        self.table.add(req)
        self._connect_and_register(req)

    def _on_cancel(self, request_id: str) -> None:
        req = self.table.waiting(request_id)
        if req is not None:
            self._finish_failed(req, Failure.CANCELLED, "cancelled by D", notify_p=True)

    def _connect_and_register(self, req: DRequest) -> None:
        conn = self._hs.get(req.p_key)
        mode = self.cfg.handshake_mode
        if conn is None or (mode == HandshakeMode.FULL and conn.mode != HandshakeMode.FULL):
            fut = self._hs.ensure(req.p_key, mode, PeerHint(req.p_engine_id, req.p_tp_size))
            if fut is not None:
                req.state = DState.HANDSHAKING
                fut.add_done_callback(lambda f: self._handshake_done(req, f))
                return
            conn = self._hs.get(req.p_key)
        if conn is None:
            self._finish_failed(req, Failure.HANDSHAKE_FAILED, "P not connected after handshake")
            return
        self._register(req, conn)

    def _handshake_done(self, req: DRequest, fut: Future[PeerConn]) -> None:
        """Runs on the handshake thread: hand the request back; never lose it."""
        try:
            item = (req, fut.exception())
        except BaseException as e:
            item = (req, e)
        self._owner.hand_off(
            self.ready,
            item,
            lambda e: self._finish_failed(req, Failure.CALLBACK_ERROR, repr(e)),
        )

    def _on_ready(self, item: tuple[DRequest, BaseException | None]) -> None:
        req, error = item
        if req.state in (DState.DONE, DState.ABANDONED):
            return
        if error is not None:
            self._finish_failed(req, handshake_failure(error, "prefill"), str(error))
            return
        self._connect_and_register(req)

    def _allocate_and_register(self, req: DRequest) -> None:
        """A held-back request's time has come: allocate its blocks, then register them."""
        assert req.p_conn is not None
        try:
            req.block_ids = self._pool.allocator.allocate(req.request_id, req.num_blocks)
        except NoFreeBlocksError as e:
            self._tm.fail(Failure.NO_FREE_BLOCKS)
            self._finish_failed(req, Failure.NO_FREE_BLOCKS, str(e), notify_p=False)
            return
        req.alloc_at = 0.0
        self._register(req, req.p_conn)

    def _register(self, req: DRequest, conn: PeerConn) -> None:
        md = self._md
        req.p_conn = conn
        if req.alloc_at > 0.0:
            # Held in D's queue: P's lease is heartbeated meanwhile, blocks come later.
            req.state = DState.WAITING_BLOCKS
            return
        # One completion per contributing P rank and pipeline stage (vLLM's rule).
        req.expected = req.p_pp_size * max(1, conn.metadata.tp_size // max(1, self.cfg.tp_size))
        reg = protocol.PushReg(
            request_id=req.request_id,
            transfer_id=req.transfer_id,
            decode_engine_id=md.engine_id,
            decode_host=md.host,
            decode_port=md.port,
            decode_tp_size=md.tp_size,
            local_block_ids=[req.block_ids.tolist()],
            remote_engine_id=conn.metadata.engine_id,
            remote_host=req.p_key[0],
            remote_port=req.p_key[1],
            remote_tp_size=conn.metadata.tp_size,
            remote_pp_size=req.p_pp_size,
            decode_incarnation=md.incarnation,
            decode_tp_rank=md.tp_rank,
        )
        try:
            self._agent.send_notif(conn.agent_name, self._codec.encode(reg))
        except TransferError as e:
            if e.kind in ("peer_dead", "peer_unknown") and req.attempts < 1:
                # P restarted or vanished: forget it and handshake afresh once.
                req.attempts += 1
                self._evict(req.p_key, f"PUSH_REG failed: {e.kind}", keep=req.request_id)
                self._connect_and_register(req)
                return
            self._finish_failed(req, Failure.PREFILL_UNREACHABLE, str(e))
            return
        req.state = DState.REGISTERED
        self._tm.inc(Counter.PUSH_REGS_SENT)

    # ------------------------------------------------------------------ notifications
    def _from_p(self, req: DRequest, sender: str) -> bool:
        """Only the P agent a request registered with may complete or fail it."""
        if req.p_conn is not None and req.p_conn.agent_name == sender:
            return True
        self._tm.fail(Failure.FORGED_NOTIF)
        self._rl.warning(
            "forged", "ignored a notification for %s from %s (not its P)", req.request_id, sender
        )
        return False

    def _on_notif(self, sender: str, msg: protocol.Notif) -> None:
        if isinstance(msg, protocol.Completion):
            self._on_completion(sender, msg)
        elif isinstance(msg, protocol.Failure):
            self._on_failure(sender, msg)
        elif isinstance(msg, protocol.Fence):
            self._tm.inc(Counter.FENCES_RECEIVED)
            for rid in msg.request_ids:
                ab = self.table.abandoned(rid)
                if ab is not None and self._from_p(ab, sender):
                    self._release_abandoned(ab, "fenced")
        elif isinstance(msg, protocol.Ping):
            if self._on_ping is not None:
                self._on_ping(sender, msg)
        else:
            self._tm.fail(Failure.UNEXPECTED_NOTIF)

    def _on_completion(self, sender: str, msg: protocol.Completion) -> None:
        req = self.table.waiting(msg.request_id)
        if req is not None:
            if not self._from_p(req, sender):
                return
            req.received += 1
            if req.received >= req.expected:
                self.table.finish(req)
                self._completer.submit(req)
            return
        ab = self.table.abandoned(msg.request_id)
        if ab is not None and self._from_p(ab, sender):
            # The abandoned WRITE completed: its bytes have landed, the blocks are safe.
            self._release_abandoned(ab, "completed late")
            return
        self._tm.fail(Failure.UNKNOWN_COMPLETION)

    def _on_failure(self, sender: str, msg: protocol.Failure) -> None:
        req = self.table.waiting(msg.request_id)
        if req is None:
            ab = self.table.abandoned(msg.request_id)
            if ab is not None and not msg.may_have_written and self._from_p(ab, sender):
                self._release_abandoned(ab, f"P: {msg.reason}")  # e.g. cancel acknowledged
            return
        if not self._from_p(req, sender):
            return
        reason = Failure.parse(msg.reason)
        detail = msg.detail if reason is not None else f"{msg.reason}: {msg.detail}"
        self._finish_failed(
            req,
            reason or Failure.PREFILL_FAILED,
            detail,
            quarantine=msg.may_have_written,
            notify_p=False,
        )

    # ------------------------------------------------------------------ outcomes
    def _finish_failed(
        self,
        req: DRequest,
        reason: Failure,
        detail: str,
        *,
        quarantine: bool = False,
        notify_p: bool = True,
    ) -> None:
        """Fail a request now. Blocks are quarantined when bytes may still land."""
        was_registered = req.state is DState.REGISTERED
        self._tm.fail(reason)
        self._rl.warning(str(reason), "request %s failed (%s): %s", req.request_id, reason, detail)
        if was_registered and notify_p and req.p_conn is not None:
            cancel = protocol.Cancel(
                request_id=req.request_id,
                transfer_id=req.transfer_id,
                decode_host=self.cfg.host,
                decode_port=self._md.port,
                decode_tp_rank=self._md.tp_rank,
            )
            if self._codec.carries(cancel):
                # Tell P to drop it; P's WRITE completion (or fence) tells us when bytes stop.
                with contextlib.suppress(TransferError):
                    self._agent.send_notif(req.p_conn.agent_name, self._codec.encode(cancel))
            else:
                # vLLM's wire has no cancel and no fence: P may still WRITE until its lease,
                # no longer renewed, runs out; only then are these blocks anybody's again.
                t = self.cfg.timeouts
                req.quarantine_until = time.monotonic() + t.lease_s + t.write_base_s
            quarantine = True
        if quarantine and req.p_conn is not None:
            self._pool.allocator.quarantine(req.request_id, reason)
            self.table.abandon(req)
        else:
            self.table.finish(req)
            self._pool.allocator.release(req.request_id)
        req.future.set_result(failed_rep(self._tm, req, reason, detail))

    def _release_abandoned(self, req: DRequest, why: str) -> None:
        self.table.release_abandoned(req)
        self._pool.allocator.release_quarantined(req.request_id)
        self._tm.inc(Counter.QUARANTINE_RELEASED)
        log.debug("blocks of %s released (%s)", req.request_id, why)

    # ------------------------------------------------------------------ heartbeats and peers
    def _heartbeat(self) -> None:
        for conn, tids in self.table.heartbeat_groups():
            for i in range(0, len(tids), HEARTBEAT_BATCH):
                try:
                    self._agent.send_notif(
                        conn.agent_name,
                        self._codec.encode(
                            protocol.Heartbeat(transfer_ids=tids[i : i + HEARTBEAT_BATCH])
                        ),
                    )
                    self._tm.inc(Counter.HEARTBEATS_SENT)
                except TransferError as e:
                    if e.kind == "peer_dead":
                        self._evict(conn.key, "heartbeat failed: P disconnected")
                        break

    def _evict(self, key: PeerKey, reason: str, keep: str = "") -> None:
        """P is gone (or restarted): fail its requests, free its quarantined blocks."""
        conn = self._hs.evict(key, reason)
        waiting, abandoned = self.table.of_peer(key)
        for r in waiting:
            if r.state is DState.REGISTERED and r.request_id != keep:
                r.p_conn = None  # P is gone: nothing can land any more
                self._finish_failed(r, Failure.PREFILL_DEAD, reason, notify_p=False)
        for ab in abandoned:
            self._release_abandoned(ab, "P removed")
        if conn is not None:
            self._hs.release_conn(conn)


def failed_rep(
    telemetry: Telemetry, req: DRequest, reason: Failure, detail: str
) -> protocol.DecodeRep:
    """The answer of a failed request (counted once here)."""
    telemetry.inc(Counter.REQUESTS_FAILED)
    return protocol.DecodeRep(
        transfer_id=req.transfer_id,
        request_id=req.request_id,
        outcome="failed",
        reason=reason,
        detail=detail[:1000],
        latency_s=time.monotonic() - req.t_start,
    )

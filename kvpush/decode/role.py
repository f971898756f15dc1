"""D's role: allocate blocks for a request, let the receiver register them with P, answer.

``decode(order)`` (a ``DecodeOrder``: transfer id, P address, number of blocks...) allocates
blocks (all or nothing; refused at once with ``no_free_blocks``), or holds the request back for
its ``alloc_delay_s`` (capped), and hands it to the receiver (``kvpush.decode.receiver``, on
this role's owner thread); the returned future resolves with a ``DecodeRep`` once the KV has
landed and been verified, or failed with a reason -- it never raises for peer failures. Decode
requests arrive on the side channel; their replies go out when the future resolves.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from kvpush.address import parse_address
from kvpush.config import Role
from kvpush.decode.completer import Completer
from kvpush.decode.limits import MAX_DELAYED_REQUESTS
from kvpush.decode.order import DecodeOrder
from kvpush.decode.outcomes import failed_rep
from kvpush.decode.receiver import Receiver
from kvpush.decode.requests import NO_BLOCKS, Delay, DRequest, PRanks, Waiting
from kvpush.decode.warmup import warm_request_path
from kvpush.errors import KvpushError, NoFreeBlocksError
from kvpush.peers.handshakes import PeerGone
from kvpush.runtime.context import EndpointContext
from kvpush.runtime.owner import OwnerThread
from kvpush.telemetry import phases
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol, vllm

# A request names its P by address; parsing it once per address, not once per request.
_parse_address = functools.lru_cache(maxsize=1024)(parse_address)


class DecodeRole:
    name = Role.DECODE

    def __init__(self, ctx: EndpointContext) -> None:
        self.ctx = ctx
        self.owner = OwnerThread("decode-receiver", ctx.cfg.agent)
        self.completer = Completer(ctx.pool, ctx.telemetry, ctx.cfg.verify)
        self.receiver = Receiver(ctx, self.completer, self.owner)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._delayed_n = 0  # requests given an alloc_delay_s, not answered yet
        self._block_nbytes = ctx.cfg.pool.bytes_per_block_all_regions  # (fixed; read per request)

    def _delayed_done(self, _f: Future[protocol.DecodeRep]) -> None:
        with self._lock:
            self._delayed_n -= 1

    # ------------------------------------------------------------------ RoleWorker
    def start(self) -> None:
        self.owner.start()
        if self.ctx.cfg.prewarm:  # its first request finds the completer's path warm
            ex = self.completer.executor()
            warm_request_path(self.ctx.pool, ex, self.ctx.telemetry, self.ctx.cfg.tp_rank)

    def stop_intake(self, drain_s: float) -> None:
        self._stopping.set()
        deadline = time.monotonic() + drain_s
        # Waiting requests get until the drain deadline to receive their KV.
        while (
            (self.receiver.table.n_waiting or len(self.receiver.new))
            and time.monotonic() < deadline
            and self.owner.alive
        ):
            time.sleep(0.01)

    def stop(self, drain_s: float) -> None:
        self.owner.stop(drain_s)
        self.completer.close()

    def failure(self) -> BaseException | None:
        return self.owner.failure

    def poke(self) -> None:
        self.owner.wake.set()

    def forget_peer(self, gone: PeerGone) -> None:
        with contextlib.suppress(KvpushError):  # closed: the receiver is stopping anyway
            self.receiver.gone.put(gone)

    def declined_by_p(self, msg: protocol.DeclineReq) -> None:
        """P will not serve a request (its side channel said so): the receiver fails it on its
        thread (raises ``KvpushError`` when its inbox is closed: the rank is stopping)."""
        self.receiver.declines.put(msg)

    def set_verify(self, on: bool) -> None:
        """Check every completed request's content against the pattern (``on``), or not (a
        load generator's timed parts run without it)."""
        self.completer.verify = on

    # ------------------------------------------------------------------ API (any thread)
    def decode(
        self, order: DecodeOrder, on_failed: Callable[[protocol.DecodeRep], None] | None = None
    ) -> Future[protocol.DecodeRep]:
        """Register ``order.num_blocks`` blocks with P for its transfer; the future resolves
        with a ``DecodeRep`` (ok, or failed with a reason). See ``DecodeOrder`` for what each
        part of the order does. ``on_failed`` is told a failed answer just before it is out
        (a refused order included; not one the order's form makes bad)."""
        p_addr = _parse_address(order.prefill_address)
        if order.vllm_params is not None and not self.ctx.dialect.kv_transfer_params:
            fut0: Future[protocol.DecodeRep] = Future()
            fut0.set_result(
                protocol.DecodeRep(
                    transfer_id=order.transfer_id,
                    outcome="failed",
                    reason=Failure.BAD_REQUEST,
                    detail="vLLM kv_transfer_params need a D started with --wire vllm",
                )
            )
            return fut0
        w = self._request(order, p_addr, on_failed)
        if self._stopping.is_set():
            return self._refuse(w, Failure.SHUTTING_DOWN, "D is stopping")
        if order.alloc_delay_s > 0:
            return self._delayed(w, order)
        return self._allocated(w, order.num_blocks)

    def _request(
        self,
        order: DecodeOrder,
        p_addr: tuple[str, int],
        on_failed: Callable[[protocol.DecodeRep], None] | None,
    ) -> Waiting:
        """The receiver's request for ``order`` (no blocks yet)."""
        transfer_id, request_id, vp = order.transfer_id, order.request_id, order.vllm_params
        if vp is not None:
            transfer_id = vp.remote_request_id or transfer_id
            request_id = request_id or (
                f"{vllm.base_request_id(transfer_id)}-{secrets.token_hex(4)}"
            )
        cfg = self.ctx.cfg
        t0 = time.monotonic()
        dl = order.deadline_s if order.deadline_s > 0 else cfg.timeouts.request_deadline_s
        if order.alloc_delay_s > 0:
            dl += order.alloc_delay_s  # its deadline counts from its allocation time
        p_tp = max(1, vp.remote_tp_size) if vp is not None else 0
        req = DRequest(
            request_id=request_id or transfer_id,
            transfer_id=transfer_id,
            p_addr=p_addr,
            future=Future(),
            t_start=t0,
            deadline=t0 + dl,
            nbytes=order.num_blocks * self._block_nbytes,
            digest=(order.digest or vp is not None) and not order.hold,
            hold=order.hold,
            p_engine_id=vp.remote_engine_id if vp is not None else "",
            p_tp_size=p_tp or 1,
            p_pp_size=vp.remote_pp_size if vp is not None else 1,
            phases={} if cfg.phase_stamps else None,
            on_failed=on_failed,
        )
        return Waiting(req, PRanks(p_addr, p_tp=p_tp), NO_BLOCKS)

    def _refuse(self, w: Waiting, reason: Failure, detail: str) -> Future[protocol.DecodeRep]:
        w.req.answer(failed_rep(self.ctx.telemetry, w.req, reason, detail))
        return w.req.future

    def _delayed(self, w: Waiting, order: DecodeOrder) -> Future[protocol.DecodeRep]:
        """Held in D's queue for ``alloc_delay_s`` before it gets blocks (capped)."""
        rid = w.req.request_id
        if self.ctx.pool.allocator.state_of(rid) is not None:
            return self._refuse(w, Failure.DUPLICATE_REQUEST, "request id in use")
        with self._lock:
            full = self._delayed_n >= MAX_DELAYED_REQUESTS
            if not full:
                self._delayed_n += 1
        if full:
            self.ctx.telemetry.fail(Failure.TOO_MANY_DELAYED)
            return self._refuse(
                w,
                Failure.TOO_MANY_DELAYED,
                f"{MAX_DELAYED_REQUESTS} requests already wait for their alloc_delay_s",
            )
        w.req.future.add_done_callback(self._delayed_done)
        w.delay = Delay(order.num_blocks, w.req.t_start + order.alloc_delay_s)
        return self._submit(w)

    def _allocated(self, w: Waiting, num_blocks: int) -> Future[protocol.DecodeRep]:
        """Blocks now (all or nothing), then to the receiver."""
        pool, rid = self.ctx.pool, w.req.request_id
        try:
            w.block_ids = pool.allocator.allocate(rid, num_blocks)
        except NoFreeBlocksError as e:
            self.ctx.telemetry.fail(Failure.NO_FREE_BLOCKS)
            return self._refuse(w, Failure.NO_FREE_BLOCKS, str(e))
        except ValueError as e:
            if pool.allocator.state_of(rid) is not None:
                # The id holds blocks: a waiting or quarantined request uses it.
                return self._refuse(w, Failure.DUPLICATE_REQUEST, "request id in use")
            return self._refuse(w, Failure.BAD_REQUEST, str(e))
        phases.stamp(w.req.phases, phases.D_ALLOCATED)
        return self._submit(w)

    def release_held(self, request_id: str) -> None:
        """Free what ``hold`` kept (no-op when it holds nothing)."""
        self.ctx.pool.allocator.release(request_id)

    def _submit(self, w: Waiting) -> Future[protocol.DecodeRep]:
        try:
            self.receiver.new.put(w)
        except KvpushError as e:
            self.ctx.pool.allocator.release(w.req.request_id)
            w.req.answer(failed_rep(self.ctx.telemetry, w.req, Failure.OVERLOADED, str(e)))
        return w.req.future

    def cancel(self, request_id: str) -> None:
        """Abort a waiting request (D-side abort). If its PUSH_REG went out, P is told to drop
        it and the blocks stay quarantined until P's WRITE completion or fence says no more
        bytes can land (vLLM's C1: never hand them to the next request before)."""
        self.receiver.cancels.put(request_id)

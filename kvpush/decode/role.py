"""D's role: allocate blocks for a request, let the receiver register them with P, answer.

``decode(transfer_id, P address, num_blocks)`` allocates blocks (all or nothing; refused at once
with ``no_free_blocks``) and hands the request to the receiver (``kvpush.decode.receiver``, on
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
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kvpush.address import parse_address
from kvpush.decode.completer import Completer
from kvpush.decode.limits import MAX_DELAYED_REQUESTS
from kvpush.decode.outcomes import failed_rep
from kvpush.decode.receiver import Receiver
from kvpush.decode.requests import DRequest
from kvpush.errors import KvpushError, NoFreeBlocksError
from kvpush.peers.handshakes import PeerGone
from kvpush.runtime.context import EndpointContext
from kvpush.runtime.owner import OwnerThread
from kvpush.telemetry import phases
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol, vllm


@dataclass(frozen=True)
class VllmLeg:
    """The parts of a vLLM P's ``kv_transfer_params`` a D request needs."""

    remote_engine_id: str
    remote_request_id: str
    remote_tp_size: int = 1
    remote_pp_size: int = 1


# A request names its P by address; parsing it once per address, not once per request.
_parse_address = functools.lru_cache(maxsize=1024)(parse_address)


class DecodeRole:
    name = "decode"

    def __init__(self, ctx: EndpointContext) -> None:
        self.ctx = ctx
        self.owner = OwnerThread("decode-receiver", ctx.cfg.agent)
        self.completer = Completer(ctx.pool, ctx.telemetry, ctx.cfg.verify)
        self.receiver = Receiver(
            ctx.cfg,
            ctx.agent,
            ctx.pool,
            ctx.handshakes,
            ctx.codec,
            ctx.telemetry,
            ctx.metadata,
            self.completer,
            self.owner,
            on_ping=ctx.on_ping,
            peer_tp=ctx.peer_tp,
            dialect=ctx.dialect,
        )
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._delayed = 0  # requests given an alloc_delay_s, not answered yet

    def _delayed_done(self, _f: Future[protocol.DecodeRep]) -> None:
        with self._lock:
            self._delayed -= 1

    # ------------------------------------------------------------------ Role
    def start(self) -> None:
        self.owner.start()

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

    # ------------------------------------------------------------------ API (any thread)
    def decode(
        self,
        transfer_id: str,
        prefill_address: str,
        num_blocks: int,
        deadline_s: float = 0.0,
        request_id: str = "",
        vllm_params: VllmLeg | None = None,
        digest: bool = False,
        alloc_delay_s: float = 0.0,
        hold: bool = False,
    ) -> Future[protocol.DecodeRep]:
        """Register ``num_blocks`` blocks with P for ``transfer_id``; the future resolves with a
        ``DecodeRep`` (ok, or failed with a reason).

        ``vllm_params``: a vLLM P's coordinates from its ``kv_transfer_params``; D's request id
        then shares the base of P's (``<base>-<8 hex>``, how vLLM matches them) and
        ``transfer_id`` is P's request id (what heartbeats name).

        ``alloc_delay_s``: hold the request that long before it gets blocks, as a vLLM request
        waits in D's scheduler queue; D connects to P and heartbeats its lease meanwhile.

        ``hold``: an ok answer keeps the blocks (no digest here): the rank group digests
        every rank's share, then frees them (``release_held``)."""
        p_addr = _parse_address(prefill_address)
        if vllm_params is not None:
            if not self.ctx.dialect.kv_transfer_params:
                fut0: Future[protocol.DecodeRep] = Future()
                fut0.set_result(
                    protocol.DecodeRep(
                        transfer_id=transfer_id,
                        outcome="failed",
                        reason=Failure.BAD_REQUEST,
                        detail="vLLM kv_transfer_params need a D started with --wire vllm",
                    )
                )
                return fut0
            transfer_id = vllm_params.remote_request_id or transfer_id
            request_id = request_id or (
                f"{vllm.base_request_id(transfer_id)}-{secrets.token_hex(4)}"
            )
        rid = request_id or transfer_id
        cfg, pool, tm = self.ctx.cfg, self.ctx.pool, self.ctx.telemetry
        fut: Future[protocol.DecodeRep] = Future()
        t0 = time.monotonic()
        dl = deadline_s if deadline_s > 0 else cfg.timeouts.request_deadline_s
        req = DRequest(
            request_id=rid,
            transfer_id=transfer_id,
            p_addr=p_addr,
            block_ids=np.empty(0, dtype=np.int64),
            future=fut,
            t_start=t0,
            deadline=t0 + dl,
            nbytes=num_blocks * cfg.pool.bytes_per_block_all_regions,
            digest=(digest or vllm_params is not None) and not hold,
            hold=hold,
            phases={} if cfg.phase_stamps else None,
        )
        if vllm_params is not None:
            req.p_engine_id = vllm_params.remote_engine_id
            req.p_tp_size = req.p_tp = max(1, vllm_params.remote_tp_size)
            req.p_pp_size = vllm_params.remote_pp_size

        def refuse(reason: Failure, detail: str) -> Future[protocol.DecodeRep]:
            fut.set_result(failed_rep(tm, req, reason, detail))
            return fut

        if self._stopping.is_set():
            return refuse(Failure.SHUTTING_DOWN, "D is stopping")
        if alloc_delay_s > 0:
            if pool.allocator.state_of(rid) is not None:
                return refuse(Failure.DUPLICATE_REQUEST, "request id in use")
            with self._lock:
                if self._delayed >= MAX_DELAYED_REQUESTS:
                    full = True
                else:
                    full = False
                    self._delayed += 1
            if full:
                tm.fail(Failure.TOO_MANY_DELAYED)
                return refuse(
                    Failure.TOO_MANY_DELAYED,
                    f"{MAX_DELAYED_REQUESTS} requests already wait for their alloc_delay_s",
                )
            fut.add_done_callback(self._delayed_done)
            req.num_blocks = num_blocks
            req.alloc_at = t0 + alloc_delay_s
            req.deadline += alloc_delay_s
            return self._submit(req)
        try:
            req.block_ids = pool.allocator.allocate(rid, num_blocks)
        except NoFreeBlocksError as e:
            tm.fail(Failure.NO_FREE_BLOCKS)
            return refuse(Failure.NO_FREE_BLOCKS, str(e))
        except ValueError as e:
            if pool.allocator.state_of(rid) is not None:
                # The id holds blocks: a waiting or quarantined request uses it.
                return refuse(Failure.DUPLICATE_REQUEST, "request id in use")
            return refuse(Failure.BAD_REQUEST, str(e))
        phases.stamp(req.phases, phases.D_ALLOCATED)
        return self._submit(req)

    def held_blocks(self, request_id: str) -> np.ndarray:
        """The blocks an ok request answered with ``hold`` still keeps (empty: none)."""
        return self.ctx.pool.allocator.blocks_of(request_id)

    def release_held(self, request_id: str) -> None:
        """Free what ``hold`` kept (no-op when it holds nothing)."""
        self.ctx.pool.allocator.release(request_id)

    def _submit(self, req: DRequest) -> Future[protocol.DecodeRep]:
        try:
            self.receiver.new.put(req)
        except KvpushError as e:
            self.ctx.pool.allocator.release(req.request_id)
            req.future.set_result(failed_rep(self.ctx.telemetry, req, Failure.OVERLOADED, str(e)))
        return req.future

    def cancel(self, request_id: str) -> None:
        """Abort a waiting request (D-side abort). If its PUSH_REG went out, P is told to drop
        it and the blocks stay quarantined until P's WRITE completion or fence says no more
        bytes can land (vLLM's C1: never hand them to the next request before)."""
        self.receiver.cancels.put(request_id)

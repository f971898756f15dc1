"""P's role: fill blocks for a transfer and push them with the writer.

``prefill(transfer_id, num_blocks)`` stands in for the model: it allocates blocks, writes the
transfer's deterministic pattern into them and hands them to the writer as *finished*; the
writer (``kvpush.prefill.writer``, on this role's owner thread) does everything else. Prefill
requests arrive on the side channel and run on the endpoint's control executor, because filling
blocks takes a while.
"""

from __future__ import annotations

import logging
import threading
import time

from kvpush.errors import KvpushError, NoFreeBlocksError, ShuttingDownError
from kvpush.prefill.table import Finished
from kvpush.prefill.writer import PushWriter
from kvpush.runtime.context import EndpointContext
from kvpush.runtime.owner import OwnerThread
from kvpush.telemetry.names import Counter, Failure
from kvpush.transport.sidechannel import ReplyFn
from kvpush.wire import protocol

log = logging.getLogger(__name__)


class PrefillRole:
    name = "prefill"

    def __init__(self, ctx: EndpointContext) -> None:
        self.ctx = ctx
        self.owner = OwnerThread("push-writer", ctx.cfg.agent)
        self.writer = PushWriter(
            ctx.cfg,
            ctx.agent,
            ctx.pool,
            ctx.handshakes,
            ctx.codec,
            ctx.telemetry,
            self.owner,
            on_ping=ctx.on_ping,
        )
        self._stopping = threading.Event()

    # ------------------------------------------------------------------ Role
    def start(self) -> None:
        self.owner.start()

    def handle(self, req: protocol.SideRequest, reply: ReplyFn) -> bool:
        if isinstance(req, protocol.PrefillReq):
            self.ctx.control.submit(self._serve_prefill, req, reply)
            return True
        return False

    def stop_intake(self, drain_s: float) -> None:
        self._stopping.set()

    def stop(self, drain_s: float) -> None:
        self.owner.stop(drain_s)

    def failure(self) -> BaseException | None:
        return self.owner.failure

    def poke(self) -> None:
        self.owner.wake.set()

    # ------------------------------------------------------------------ API (any thread)
    def prefill(self, transfer_id: str, num_blocks: int, request_id: str = "") -> None:
        """Fill ``num_blocks`` blocks with the transfer's pattern and mark them finished."""
        if self._stopping.is_set():
            raise ShuttingDownError("prefill endpoint is shutting down")
        if not transfer_id:
            raise KvpushError("transfer id is empty", "pass a non-empty transfer id")
        pool, tm = self.ctx.pool, self.ctx.telemetry
        try:
            ids = pool.allocator.allocate(transfer_id, num_blocks)
        except NoFreeBlocksError:
            tm.fail(Failure.NO_FREE_BLOCKS)
            raise
        except ValueError as e:
            raise KvpushError(f"cannot prefill {transfer_id}: {e}") from None
        try:
            pool.fill(transfer_id, ids)
            self.writer.finished.put(
                Finished(transfer_id, transfer_id, request_id or transfer_id, ids, time.monotonic())
            )
        except BaseException:
            pool.allocator.release(transfer_id)
            raise
        tm.inc(Counter.PREFILLS)

    def _serve_prefill(self, req: protocol.PrefillReq, reply: ReplyFn) -> None:
        t0 = time.perf_counter()
        try:
            self.prefill(req.transfer_id, req.num_blocks, req.request_id)
        except KvpushError as e:
            reason = "no_free_blocks" if isinstance(e, NoFreeBlocksError) else type(e).__name__
            reply(
                protocol.PrefillRep(
                    rid=req.rid, transfer_id=req.transfer_id, outcome="failed", reason=reason[:256]
                )
            )
            return
        except Exception as e:
            log.exception("prefill %s failed", req.transfer_id)
            reply(
                protocol.PrefillRep(
                    rid=req.rid,
                    transfer_id=req.transfer_id,
                    outcome="failed",
                    reason=f"internal_error: {e}"[:256],
                )
            )
            return
        reply(
            protocol.PrefillRep(
                rid=req.rid,
                transfer_id=req.transfer_id,
                outcome="ok",
                latency_s=time.perf_counter() - t0,
            )
        )

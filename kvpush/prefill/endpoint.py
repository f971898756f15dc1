"""The prefill (P) endpoint: fills blocks for a transfer and pushes them with the writer.

``prefill(transfer_id, num_blocks)`` stands in for the model: it allocates blocks, writes the
transfer's deterministic pattern into them and hands them to the writer as *finished*. The
writer thread (``kvpush.prefill.writer``) does everything else. Control requests arrive on the side
channel and run on the control executor, because filling blocks takes a while.
"""

from __future__ import annotations

import logging
import time

from kvpush.endpoint.core import Endpoint
from kvpush.errors import KvpushError, NoFreeBlocksError, ShuttingDownError
from kvpush.prefill.matching import Finished
from kvpush.prefill.writer import PushWriter
from kvpush.transport.sidechannel import ReplyFn
from kvpush.wire import protocol

log = logging.getLogger(__name__)


class PrefillEndpoint(Endpoint):
    role = "prefill"

    writer: PushWriter

    def _start_role(self) -> None:
        assert self.agent and self.pool and self.handshakes
        self.writer = PushWriter(
            self.cfg,
            self.agent,
            self.pool,
            self.handshakes,
            self.codec,
            self.telemetry,
            on_ping=self._on_ping,
        )
        self.writer.start()

    def prefill(self, transfer_id: str, num_blocks: int, request_id: str = "") -> None:
        """Fill ``num_blocks`` blocks with the transfer's pattern and mark them finished."""
        if self._stopping.is_set():
            raise ShuttingDownError("prefill endpoint is shutting down")
        if not transfer_id:
            raise KvpushError("transfer id is empty", "pass a non-empty transfer id")
        assert self.pool is not None
        try:
            ids = self.pool.allocator.allocate(transfer_id, num_blocks)
        except NoFreeBlocksError:
            self.telemetry.fail("no_free_blocks")
            raise
        except ValueError as e:
            raise KvpushError(f"cannot prefill {transfer_id}: {e}") from None
        try:
            self.pool.fill(transfer_id, ids)
            self.writer.submit_finished(
                Finished(transfer_id, transfer_id, request_id or transfer_id, ids, time.monotonic())
            )
        except BaseException:
            self.pool.allocator.release(transfer_id)
            raise
        self.telemetry.inc("prefills")

    def _handle_role_request(self, req: protocol.SideRequest, reply: ReplyFn) -> None:
        if isinstance(req, protocol.PrefillReq):
            self._control.submit(self._serve_prefill, req, reply)
            return
        super()._handle_role_request(req, reply)

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

    def _poke_owner(self) -> None:
        self.writer.wake.set()

    def _stop_role(self, drain_s: float) -> None:
        if hasattr(self, "writer"):
            self.writer.stop(drain_s)

    def _role_failure(self) -> BaseException | None:
        return self.writer.failure if hasattr(self, "writer") else None

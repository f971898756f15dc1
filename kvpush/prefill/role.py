"""P's role: fill blocks for a transfer and push them with the writer.

``prefill(transfer_id, num_blocks)`` stands in for the model: it allocates blocks, writes the
transfer's deterministic pattern into them and hands them to the writer as *finished*; the
writer (``kvpush.prefill.writer``, on this role's owner thread) does everything else. Prefill
requests arrive on the side channel and run on the endpoint's control executor, because filling
blocks takes a while. ``watch(transfer_id)`` resolves when that transfer's push ends (WRITE
done, failed, or lease lapsed): the writer reports every outcome here, and the last few thousand
are kept for a ``PushWaitReq`` that comes late. On vLLM's wire the prefill answer also carries
the ``kv_transfer_params`` a vLLM D needs (what a vLLM P's ``request_finished`` returns).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import TypeVar

from kvpush.config import Wire
from kvpush.errors import KvpushError, NoFreeBlocksError, ShuttingDownError
from kvpush.prefill.table import Finished, PushOutcome, transfer_key
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
            on_outcome=self._outcome,
        )
        self._stopping = threading.Event()
        self._vllm = ctx.cfg.wire == Wire.VLLM
        self._lock = threading.Lock()
        self._watches: dict[str, Future[PushOutcome]] = {}
        self._recent: OrderedDict[str, PushOutcome] = OrderedDict()
        self._digests: OrderedDict[str, str] = OrderedDict()

    # ------------------------------------------------------------------ Role
    def start(self) -> None:
        self.owner.start()

    def handle(self, req: protocol.SideRequest, reply: ReplyFn) -> bool:
        if isinstance(req, protocol.PrefillReq):
            self.ctx.control.submit(self._serve_prefill, req, reply)
            return True
        if isinstance(req, protocol.PushWaitReq):
            self._serve_wait(req, reply)
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
    def prefill(
        self, transfer_id: str, num_blocks: int, request_id: str = "", digest: bool = False
    ) -> tuple[list[int], str]:
        """Fill ``num_blocks`` blocks with the transfer's pattern and mark them finished; return
        the block ids and the sha256 of the filled bytes when ``digest`` (else "")."""
        if self._stopping.is_set():
            raise ShuttingDownError("prefill endpoint is shutting down")
        if not transfer_id:
            raise KvpushError("transfer id is empty", "pass a non-empty transfer id")
        pool, tm = self.ctx.pool, self.ctx.telemetry
        key = transfer_key(transfer_id, self._vllm)  # the writer's table key owns the blocks
        try:
            ids = pool.allocator.allocate(key, num_blocks)
        except NoFreeBlocksError:
            tm.fail(Failure.NO_FREE_BLOCKS)
            raise
        except ValueError as e:
            raise KvpushError(f"cannot prefill {transfer_id}: {e}") from None
        sha = ""
        try:
            pool.fill(transfer_id, ids)
            if digest:
                sha = pool.digest(ids)
                with self._lock:
                    _remember(self._digests, transfer_id, sha)
            rid = request_id or transfer_id
            self.writer.finished.put(Finished(key, transfer_id, rid, ids, time.monotonic()))
        except BaseException:
            pool.allocator.release(key)
            raise
        tm.inc(Counter.PREFILLS)
        return ids.tolist(), sha

    # ------------------------------------------------------------------ outcomes
    def watch(self, transfer_id: str) -> Future[PushOutcome]:
        """A future resolved with the push outcome of ``transfer_id`` (at once if it ended)."""
        with self._lock:
            done = self._recent.get(transfer_id)
            if done is not None:
                fut: Future[PushOutcome] = Future()
                fut.set_result(done)
                return fut
            return self._watches.setdefault(transfer_id, Future())

    def _outcome(self, outcome: PushOutcome) -> None:
        """Writer thread: remember the outcome, resolve whoever waits for it."""
        with self._lock:
            _remember(self._recent, outcome.transfer_id, outcome)
            fut = self._watches.pop(outcome.transfer_id, None)
        if fut is not None and not fut.done():
            fut.set_result(outcome)

    def _serve_wait(self, req: protocol.PushWaitReq, reply: ReplyFn) -> None:
        fut = self.watch(req.transfer_id)
        timer = threading.Timer(max(0.0, req.timeout_s), lambda: answer(None))
        timer.daemon = True
        sent = threading.Event()

        def answer(f: Future[PushOutcome] | None) -> None:
            if sent.is_set():
                return
            sent.set()
            timer.cancel()
            with self._lock:
                sha = self._digests.get(req.transfer_id, "")
            if f is None or not f.done():
                reply(
                    protocol.PushWaitRep(
                        rid=req.rid, transfer_id=req.transfer_id, outcome="pending"
                    )
                )
                return
            o = f.result()
            reply(
                protocol.PushWaitRep(
                    rid=req.rid,
                    transfer_id=req.transfer_id,
                    outcome="ok" if o.ok else "failed",
                    reason=o.reason,
                    detail=o.detail[:1000],
                    nbytes=o.nbytes,
                    sha256=sha if o.ok else "",
                )
            )

        timer.start()
        fut.add_done_callback(answer)

    def kv_transfer_params(
        self, request_id: str, block_ids: list[int]
    ) -> dict[str, str | int | bool | list[list[int]]]:
        """What a vLLM P's ``request_finished`` returns for the router to hand to D."""
        md = self.ctx.metadata
        return {
            "remote_block_ids": [block_ids],
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": md.engine_id,
            "remote_request_id": request_id,
            "remote_host": md.host,
            "remote_port": md.port,
            "tp_size": md.tp_size,
            "pp_size": 1,
            "transfer_mode": "push",
        }

    def _serve_prefill(self, req: protocol.PrefillReq, reply: ReplyFn) -> None:
        t0 = time.perf_counter()
        try:
            ids, sha = self.prefill(req.transfer_id, req.num_blocks, req.request_id, req.digest)
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
                sha256=sha,
                kv_transfer_params=(
                    self.kv_transfer_params(req.transfer_id, ids) if self._vllm else {}
                ),
            )
        )


_V = TypeVar("_V")
RECENT = 4096  # outcomes and digests kept for late PushWaitReqs


def _remember(d: OrderedDict[str, _V], key: str, value: _V) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > RECENT:
        d.popitem(last=False)

"""D's outcomes: how a request ends when it fails, and when its quarantined blocks come back.

A failed request answers its caller at once (``failed_rep``). Its blocks go back to the pool
only when no P rank it registered with can still write into them: P ranks known to write
nothing more are *settled*; every other one is told (``Cancel``) and the blocks stay
quarantined (never handed to another request: vLLM's C1) until each has fenced, completed late
or is gone. On vLLM's wire there is no cancel and no fence: the blocks wait for P's lease,
no longer renewed, to run out.

Thread: the receiver's owner thread (``Receiver`` calls it); ``failed_rep`` from any thread.
Logs under its own name (``kvpush.decode.outcomes``): each failed request, rate-limited per
reason, and each quarantine released (debug).
"""

from __future__ import annotations

import contextlib
import logging
import time

from kvpush.decode.completer import answered
from kvpush.decode.requests import Abandoned, DRequest, RequestTable, Waiting
from kvpush.ratelog import RateLimitedLog
from kvpush.runtime.context import EndpointContext
from kvpush.telemetry.names import Counter, Failure
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import TransferError
from kvpush.wire import protocol

log = logging.getLogger(__name__)


class Outcomes:
    def __init__(self, ctx: EndpointContext, table: RequestTable) -> None:
        # ``ctx.dialect``: whether P is told with a Cancel, or its lease is waited out.
        self._ctx = ctx
        self._table = table
        self._rl = RateLimitedLog(log)

    def fail(
        self,
        w: Waiting,
        reason: Failure,
        detail: str,
        *,
        notify_p: bool = True,
        settled: set[int] | None = None,
        told: set[int] | None = None,
    ) -> None:
        """Fail a request now. Its blocks stay quarantined while a P rank it registered with
        may still write (``settled``: ranks known to write nothing more; ``told``: ranks that
        need no Cancel); every other registered rank is told to drop it."""
        req = w.req
        self._ctx.telemetry.fail(reason)
        self._rl.warning(str(reason), "request %s failed (%s): %s", req.request_id, reason, detail)
        done = {s for s, n in w.completions.items() if n >= req.p_pp_size}
        live = w.registered - done - (settled or set())
        until: float | None = None  # the quarantine's time limit (None: until fenced)
        if live:
            cancel = protocol.Cancel(
                request_id=req.request_id,
                transfer_id=req.transfer_id,
                decode_host=self._ctx.cfg.host,
                decode_port=self._ctx.metadata.port,
                decode_tp_rank=self._ctx.metadata.tp_rank,
                decode_incarnation=self._ctx.incarnation,
            )
            held = self._ctx.dialect.abandoned_until(time.monotonic(), self._ctx.cfg.timeouts)
            if held is None:
                # Tell P to drop it; P's WRITE completion (or fence) tells us when bytes stop.
                if notify_p:
                    data = self._ctx.codec.encode(cancel)
                    for s in live - (told or set()):
                        with contextlib.suppress(TransferError):
                            self._ctx.agent.send_notif(w.ranks.conns[s].agent_name, data)
            else:
                # vLLM's wire has no cancel and no fence: P may still WRITE until its lease,
                # no longer renewed, runs out; only then are these blocks anybody's again.
                until = held
        if live:
            self._ctx.pool.allocator.quarantine(req.request_id, reason)
            self._table.abandon(w, live, until)
        else:
            self._table.finish(w)
            self._ctx.pool.allocator.release(req.request_id)
        req.answer(failed_rep(self._ctx.telemetry, req, reason, detail))

    def settle_abandoned(self, ab: Abandoned, source: int, why: str) -> None:
        """P rank ``source`` can write nothing more into an abandoned request's blocks; the
        last such rank frees them."""
        ab.outstanding.discard(source)
        if not ab.outstanding:
            self.release_abandoned(ab, why)

    def release_abandoned(self, ab: Abandoned, why: str) -> None:
        self._table.release_abandoned(ab)
        self._ctx.pool.allocator.release_quarantined(ab.req.request_id)
        self._ctx.telemetry.inc(Counter.QUARANTINE_RELEASED)
        log.debug("blocks of %s released (%s)", ab.req.request_id, why)


def failed_rep(
    telemetry: Telemetry, req: DRequest, reason: Failure, detail: str
) -> protocol.DecodeRep:
    """The answer of a failed request (counted once here)."""
    telemetry.inc(Counter.REQUESTS_FAILED)
    rep = protocol.DecodeRep(
        transfer_id=req.transfer_id,
        request_id=req.request_id,
        outcome="failed",
        reason=reason,
        detail=detail[:1000],
        latency_s=time.monotonic() - req.t_start,
        phases=answered(telemetry, req, observe=False),
    )
    return rep

"""P's traces: the span of each traced prefill request, from the stamps P already takes.

``PrefillSpans`` (one per endpoint, when ``--otlp-traces-endpoint`` is on) is told when a
``PrefillReq`` arrives (``traced``: the caller's W3C sampling decision, and the wall-clock
time), when P refused it (``refused``) or when its blocks went to the writers (``filled``): it
then watches the transfer's push on every rank (``PrefillRole.watch``) and, when the last one
ended, hands the request to ``kvpush.telemetry.tracing`` -- an append, on the writer's thread,
and nothing more. On the tracing thread, ``prefill_span`` builds the ``kvpush.prefill`` server
span, a child of the request's ``traceparent``: one child span per step between P's stamps
(fill, match_wait, handshake_wait, post, write; ``PushOutcome.phases``), ``kvpush.*``
attributes (the D it was written to among them); a failed push has error status, its reason
and detail, and its last step is the push it failed in.

One transfer is one push, written by its own WRITEs (one per target D rank): kvpush never
batches several requests into one WRITE, so no span needs links to several traces.

Threads: ``traced`` on the side-channel thread; ``refused``/``filled`` on the control executor;
the watch callbacks on the writers' threads; ``prefill_span`` on the tracing thread.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future

from kvpush.address import format_address
from kvpush.prefill.records import PushOutcome
from kvpush.prefill.role import PrefillRole
from kvpush.telemetry import phases
from kvpush.telemetry.tracing import Tracing, for_endpoint
from kvpush.telemetry.tracing.spans import (
    BLOCKS_FINISHED,
    P_CHAIN,
    P_PUSH,
    PREFILL,
    AttrValue,
    SpanSpec,
    attributes,
    endpoint_attrs,
    steps,
)
from kvpush.wire import protocol


class PrefillSpans:
    def __init__(self, tracing: Tracing, roles: list[PrefillRole]) -> None:
        self.tracing = tracing
        self._roles = roles
        ctx = roles[0].ctx
        cfg = ctx.cfg
        address = format_address(cfg.host, ctx.metadata.port)
        self._about = endpoint_attrs(cfg.role, cfg.engine_id, address, cfg.tp_size, cfg.wire)
        self._linger_s = cfg.timeouts.drain_s + 1.0

    @classmethod
    def of(cls, roles: list[PrefillRole]) -> PrefillSpans | None:
        """The endpoint's, when its tracing is on (its drops counted on rank 0)."""
        ctx = roles[0].ctx
        tr = for_endpoint(ctx.cfg, ctx.telemetry)
        return cls(tr, roles) if tr is not None else None

    def traced(self, req: protocol.PrefillReq) -> float:
        """When a traced request arrived (wall clock); 0.0 when it is not traced."""
        return time.time() if self.tracing.wants(req.traceparent) else 0.0

    def refused(self, req: protocol.PrefillReq, t0: float, reason: str, detail: str) -> None:
        """P refused the request: its span ends now, failed."""
        build = functools.partial(
            prefill_span, self._about, req, t0, time.time(), None, time.time(), reason, detail
        )
        self.tracing.server(build, 2)

    def filled(self, req: protocol.PrefillReq, t0: float) -> None:
        """Its blocks went to the writers: the span ends when the push ended on every rank."""
        t_filled = time.time()
        futs = [role.watch(req.transfer_id) for role in self._roles]
        left = [len(futs)]
        lock = threading.Lock()

        def one(_f: Future[PushOutcome]) -> None:  # a writer's thread: count, hand over
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                outs = [f.result() for f in futs]
                build = functools.partial(
                    prefill_span, self._about, req, t0, t_filled, outs, time.time()
                )
                self.tracing.server(build, 2 + len(P_CHAIN))

        for f in futs:
            f.add_done_callback(one)

    def close(self) -> None:
        """The endpoint stops: pushes still ending during its drain are traced too."""
        self.tracing.close(linger_s=self._linger_s)


def prefill_span(
    about: dict[str, AttrValue],
    req: protocol.PrefillReq,
    t0: float,
    t_filled: float,
    outs: list[PushOutcome] | None,
    t1: float,
    reason: str = "",
    detail: str = "",
) -> SpanSpec:
    """The ``kvpush.prefill`` span of one request (the tracing thread): refused (``outs`` None:
    ``reason``, ``detail``), or its push on every rank (``outs``: ok only when all are)."""
    stamps: dict[str, float] = {}
    nbytes = 0
    peer: tuple[str, int, int] | None = None
    if outs is not None:
        stamps = phases.merge(o.phases for o in outs)
        stamps[BLOCKS_FINISHED] = t_filled
        nbytes = sum(o.nbytes for o in outs)
        bad = [(r, o) for r, o in enumerate(outs) if not o.ok]
        if bad:
            r, o = bad[0]
            reason = o.reason or "failed"
            detail = o.detail if len(outs) == 1 else f"rank {r}: {o.detail}"
        peer = next((o.peer for o in outs if o.peer is not None), None)
    error = reason
    # A failed push carries no stamps past its blocks: its last step is the push itself (a
    # refused request's is the fill it never finished).
    pushed = any(k != BLOCKS_FINISHED for k in stamps)
    attrs = attributes(
        {
            **about,
            "kvpush.transfer_id": req.transfer_id,
            "kvpush.request_id": req.request_id,
            "kvpush.blocks": req.num_blocks,
            "kvpush.bytes": nbytes,
            "kvpush.outcome": "failed" if error else "ok",
            "kvpush.reason": error,
            "kvpush.peer": format_address(peer[0], peer[1]) if peer else "",
            "kvpush.peer_rank": peer[2] if peer else None,
        }
    )
    return SpanSpec(
        PREFILL,
        t0,
        t1,
        attrs,
        steps(P_CHAIN, t0, stamps, t1, error, P_PUSH if outs is not None and not pushed else ""),
        error=error,
        detail=detail,
        traceparent=req.traceparent,
        tracestate=req.tracestate,
    )

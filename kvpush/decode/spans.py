"""D's traces: the span of each traced decode request, from the stamps it already carries.

``DecodeSpans`` (one per endpoint, when ``--otlp-traces-endpoint`` is on) is told when a
``DecodeReq`` arrives (``traced``: the caller's W3C sampling decision, and the wall-clock time)
and when its answer went out (``answered``: a hand-off to ``kvpush.telemetry.tracing``, nothing
more). On the tracing thread, ``decode_span`` builds the request's ``kvpush.decode`` server span,
a child of the ``traceparent`` the request carried, with one child span per step between D's
phase stamps (``DecodeRep.phases``: allocate, register, push_wait, verify, answer) and
``kvpush.*`` attributes; a failed request's span has error status, its reason and detail, and
ends with the step it failed in.

Threads: ``traced`` on the side-channel thread, ``answered`` on whichever thread resolved the
request (the receiver's or the completer's), ``decode_span`` on the tracing thread.
"""

from __future__ import annotations

import functools
import time

from kvpush.address import format_address
from kvpush.runtime.context import EndpointContext
from kvpush.telemetry import phases as ph
from kvpush.telemetry.tracing import Tracing, for_endpoint
from kvpush.telemetry.tracing.spans import (
    D_CHAIN,
    DECODE,
    AttrValue,
    SpanSpec,
    attributes,
    endpoint_attrs,
    steps,
)
from kvpush.wire import protocol


class DecodeSpans:
    def __init__(self, tracing: Tracing, ctx: EndpointContext) -> None:
        self.tracing = tracing
        cfg = ctx.cfg
        address = format_address(cfg.host, ctx.metadata.port)
        self._about = endpoint_attrs(cfg.role, cfg.engine_id, address, cfg.tp_size, cfg.wire)
        self._linger_s = cfg.timeouts.drain_s + 1.0

    @classmethod
    def of(cls, ctx: EndpointContext) -> DecodeSpans | None:
        """The endpoint's, when its tracing is on (its drops counted on rank 0)."""
        tr = for_endpoint(ctx.cfg, ctx.telemetry)
        return cls(tr, ctx) if tr is not None else None

    def traced(self, req: protocol.DecodeReq) -> float:
        """When a traced request arrived (wall clock); 0.0 when it is not traced."""
        return time.time() if self.tracing.wants(req.traceparent) else 0.0

    def answered(self, req: protocol.DecodeReq, t0: float, rep: protocol.DecodeRep) -> None:
        build = functools.partial(decode_span, self._about, req, rep, t0, time.time())
        self.tracing.server(build, 1 + len(rep.phases))

    def close(self) -> None:
        """The endpoint stops: requests still settling during its drain are traced too."""
        self.tracing.close(linger_s=self._linger_s)


def decode_span(
    about: dict[str, AttrValue],
    req: protocol.DecodeReq,
    rep: protocol.DecodeRep,
    t0: float,
    t1: float,
) -> SpanSpec:
    """The ``kvpush.decode`` span of one request (the tracing thread): it ends when D
    answered (its stamp; else when the answer was handed to the tracer, ``t1``)."""
    error = (rep.reason or "failed") if rep.outcome != "ok" else ""
    t1 = rep.phases.get(ph.ANSWERED, t1)
    attrs = attributes(
        {
            **about,
            "kvpush.transfer_id": rep.transfer_id or req.transfer_id,
            "kvpush.request_id": rep.request_id or req.request_id,
            "kvpush.peer": format_address(req.prefill_host, req.prefill_port),
            "kvpush.blocks": req.num_blocks,
            "kvpush.bytes": rep.nbytes,
            "kvpush.outcome": rep.outcome,
            "kvpush.reason": rep.reason,
            "kvpush.verified": rep.verified,
        }
    )
    return SpanSpec(
        DECODE,
        t0,
        t1,
        attrs,
        steps(D_CHAIN, t0, rep.phases, t1, error),
        error=error,
        detail=rep.detail,
        traceparent=req.traceparent,
        tracestate=req.tracestate,
    )

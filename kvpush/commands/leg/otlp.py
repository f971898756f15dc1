"""The trace options of the client commands (``leg``, ``drive``) and a leg's own span.

Owns the ``--otlp-traces-endpoint``, ``--otlp-sample-ratio`` and ``--traceparent`` options
(``drive`` takes the first two from here), ``traces`` (the options -> a checked
``TracingConfig``, the SDK's presence checked when tracing is on) and ``LegSpan``: ``leg``'s
``kvpush.request`` client span -- a child of ``--traceparent`` when given (a router's trace),
else a new trace -- whose W3C context the leg's request carries, so the endpoint's server span
joins it. Without ``--otlp-traces-endpoint`` a ``--traceparent`` goes to the endpoint as it is.
Runs on the main thread (the span work on the tracing thread).
"""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING, Annotated

from kvpush.commands.common.optspec import option
from kvpush.config import TracingConfig
from kvpush.telemetry import tracing
from kvpush.telemetry.tracing.spans import REQUEST, SpanSpec, attributes

if TYPE_CHECKING:
    from kvpush.commands.leg.legs import LegReport
    from kvpush.telemetry.tracing.otel import ClientSpan

Endpoint = Annotated[
    str | None,
    option("--otlp-traces-endpoint", help=tracing.ENDPOINT_HELP, metavar="URL", show_default=False),
]
Ratio = Annotated[float, option("--otlp-sample-ratio", help=tracing.RATIO_HELP, metavar="R")]
Traceparent = Annotated[
    str | None,
    option(
        "--traceparent",
        help=f"{tracing.TRACEPARENT_HELP} Default: $TRACEPARENT (OpenTelemetry's environment "
        "carrier), else none.",
        metavar="TRACEPARENT",
        show_default=False,
        env=False,
    ),
]


def parent(traceparent: str | None) -> str:
    """``--traceparent``, else ``$TRACEPARENT``: checked (a bad one is a usage error)."""
    given = traceparent if traceparent is not None else os.environ.get("TRACEPARENT", "")
    return tracing.check_traceparent(given)


def traces(endpoint: str | None, ratio: float) -> TracingConfig:
    """The options as a checked ``TracingConfig`` (off: an empty endpoint)."""
    cfg = tracing.resolve(endpoint, ratio)
    if cfg.endpoint:
        tracing.require_sdk()
    return cfg


class LegSpan:
    """A leg's client span (``start`` with tracing on), or only the ``--traceparent`` it
    forwards (tracing off)."""

    def __init__(self, cfg: TracingConfig, parent: str = "") -> None:
        self._tracing: tracing.Tracing | None = None
        self._client: ClientSpan | None = None
        self.traceparent, self.tracestate = parent, ""
        if cfg.endpoint:
            self._tracing = tracing.Tracing(cfg, "kvpush-leg").start()
            self._client = self._tracing.client(parent)
            self.traceparent = self._client.traceparent
            self.tracestate = self._client.tracestate

    def end(self, report: LegReport | None, reason: str = "", detail: str = "") -> None:
        """The leg ended (``report``), or failed before it had one (``reason``): the span ends
        and goes out (bounded wait)."""
        if self._tracing is None or self._client is None:
            return
        build = functools.partial(_leg_span, report, time.time(), reason, detail)
        self._tracing.end_client(self._client, build)
        self._tracing.close()


def _leg_span(report: LegReport | None, t1: float, reason: str, detail: str) -> SpanSpec:
    if report is None:
        return SpanSpec(REQUEST, t1, t1, {"kvpush.outcome": "failed"}, error=reason, detail=detail)
    ok = report.outcome == "ok"
    attrs = attributes(
        {
            "kvpush.leg": str(report.leg),
            "kvpush.peer": report.address,
            "kvpush.transfer_id": str(report.kv_transfer_params.get("remote_request_id", ""))
            or report.request_id,
            "kvpush.request_id": report.request_id,
            "kvpush.bytes": report.nbytes,
            "kvpush.outcome": report.outcome,
            "kvpush.reason": report.reason,
            "kvpush.wire": "vllm",
        }
    )
    error = "" if ok else (report.reason or report.outcome)
    return SpanSpec(REQUEST, t1, t1, attrs, error=error, detail=report.detail)

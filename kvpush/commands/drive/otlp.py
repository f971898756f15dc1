"""``drive --otlp-traces-endpoint URL``: one trace per request, started by drive.

Owns ``DriveSpans`` (behind ``Driver(spans=...)``): when a request goes out (``sent``, on its
worker) it starts the request's ``kvpush.request`` client span -- a new trace, kept at
``--otlp-sample-ratio`` -- whose W3C context (``context``) both legs carry
(``PrefillReq``/``DecodeReq.traceparent``), so P's and D's server spans join the same trace;
when the request is decided (``resolved``, on the thread that decided it) the span is handed to
the tracing thread to end, with its outcome, reason and ``kvpush.*`` attributes. A request that
was never sent (no peer up, interrupted) still gets its span, failed, with the reason. Also
``TracedReport``: the run's report with the traces' counts (``--json``: ``traces``), which
``finish_traced`` prints.

Threads: drive's workers (``sent``, ``context``), any thread (``resolved``), the caller of
``close``; the span work itself is the tracing thread's (``kvpush.telemetry.tracing``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NoReturn, TypeVar

from kvpush.commands.common.ending import Report, finish
from kvpush.commands.common.results import DriveConfig, RequestResult
from kvpush.telemetry.tracing import TraceCounts, Tracing
from kvpush.telemetry.tracing.spans import REQUEST, SpanSpec, attributes

if TYPE_CHECKING:
    from rich.console import RenderableType

    from kvpush.config import TracingConfig
    from kvpush.telemetry.tracing.otel import ClientSpan


class DriveSpans:
    def __init__(self, traces: TracingConfig, cfg: DriveConfig, service: str = "kvpush-drive"):
        self.tracing = Tracing(traces, service, cfg.run_id).start()
        self.endpoint = traces.endpoint
        self.ratio = traces.sample_ratio
        self._blocks = cfg.blocks
        self._spans: dict[int, ClientSpan] = {}

    def sent(self, i: int) -> None:
        """Request ``i`` goes out: its span starts (once: a retry to another D keeps it)."""
        if i not in self._spans:
            self._spans[i] = self.tracing.client()

    def context(self, i: int) -> tuple[str, str]:
        """The W3C ``traceparent`` and ``tracestate`` request ``i``'s legs carry."""
        c = self._spans.get(i)
        return (c.traceparent, c.tracestate) if c is not None else ("", "")

    def resolved(self, result: RequestResult, blocks: int | None = None) -> None:
        """Request ``result.index`` is decided: its span ends (on the tracing thread)."""
        c = self._spans.pop(result.index, None)
        if c is None:  # never sent: a span of its own, failed
            c = self.tracing.client()
        n = self._blocks if blocks is None else blocks
        self.tracing.end_client(c, functools.partial(request_span, result, time.time(), n))

    def close(self) -> TraceCounts:
        """Every span still queued goes out (bounded); what the traces did."""
        self.tracing.close()
        return self.tracing.counts()

    def summary(self, counts: TraceCounts) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "sample_ratio": self.ratio,
            "spans": counts.spans,
            "exported": counts.exported,
            "dropped": counts.dropped,
        }


def request_span(result: RequestResult, t1: float, blocks: int) -> SpanSpec:
    """The ``kvpush.request`` span of one request (the tracing thread)."""
    attrs = attributes(
        {
            "kvpush.transfer_id": result.transfer_id,
            "kvpush.index": result.index,
            "kvpush.prefill": result.prefill,
            "kvpush.decode": result.decode,
            "kvpush.peer": result.decode,
            "kvpush.blocks": blocks,
            "kvpush.bytes": result.nbytes,
            "kvpush.outcome": "ok" if result.ok else "failed",
            "kvpush.reason": result.reason,
            "kvpush.verified": result.verified,
            "kvpush.wire": "kvpush",
        }
    )
    error = "" if result.ok else (result.reason or "failed")
    return SpanSpec(REQUEST, t1, t1, attrs, error=error, detail=result.detail)


R = TypeVar("R", bound=Report)


@dataclass(frozen=True)
class TracedReport(Generic[R]):
    """A run's report and its traces: ``to_dict`` adds ``traces`` (``--json``)."""

    report: R
    traces: dict[str, object]

    def to_dict(self) -> dict[str, object]:
        d = dict(self.report.to_dict())
        d["traces"] = self.traces
        return d


def finish_traced(
    report: R,
    view: Callable[[R], RenderableType],
    spans: dict[str, object] | None,
    json_out: bool,
    *,
    ok: bool,
    interrupted: bool,
) -> NoReturn:
    """``finish``, with the traces' counts beside the report (``--json``) when there are."""
    if spans is not None:
        traced = TracedReport(report, spans)
        finish(traced, lambda t: view(t.report), json_out, ok=ok, interrupted=interrupted)
    finish(report, view, json_out, ok=ok, interrupted=interrupted)


def note(summary: dict[str, object]) -> str:
    """The run's traces in one line (stderr)."""
    return (
        f"traces: {summary['spans']} span(s) to {summary['endpoint']}, "
        f"{summary['exported']} exported, {summary['dropped']} dropped"
    )

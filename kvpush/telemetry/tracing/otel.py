"""The OpenTelemetry side of kvpush's traces: the SDK pipeline that one ``Tracing`` owns.

Owns ``Pipeline``: a ``TracerProvider`` (resource: ``service.name``, ``service.version``,
``service.instance.id``; sampler: parent-based -- a span with a parent follows the parent's
decision, a new trace is kept at the ratio), the SDK's ``BatchSpanProcessor`` (a bounded queue
drained by its own export thread) and the OTLP/HTTP exporter behind ``Counting``, which counts
what the collector took and what it did not. The only module that imports ``opentelemetry``:
``kvpush.telemetry.tracing`` imports it when tracing is on, never otherwise.

Nothing is lost silently. The processor's queue drops its oldest span when full; the pipeline
never lets it get there: before a request's spans are ended it checks that they fit beside the
spans ended and not yet taken by the exporter (an overestimate of the queue: the exporter
counts a batch once it took it) and drops them itself, counted, when they do not. A batch the
collector refused or never got (unreachable, timed out, refused after the exporter's retries)
is counted dropped; so is whatever ``close`` could not send in its time.

Threads: ``start_client`` on the caller's (a drive worker: a new span and its W3C context, a few
microseconds); ``emit``, ``end_client`` and ``close`` on the tracing thread; the exporter on the
processor's export thread. No call here waits on the network but ``close``, bounded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace as api
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from kvpush import __version__
from kvpush.telemetry.tracing.spans import SpanSpec, format_traceparent, parse_traceparent

log = logging.getLogger(__name__)

#: The batch processor: its queue (spans ended, not yet exported), how often it exports, how
#: many spans one export carries.
QUEUE_SPANS = 4096
SCHEDULE_MS = 200
BATCH_SPANS = 512
#: ``close``: the batch processor's own shutdown may wait for an export in flight; bounded.
SHUTDOWN_S = 1.0

_NS = 1_000_000_000

# The exporter logs every retry and failed batch; the tracing thread says it once, with the
# count (``kvpush.telemetry.tracing``): a collector that is down must not flood the log.
for _name in ("opentelemetry.exporter.otlp", "opentelemetry.exporter.http"):
    logging.getLogger(_name).setLevel(logging.CRITICAL)


class Counting(SpanExporter):  # type: ignore[misc]  # the SDK ships no type information
    """The OTLP exporter, counted: spans taken (the processor handed them over), exported, and
    failed (the collector did not take them). After ``shutdown`` every batch fails at once."""

    def __init__(self, inner: SpanExporter) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.taken = 0
        self.exported = 0
        self.failed = 0
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        n = len(spans)
        with self._lock:
            self.taken += n
            closed = self._closed
        ok = False
        if not closed:
            try:
                ok = self._inner.export(spans) == SpanExportResult.SUCCESS
            except Exception as e:  # the exporter's own failure costs the batch, no more
                log.debug("span export failed: %s", e)
        with self._lock:
            if ok:
                self.exported += n
            else:
                self.failed += n
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inner.shutdown()  # also cuts the exporter's retry wait short

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


@dataclass(frozen=True)
class ClientSpan:
    """A client span started on the caller's thread: ``traceparent``/``tracestate`` go out on
    the request; the tracing thread ends ``span`` once the request is decided."""

    span: Any  # the SDK's span (it ships no type information)
    traceparent: str
    tracestate: str
    sampled: bool


class Pipeline:
    def __init__(
        self, endpoint: str, ratio: float, service: str, instance: str, queue: int = QUEUE_SPANS
    ) -> None:
        attrs: dict[str, str] = {"service.name": service, "service.version": __version__}
        if instance:
            attrs["service.instance.id"] = instance
        self.exporter = Counting(OTLPSpanExporter(endpoint=endpoint))
        self._queue = queue
        self._bsp = BatchSpanProcessor(
            self.exporter,
            max_queue_size=queue,
            schedule_delay_millis=SCHEDULE_MS,
            max_export_batch_size=min(BATCH_SPANS, queue),
        )
        self._provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(ratio)),
            resource=Resource.create(attrs),
            shutdown_on_exit=False,  # ``close`` bounds it; an exit must not wait on a collector
        )
        self._provider.add_span_processor(self._bsp)
        self._tracer = self._provider.get_tracer("kvpush", __version__)
        self.ended = 0  # spans handed to the processor (the tracing thread only)
        self.gated = 0  # spans not ended: the processor's queue had no room for them
        self.closed = False

    # ------------------------------------------------------------------ counts (any thread)
    @property
    def dropped(self) -> int:
        """Spans that did not reach the collector: no room, refused, or -- once closed --
        never sent."""
        ex = self.exporter
        if self.closed:
            return self.gated + max(0, self.ended - ex.exported)
        return self.gated + ex.failed

    def _room(self, n: int) -> bool:
        """Room for ``n`` more spans in the processor's queue (its length overestimated)."""
        if self.ended - self.exporter.taken + n <= self._queue:
            return True
        self.gated += n
        return False

    # ------------------------------------------------------------------ spans
    def start_client(self, name: str, traceparent: str = "", tracestate: str = "") -> ClientSpan:
        """A client span starting now (caller's thread): a child of ``traceparent`` when given
        (``leg --traceparent``), else a new trace."""
        span = self._tracer.start_span(
            name,
            context=_context(traceparent, tracestate),
            kind=api.SpanKind.CLIENT,
            start_time=time.time_ns(),
        )
        sc = span.get_span_context()
        flags = int(sc.trace_flags)
        return ClientSpan(
            span,
            format_traceparent(sc.trace_id, sc.span_id, flags),
            sc.trace_state.to_header() if sc.trace_state else "",
            bool(flags & 1),
        )

    def end_client(self, client: ClientSpan, spec: SpanSpec) -> None:
        """End a client span as ``spec`` says (the tracing thread)."""
        span = client.span
        if not span.is_recording() or not self._room(spec.spans):
            return
        self._emit_into(span, spec)

    def emit(self, spec: SpanSpec, kind: str) -> None:
        """A server span and its steps, from their stamps (the tracing thread)."""
        span = self._tracer.start_span(
            spec.name,
            context=_context(spec.traceparent, spec.tracestate),
            kind=api.SpanKind.SERVER if kind == "server" else api.SpanKind.CLIENT,
            attributes=dict(spec.attrs),
            start_time=_ns(spec.t0),
        )
        if not span.is_recording() or not self._room(spec.spans):
            return  # not sampled (nothing to send), or no room (counted)
        self._emit_into(span, spec, attrs_set=True)

    def _emit_into(self, span: Any, spec: SpanSpec, attrs_set: bool = False) -> None:
        if not attrs_set:
            span.set_attributes(dict(spec.attrs))
        parent = api.set_span_in_context(span, Context())
        t1 = spec.t1
        start = self._tracer.start_span
        for st in spec.steps:
            child = start(
                st.name,
                context=parent,
                attributes={"kvpush.phase": st.phase} if st.phase else None,
                start_time=_ns(st.t0),
            )
            if st.error:
                child.set_attribute("error.type", st.error)
                child.set_status(api.Status(api.StatusCode.ERROR, st.error))
            child.end(end_time=_ns(st.t1))
            t1 = max(t1, st.t1)
        if spec.error:
            span.set_attribute("error.type", spec.error)
            words = f"{spec.error}: {spec.detail}" if spec.detail else spec.error
            span.set_status(api.Status(api.StatusCode.ERROR, words))
        else:
            span.set_status(api.Status(api.StatusCode.OK))
        span.end(end_time=_ns(t1))
        self.ended += spec.spans

    # ------------------------------------------------------------------ close
    def close(self, wait_s: float) -> None:
        """Give the processor up to ``wait_s`` to send what is queued, then stop it: what it
        could not send by then is counted dropped (the tracing thread)."""
        until = time.monotonic() + wait_s
        while self.exporter.exported + self.exporter.failed < self.ended:
            if time.monotonic() >= until:
                break
            time.sleep(0.02)
        self.exporter.shutdown()  # a batch in flight fails now, not after its retries
        t = threading.Thread(target=self._provider.shutdown, name="trace-close", daemon=True)
        t.start()
        t.join(SHUTDOWN_S)
        self.closed = True


def _ns(t: float) -> int:
    return int(t * _NS)


def _context(traceparent: str, tracestate: str) -> Context:
    """The context a span starts in: its W3C parent's (a remote span context, read by
    ``parse_traceparent``: the propagator's regular expressions cost more), or an empty one
    (a new trace; also for a traceparent that is not W3C's)."""
    parent = parse_traceparent(traceparent) if traceparent else None
    if parent is None:
        return Context()
    state = api.TraceState.from_header([tracestate]) if tracestate else None
    sc = api.SpanContext(
        int(parent.trace_id, 16),
        int(parent.span_id, 16),
        is_remote=True,
        trace_flags=api.TraceFlags(parent.flags),
        trace_state=state,
    )
    ctx: Context = api.set_span_in_context(api.NonRecordingSpan(sc), Context())
    return ctx

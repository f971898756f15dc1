"""OpenTelemetry traces of kvpush's requests: off by default, and then free.

Off (no ``--otlp-traces-endpoint``, no ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``): nothing here
imports ``opentelemetry`` and no thread runs; ``import kvpush.cli`` and a serve without tracing
load no OpenTelemetry module. On: one ``Tracing`` per endpoint (or per drive, per leg) owns a
hand-off queue, one thread (``tracing``) and the SDK pipeline (``kvpush.telemetry.tracing.otel``:
a ``BatchSpanProcessor`` with a bounded queue and the OTLP/HTTP exporter).

The hot path stamps as it always did (``kvpush.telemetry.phases``) and hands over, when a request
settles, one item: a function that builds its ``SpanSpec`` (``kvpush.telemetry.tracing.spans``)
from the stamps. The hand-off is an append to a bounded deque -- no lock, no wake-up, nothing
that waits; a full one drops the item, counted. The tracing thread polls it every
``POLL_S``, builds the spans with their recorded start and end times and ends them into the
processor, whose own thread exports them. Spans that never reach the collector (hand-off full,
processor full, collector unreachable or refusing) are counted: ``dropped``, handed to
``on_dropped`` (an endpoint's ``trace_spans_dropped`` counter: ``kvpush_trace_spans_dropped_total``
in Prometheus and in ``-o json``), and said in the log at most once a minute.

Sampling is parent-based: a request that carries a W3C ``traceparent`` is traced exactly when
its caller sampled it (one with the flag off costs one string read, ``wants``); a trace kvpush
starts (drive, leg, or a request without a parent) is kept at ``--otlp-sample-ratio``.

Threads: ``wants``/``server``/``client``/``end_client`` on any thread (the roles' writer and
receiver threads, drive's workers); the ``tracing`` thread builds and ends spans; the SDK's
export thread sends them. ``close`` (the owner) and ``finish`` (serve, before it exits) stop it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urlsplit

from kvpush.config import EndpointConfig, TracingConfig
from kvpush.errors import ConfigError
from kvpush.telemetry.tracing.spans import REQUEST, SpanSpec, parse_traceparent, sampled

if TYPE_CHECKING:
    from kvpush.telemetry.store import Telemetry
    from kvpush.telemetry.tracing.otel import ClientSpan, Pipeline

log = logging.getLogger(__name__)

#: The endpoint counter of spans that never reached the collector.
SPANS_DROPPED = "trace_spans_dropped"

ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_SERVICE = "OTEL_SERVICE_NAME"
ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_DISABLED = "OTEL_SDK_DISABLED"
TRACES_PATH = "/v1/traces"

ENDPOINT_HELP = (
    "Send OpenTelemetry traces of every request (one span per request and side, its phases as "
    "child spans) to this OTLP/HTTP collector URL, e.g. http://collector:4318/v1/traces (a URL "
    f"without a path gets {TRACES_PATH}); default: {ENV_ENDPOINT}, else off. Needs kvpush's "
    "otel extra (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http). An unreachable "
    "collector costs dropped spans (counted), never a request."
)
RATIO_HELP = (
    "The share of new traces kept (0..1): a request with a W3C traceparent follows its "
    "caller's decision; one without starts a trace kept at this ratio."
)
TRACEPARENT_HELP = (
    "Join this W3C trace (00-<trace id>-<span id>-<flags>, as a router sends it): the leg's "
    "span becomes its child, and the endpoint's spans the leg's (without "
    "--otlp-traces-endpoint the traceparent goes to the endpoint as it is)."
)
SDK_HINT = "install the OpenTelemetry extra: pip install 'kvpush[otel]'"

#: The hand-off holds this many settled requests; the tracing thread takes them every POLL_S.
HANDOFF_ITEMS = 8192
POLL_S = 0.05
#: ``close``: how long the processor gets to send what is queued.
FLUSH_S = 3.0
#: The drop warning: at most once per this many seconds.
WARN_EVERY_S = 60.0


# ---------------------------------------------------------------------- configuration (CLI)
def resolve(
    endpoint: str | None,
    ratio: float = 1.0,
    env: Mapping[str, str] | None = None,
    service: str = "",
) -> TracingConfig:
    """The tracing an operator asked for: the flag's URL, else ``OTEL_EXPORTER_OTLP_TRACES_
    ENDPOINT``; ``OTEL_SDK_DISABLED=true`` turns it off; checked (``check``)."""
    env = os.environ if env is None else env
    url = (endpoint or "").strip() or env.get(ENV_ENDPOINT, "").strip()
    if env.get(ENV_DISABLED, "").strip().lower() == "true":
        url = ""
    return check(TracingConfig(url, ratio, service), env)


def check(cfg: TracingConfig, env: Mapping[str, str] | None = None) -> TracingConfig:
    """``cfg`` validated, its URL completed with ``/v1/traces`` when it has no path; a
    ``ConfigError`` with a hint for a ratio outside 0..1, a URL that is not http(s), or an
    environment that asks for gRPC (kvpush sends OTLP over HTTP/protobuf)."""
    env = os.environ if env is None else env
    if not 0.0 <= cfg.sample_ratio <= 1.0:
        raise ConfigError(
            f"--otlp-sample-ratio must be in 0..1, got {cfg.sample_ratio:g}",
            "pass e.g. 0.01 to keep one new trace in a hundred",
        )
    if not cfg.endpoint:
        return cfg
    parts = urlsplit(cfg.endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"the traces endpoint {cfg.endpoint!r} is not an http(s) URL",
            "kvpush sends OTLP over HTTP/protobuf: give the collector's HTTP receiver, e.g. "
            "http://collector:4318/v1/traces",
        )
    proto = env.get(ENV_PROTOCOL, "").strip()
    if proto and proto != "http/protobuf":
        raise ConfigError(
            f"{ENV_PROTOCOL}={proto}: kvpush sends traces over http/protobuf only",
            f"unset {ENV_PROTOCOL} (or set it to http/protobuf) and give the collector's HTTP "
            "receiver (port 4318)",
        )
    if parts.path in ("", "/"):
        url = parts._replace(path=TRACES_PATH).geturl()
        cfg = TracingConfig(url, cfg.sample_ratio, cfg.service_name)
    return cfg


def require_sdk() -> None:
    """The OpenTelemetry SDK and its OTLP/HTTP exporter are installed (without importing
    them); else a ``ConfigError`` with the install hint."""
    for mod in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigError(f"tracing needs OpenTelemetry ({mod} is not installed)", SDK_HINT)


def check_traceparent(text: str) -> str:
    """``--traceparent``: a W3C traceparent, or a ``ConfigError`` (usage)."""
    if text and parse_traceparent(text) is None:
        raise ConfigError(
            f"--traceparent {text!r} is not a W3C traceparent",
            "pass 00-<32 hex trace id>-<16 hex span id>-<2 hex flags>, as the router sent it",
        )
    return text.strip()


# ---------------------------------------------------------------------- the tracer
@dataclass(frozen=True)
class TraceCounts:
    """What a ``Tracing`` did: spans ended into the pipeline, exported, dropped."""

    spans: int
    exported: int
    dropped: int


class _Item(NamedTuple):
    build: Callable[[], SpanSpec | None]
    client: ClientSpan | None
    spans: int  # how many spans it stands for (counted dropped when the hand-off is full)


_open: set[Tracing] = set()
_open_lock = threading.Lock()


class Tracing:
    def __init__(
        self,
        cfg: TracingConfig,
        service: str,
        instance: str = "",
        on_dropped: Callable[[int], None] | None = None,
    ) -> None:
        self.cfg = cfg = check(cfg)
        self.service = cfg.service_name or os.environ.get(ENV_SERVICE, "").strip() or service
        self._instance = instance
        self._on_dropped = on_dropped
        self._q: deque[_Item] = deque()
        self._lock = threading.Lock()  # the counts below (rare paths only)
        self._refused = 0  # spans of items the hand-off (or a closed tracer) refused
        self._told = 0  # drops handed to ``on_dropped`` so far
        self._warned_at = -WARN_EVERY_S
        self._wake = threading.Event()
        self._deadline: float | None = None  # closing: the thread stops at this time
        self._done = threading.Event()
        self._pipeline: Pipeline | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Tracing:
        """Build the pipeline and start the thread (raises ``ConfigError`` without the SDK)."""
        try:
            from kvpush.telemetry.tracing.otel import Pipeline
        except ImportError as e:
            raise ConfigError(f"tracing needs OpenTelemetry: {e}", SDK_HINT) from None
        self._pipeline = Pipeline(
            self.cfg.endpoint, self.cfg.sample_ratio, self.service, self._instance
        )
        self._thread = threading.Thread(target=self._run, name="tracing", daemon=True)
        self._thread.start()
        with _open_lock:
            _open.add(self)
        return self

    # ------------------------------------------------------------------ hot path (any thread)
    @staticmethod
    def wants(traceparent: str) -> bool:
        """Whether a request with this ``traceparent`` is traced (its caller's decision)."""
        return sampled(traceparent)

    def server(self, build: Callable[[], SpanSpec | None], spans: int) -> None:
        """A settled request: ``build`` makes its span (on the tracing thread)."""
        self._put(_Item(build, None, spans))

    def client(self, traceparent: str = "", tracestate: str = "") -> ClientSpan:
        """A client span starting now, on this thread (drive's, leg's): its ``traceparent``
        goes out with the request."""
        assert self._pipeline is not None, "Tracing.start() first"
        return self._pipeline.start_client(REQUEST, traceparent, tracestate)

    def end_client(self, client: ClientSpan, build: Callable[[], SpanSpec | None]) -> None:
        """The request of ``client`` is decided: ``build`` says how (on the tracing thread)."""
        if client.sampled:
            self._put(_Item(build, client, 1))

    def _put(self, item: _Item) -> None:
        if len(self._q) < HANDOFF_ITEMS and not self._done.is_set():
            self._q.append(item)
            return
        with self._lock:
            self._refused += item.spans

    # ------------------------------------------------------------------ reading (any thread)
    def counts(self) -> TraceCounts:
        p = self._pipeline
        with self._lock:
            refused = self._refused
        if p is None:
            return TraceCounts(0, 0, refused)
        return TraceCounts(p.ended, p.exporter.exported, refused + p.dropped)

    # ------------------------------------------------------------------ the tracing thread
    def _run(self) -> None:
        p = self._pipeline
        assert p is not None
        try:
            while True:
                self._wake.wait(POLL_S)
                self._drain(p)
                self._tell()
                dl = self._deadline
                if dl is not None and time.monotonic() >= dl:
                    break
            self._done.set()
            self._drain(p)
            p.close(FLUSH_S)
            self._refuse_left()  # handed over while the thread was closing: counted
            self._tell()
        finally:
            self._done.set()
            with _open_lock:
                _open.discard(self)

    def _drain(self, p: Pipeline) -> None:
        q = self._q
        while q:
            item = q.popleft()
            try:
                spec = item.build()
                if spec is None:
                    continue
                if item.client is not None:
                    p.end_client(item.client, spec)
                else:
                    p.emit(spec, "server")
            except Exception:  # a span that cannot be built costs that span, never the thread
                log.exception("a request's span could not be built")
                with self._lock:
                    self._refused += item.spans

    def _refuse_left(self) -> None:
        n = 0
        while self._q:
            n += self._q.popleft().spans
        with self._lock:
            self._refused += n

    def _tell(self) -> None:
        """New drops: to ``on_dropped``, and into the log at most once a minute."""
        dropped = self.counts().dropped
        new = dropped - self._told
        if new <= 0:
            return
        self._told = dropped
        if self._on_dropped is not None:
            self._on_dropped(new)
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "traces: %d span(s) dropped so far: the collector at %s did not take them "
                "(unreachable, slow or refusing) or the queue was full; requests go on",
                dropped,
                self.cfg.endpoint,
            )

    # ------------------------------------------------------------------ closing (the owner)
    def close(self, linger_s: float = 0.0) -> None:
        """Stop: at once (spans queued get ``FLUSH_S`` to leave; waits for that), or after
        ``linger_s`` more of settling requests (returns at once: an endpoint's group closes
        before its roles drain; ``finish`` cuts the linger short)."""
        self._deadline = time.monotonic() + max(0.0, linger_s)
        if linger_s <= 0:
            self._wake.set()
            self.join()

    def join(self, wait_s: float = FLUSH_S + 2.0) -> None:
        if self._thread is not None:
            self._thread.join(wait_s)


def for_endpoint(cfg: EndpointConfig, telemetry: Telemetry) -> Tracing | None:
    """An endpoint's tracer (None when its tracing is off), its drops counted in ``telemetry``
    (declared at 0 from the start)."""
    if not cfg.tracing.endpoint:
        return None
    telemetry.declare(counters=[SPANS_DROPPED])

    def dropped(n: int) -> None:
        telemetry.inc(SPANS_DROPPED, n)

    return Tracing(cfg.tracing, f"kvpush-{cfg.role}", cfg.engine_id, dropped).start()


def finish(wait_s: float = FLUSH_S + 2.0) -> None:
    """Every tracer still open stops now and sends what it holds (up to ``wait_s``): serve
    calls it after its endpoint stopped, before the process exits."""
    with _open_lock:
        tracers = list(_open)
    for t in tracers:
        t._deadline = time.monotonic()
        t._wake.set()
    until = time.monotonic() + wait_s
    for t in tracers:
        t.join(max(0.0, until - time.monotonic()))


__all__ = [
    "ENDPOINT_HELP",
    "RATIO_HELP",
    "SPANS_DROPPED",
    "TRACEPARENT_HELP",
    "TraceCounts",
    "Tracing",
    "check",
    "check_traceparent",
    "finish",
    "for_endpoint",
    "require_sdk",
    "resolve",
]

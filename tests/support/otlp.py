"""A real OTLP/HTTP trace receiver for the tests: ``POST /v1/traces``, decoded with the
OpenTelemetry proto package (``ExportTraceServiceRequest``), every span kept as a ``Span``.

``Collector`` serves on 127.0.0.1 (a free port) from its own thread; ``spans()`` is what it
received so far, ``wait_for`` waits (bounded) until a condition on them holds, ``traces()`` groups
them by trace id. It answers 200 with an empty ``ExportTraceServiceResponse``, as a collector does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2


def _value(v: AnyValue) -> object:
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


@dataclass(frozen=True)
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status: int
    message: str
    attrs: dict[str, object] = field(default_factory=dict)


class Collector:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self.posts = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                owner._add(req)
                data = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, req: ExportTraceServiceRequest) -> None:
        got: list[Span] = []
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            service=str(res.get("service.name", "")),
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            status=s.status.code,
                            message=s.status.message,
                            attrs={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self._lock:
            self._spans.extend(got)
            self.posts += 1

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def traces(self) -> dict[str, list[Span]]:
        out: dict[str, list[Span]] = {}
        for s in self.spans():
            out.setdefault(s.trace_id, []).append(s)
        return out

    def wait_for(self, cond: Callable[[list[Span]], bool], timeout_s: float = 30.0) -> list[Span]:
        """The spans once ``cond`` holds for them; an AssertionError (with a summary) past
        ``timeout_s``."""
        until = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if cond(spans):
                return spans
            if time.monotonic() >= until:
                names: dict[str, int] = {}
                for s in spans:
                    names[f"{s.service}/{s.name}"] = names.get(f"{s.service}/{s.name}", 0) + 1
                raise AssertionError(f"collector: condition not met in {timeout_s}s: {names}")
            time.sleep(0.05)

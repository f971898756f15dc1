"""The metrics port's HTTP server: ``/metrics`` and the health probes, bounded.

Owns ``BoundedServer`` (a wsgiref server with one thread per connection, at most
``MAX_CONNECTIONS`` at once: one more is answered 503 and closed without a thread; a connection
idle for ``IDLE_TIMEOUT_S`` is closed, and any connection still open after
``CONNECTION_DEADLINE_S`` is shut, so neither an idle-connection flood nor a client that trickles
bytes can hold threads) and ``probe_app`` (``/healthz`` and ``/readyz`` in front of the metrics
app). The serving loop runs on ``PrometheusExporter``'s thread (``kvpush.telemetry.prom``); each
connection on a thread of its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from kvpush.telemetry.health import Health, Verdict

logger = logging.getLogger(__name__)


class QuietHandler(WSGIRequestHandler):
    """One connection, one request (wsgiref's): ``timeout`` (set per server) closes a connection
    that sends nothing for that long."""

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes and probes are not logged (one line per request would flood the log)."""

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # idle past the timeout, reset, or shut down at its deadline
            self.close_connection = True


#: Connections (each its own thread) served at a time; one more is answered 503 and closed.
MAX_CONNECTIONS = 64
#: A connection that sends nothing (no request, or a pause within it) this long is closed.
IDLE_TIMEOUT_S = 5.0
#: A connection still open this long after it was accepted is shut down (a trickling client).
CONNECTION_DEADLINE_S = 30.0
#: How often the server thread looks for connections past their deadline.
_SWEEP_S = 0.5
_BUSY_BODY = b"too many connections to the metrics server: retry\n"
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n"
    b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY
)


class BoundedServer(WSGIServer):
    """wsgiref's server with a thread per connection, bounded (see the module docstring).

    ``tick`` runs on the server thread at every turn of its loop (at least every 0.5 s): the
    readiness ring's periodic sample (``Health.tick``, which keeps its own pace)."""

    request_queue_size = 128  # the listen backlog (socketserver's 5 drops SYNs in a burst)

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[WSGIRequestHandler],
        *,
        family: socket.AddressFamily,
        max_connections: int,
        deadline_s: float,
        tick: Callable[[], None],
    ) -> None:
        self.address_family = family
        self.max_connections = max_connections
        self.deadline_s = deadline_s
        self.refused = 0  # connections answered 503 at the cap
        self._tick = tick
        self._tick_failed = False
        self._conns: dict[socket.socket, float] = {}  # open connection -> accepted at
        self._conns_lock = threading.Lock()
        self._next_sweep = 0.0
        super().__init__(address, handler)

    @property
    def open_connections(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def process_request(self, request: Any, client_address: Any) -> None:
        sock: socket.socket = request
        with self._conns_lock:
            full = len(self._conns) >= self.max_connections
            if not full:
                self._conns[sock] = time.monotonic()
        if full:
            self.refused += 1
            with contextlib.suppress(OSError):  # a fresh socket's buffer takes it at once
                sock.setblocking(False)
                sock.send(_BUSY)
            self.shutdown_request(sock)
            return
        t = threading.Thread(
            target=self._serve_one, args=(sock, client_address), name="metrics-conn", daemon=True
        )
        try:
            t.start()
        except BaseException:
            self._forget(sock)
            raise  # socketserver reports it and closes the socket

    def _serve_one(self, sock: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(sock, client_address)
        except Exception:
            logger.debug("metrics connection from %s failed", client_address, exc_info=True)
        finally:
            self._forget(sock)
            self.shutdown_request(sock)

    def _forget(self, sock: socket.socket) -> None:
        # Under the lock: the sweep only ever shuts down a socket that is not closed yet.
        with self._conns_lock:
            self._conns.pop(sock, None)

    def close_connections(self, older_than_s: float = 0.0) -> None:
        """Shut down the open connections accepted more than ``older_than_s`` ago: their
        threads wake from their reads and end."""
        now = time.monotonic()
        with self._conns_lock:
            for sock, t0 in self._conns.items():
                if now - t0 >= older_than_s:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

    def service_actions(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_S
            self.close_connections(self.deadline_s)
        try:
            self._tick()
        except Exception as e:  # a broken snapshot is the probes' to report; never this loop's
            if not self._tick_failed:
                self._tick_failed = True
                logger.warning("readiness sample failed: %s: %s", type(e).__name__, e)


_PROBES = {"/healthz": "live", "/readyz": "ready"}


def probe_app(metrics: WSGIApplication, health: Health | None) -> WSGIApplication:
    """``/healthz`` and ``/readyz`` from ``health``; every other path is the metrics page."""

    def app(environ: WSGIEnvironment, start: StartResponse) -> Iterable[bytes]:
        probe = _PROBES.get(str(environ.get("PATH_INFO", "")).rstrip("/") or "/")
        if probe is None or health is None:
            return metrics(environ, start)
        try:
            v: Verdict = getattr(health, probe)()
        except Exception as e:  # a probe that cannot judge says so, it never hangs or 500s
            v = Verdict(False, f"probe failed: {type(e).__name__}: {e}")
        as_json = "format=json" in str(environ.get("QUERY_STRING", "")) or "json" in str(
            environ.get("HTTP_ACCEPT", "")
        )
        if as_json:
            body = json.dumps({"ok": v.ok, "reason": v.reason}).encode() + b"\n"
            ctype = "application/json"
        else:
            body = (v.reason if v.ok else f"not {probe}: {v.reason}").encode() + b"\n"
            ctype = "text/plain; charset=utf-8"
        status = "200 OK" if v.ok else "503 Service Unavailable"
        start(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]

    return app

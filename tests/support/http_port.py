"""A port that answers, but is no side channel: a real HTTP server on 127.0.0.1 in daemon threads
of the test process, for the tests of first contact.

``http_server()`` is the standard library's ``ThreadingHTTPServer`` (as ``python -m
http.server`` runs it) answering every request with a small page; it yields its port and stops
on exit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html><body>not a side channel</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: the test's output is for its own words


@contextmanager
def http_server() -> Iterator[int]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, name="http-port", daemon=True)
    t.start()
    try:
        yield int(srv.server_address[1])
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)

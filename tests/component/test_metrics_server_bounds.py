"""The metrics / probe server is bounded (issue 24, item 5): a real ``PrometheusExporter`` on a
free port, real TCP connections from this process.

Main kept a thread per idle connection (2,000 connections: 1,805 threads). Now at most
``max_connections`` connections hold a thread, one more is answered 503 and closed at once, an
idle one is closed after the idle timeout, one that trickles its request is cut at its deadline,
and ``stop`` ends them all. The server loop also ticks the readiness samples.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvpush.config import Role
from kvpush.telemetry.health import Health
from kvpush.telemetry.httpserver import MAX_CONNECTIONS
from kvpush.telemetry.prom import PrometheusExporter
from kvpush.telemetry.snapshot import Snapshot
from kvpush.telemetry.store import Telemetry
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(180)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # reset before the answer: as a refusal
        return 0, str(e)


@contextlib.contextmanager
def serving(
    tm: Telemetry, health: Health | None = None, **bounds: float
) -> Iterator[PrometheusExporter]:
    exp = PrometheusExporter(tm.snapshot, health=health, **bounds)  # type: ignore[arg-type]
    exp.start()
    try:
        yield exp
    finally:
        exp.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


class Ends:
    """Reads the client sockets until each is closed by the server; keeps what they got."""

    def __init__(self, socks: list[socket.socket]) -> None:
        self.got: dict[socket.socket, bytes] = {s: b"" for s in socks}
        self.open = set(socks)
        self._sel = selectors.DefaultSelector()
        for s in socks:
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ)

    def poll(self) -> int:
        """Read what is there; the number still open."""
        for key, _ in self._sel.select(0.05):
            s: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            except OSError:  # reset: closed with our bytes unread
                data = b""
            if data:
                self.got[s] += data
            else:
                self._sel.unregister(s)
                self.open.discard(s)
        return len(self.open)

    def close(self) -> None:
        self._sel.close()
        for s in self.got:
            s.close()


def test_two_thousand_idle_connections_hold_a_bounded_number_of_threads() -> None:
    tm = Telemetry(Role.DECODE, "d-1")
    health = Health(tm.snapshot, lambda: None, lambda: False)
    with serving(tm, health, idle_timeout_s=10.0) as exp:
        assert get(exp.url.replace("/metrics", "/readyz")) == (200, "ok\n")
        wait_for(lambda: exp.open_connections == 0, 30, "the probe's connection ended")
        before = threading.active_count()
        peak = before
        socks: list[socket.socket] = []
        for i in range(2000):
            socks.append(connect(exp.port))
            if i % 50 == 0:
                peak = max(peak, threading.active_count())
        ends = Ends(socks)
        try:
            # The cap holds while they are all open, and the server's count says so.
            wait_for(lambda: exp.open_connections == MAX_CONNECTIONS, 30, "the cap reached")
            peak = max(peak, threading.active_count())
            assert peak <= before + MAX_CONNECTIONS, (before, peak)
            # Beyond the cap: answered 503 and closed at once; the rest closed once idle.
            wait_for(lambda: ends.poll() == 0, 60, "every idle connection closed by the server")
            busy = [g for g in ends.got.values() if g.startswith(b"HTTP/1.0 503 ")]
            idle = [g for g in ends.got.values() if g == b""]
            # (the cap's worth, and more if connecting took longer than the idle timeout)
            assert len(idle) >= MAX_CONNECTIONS and len(busy) + len(idle) == 2000, len(busy)
            assert b"too many connections" in busy[0]
            # Probes and scrapes answer again; the threads are gone.
            base = exp.url.removesuffix("/metrics")
            assert wait_for(lambda: get(base + "/readyz")[0] == 200, 30, "/readyz answers")
            status, page = get(exp.url)
            assert status == 200 and "kvpush_requests_ok_total" in page
            assert get(base + "/healthz") == (200, "ok\n")
            wait_for(lambda: threading.active_count() <= before, 30, "connection threads ended")
        finally:
            ends.close()


def test_a_client_that_trickles_its_request_is_cut_at_the_deadline() -> None:
    """A byte every 0.5 s never trips the idle timeout (2 s); the deadline (4 s) ends it long
    before the 150-byte request is complete (75 s)."""
    tm = Telemetry(Role.DECODE, "d-1")
    with serving(tm, idle_timeout_s=2.0, connection_deadline_s=4.0) as exp:
        request = b"GET /metrics HTTP/1.0\r\nX-Pad: " + b"a" * 120 + b"\r\n\r\n"
        s = connect(exp.port)
        cut = False
        try:
            for i in range(len(request)):
                try:
                    s.sendall(request[i : i + 1])
                except OSError:
                    cut = True
                    break
                time.sleep(0.5)
                s.setblocking(False)
                try:
                    cut = s.recv(4096) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    cut = True
                s.setblocking(True)
                if cut:
                    break
        finally:
            s.close()
        assert cut and i < len(request) - 1, i
        wait_for(lambda: exp.open_connections == 0, 30, "its thread ended")


def test_one_connection_beyond_the_cap_is_answered_503_without_a_thread() -> None:
    tm = Telemetry(Role.PREFILL, "p-1")
    with serving(tm, max_connections=3, idle_timeout_s=30.0) as exp:
        before = threading.active_count()
        held = [connect(exp.port) for _ in range(3)]
        try:
            wait_for(lambda: exp.open_connections == 3, 30, "three connections served")
            status, body = get(exp.url)
            assert (status, body) == (503, "too many connections to the metrics server: retry\n")
            assert threading.active_count() <= before + 3
        finally:
            for h in held:
                h.close()
        # Closed by the client: their threads end at once, and the page answers.
        wait_for(lambda: exp.open_connections == 0, 30, "the held connections ended")
        assert get(exp.url)[0] == 200


def test_stop_ends_the_open_connections() -> None:
    tm = Telemetry(Role.DECODE, "d-1")
    exp = PrometheusExporter(tm.snapshot, idle_timeout_s=60.0)
    exp.start()
    before = threading.active_count()
    held = [connect(exp.port) for _ in range(5)]
    try:
        wait_for(lambda: exp.open_connections == 5, 30, "five connections served")
        exp.stop()
        for h in held:
            h.settimeout(30)
            assert h.recv(10) == b""  # closed by the server, long before its idle timeout
        wait_for(lambda: threading.active_count() <= before - 1, 30, "every server thread ended")
    finally:
        for h in held:
            h.close()
        exp.stop()


def test_the_server_loop_samples_readiness_between_probes() -> None:
    """An own failure right before the first probe is judged against a sample the server loop
    took before it (without one the probe would have nothing to judge it from)."""
    tm = Telemetry(Role.DECODE, "d-1")
    taken: list[float] = []

    def snapshot() -> Snapshot:
        taken.append(time.monotonic())
        return tm.snapshot()

    health = Health(snapshot, lambda: None, lambda: False)
    with serving(tm, health) as exp:
        wait_for(lambda: len(taken) >= 2, 30, "two samples taken by the server loop")
        tm.inc("requests_failed")
        tm.fail("write_error")
        status, body = get(exp.url.replace("/metrics", "/readyz"))
        assert status == 503 and "(write_error x1)" in body, body

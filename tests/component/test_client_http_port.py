"""The side-channel client (``kvpush.transport.client``, the one every endpoint's handshakes use)
tells an HTTP server named as a peer at once: it "looks like HTTP"; a refused port is still
"connection refused"; a silent port and a real ZMQ peer are never mistaken for either (issue 24,
item 5).

Real sockets on 127.0.0.1: the standard library's threading HTTP server, a TCP listener nobody
serves, and a real kvpush endpoint. No timing is asserted: each call is given a
deadline far longer than the test waits for it, and waiting it out raises ``PeerTimeoutError``
("did not accept a connection"), which the exact error asserted here is not.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvpush.errors import PeerError, PeerTimeoutError, PeerUnreachableError
from kvpush.transport import contact
from kvpush.transport.client import NOT_A_SIDE_CHANNEL_HINT, SideChannelClient
from kvpush.wire import protocol
from tests.support.http_port import http_server
from tests.support.procs import Launcher

pytestmark = pytest.mark.integration

#: Far longer than a look takes: a client that waited it out fails the test by its error.
LONG_S = 30.0


def test_http_server_is_refused_at_once_as_http() -> None:
    with http_server() as port:
        addr = f"127.0.0.1:{port}"
        for call in ("identify", "request"):
            with (
                SideChannelClient("127.0.0.1", port, timeout_s=LONG_S) as c,
                pytest.raises(PeerError) as ei,
            ):
                if call == "identify":
                    c.identify()
                else:
                    c.request(protocol.StatsReq())
            e = ei.value
            assert not isinstance(e, PeerUnreachableError), e
            assert e.message == (
                f"{addr} answered but is not a kvpush or vLLM side channel (looks like HTTP)"
            ), call
            assert e.hint == NOT_A_SIDE_CHANNEL_HINT


def test_refused_port_is_still_refused(free_port: int) -> None:
    with (
        SideChannelClient("127.0.0.1", free_port, timeout_s=LONG_S) as c,
        pytest.raises(PeerUnreachableError) as ei,
    ):
        c.identify()
    assert not isinstance(ei.value, PeerTimeoutError)
    assert ei.value.message == f"127.0.0.1:{free_port}: connection refused"


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A TCP port whose kernel accepts connections that nobody ever reads or answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


def test_silent_port_is_left_to_the_deadline(silent_listener: int) -> None:
    """Nothing answered the look: no verdict at once, the deadline's own error."""
    with (
        SideChannelClient("127.0.0.1", silent_listener, timeout_s=2.0) as c,
        pytest.raises(PeerTimeoutError) as ei,
    ):
        c.identify()
    assert "did not accept a connection within 2s" in ei.value.message


def test_real_endpoint_is_zmq_to_the_look_and_unharmed(serve: Launcher) -> None:
    d = serve.start("decode", "--num-blocks", "8", "--layers", "1", "--block-bytes", "4096")
    host, port = d.address.rsplit(":", 1)
    c = contact.contact(host, int(port), LONG_S, greeting_wait_s=contact.GREETING_WAIT_S)
    assert (c.kind, c.detail) == ("zmq", "ZMTP greeting")
    with SideChannelClient(host, int(port), timeout_s=LONG_S) as client:
        assert client.identify().kind == "kvpush"
        rep = client.request(protocol.StatsReq())
    assert isinstance(rep, protocol.StatsRep)
    assert d.proc.poll() is None


@pytest.mark.parametrize(
    ("first", "kind"),
    [
        (b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f", "zmq"),
        (b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03\x01NULL", "zmq"),
        (b"HTTP/1.0 400 Bad request\r\n", "http"),
        (b"http/1.1 200 OK\r\n", "http"),
        (b"<!DOCTYPE HTML PUBLIC", "http"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "other"),
        (b"\x1b[2J\x1b[H", "other"),
        (b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x00", "other"),  # 0xFF, but no ZMTP flag
    ],
)
def test_classify_first_bytes(first: bytes, kind: str) -> None:
    c = contact.classify("h:1", first)
    assert c.kind == kind
    assert "\x1b" not in c.detail  # what a peer sent is shown, never emitted

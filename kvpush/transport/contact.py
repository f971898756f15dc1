"""What a peer is before any ZMQ is spoken: one raw TCP look, classified.

Owns ``Contact`` and ``tcp_contact`` / ``look``: connect once with a plain socket and say what
answered -- refused, timed out, a name that resolves to nothing, a network error, a ZMQ socket
(its ZMTP greeting), HTTP, something else (a banner), a peer that closed the connection, or one
that accepted and stayed silent. ``classify`` is the pure part (the first bytes a peer sent ->
what it is). Runs on the caller's thread; plain sockets only, no zmq, so the operator tools'
first contact (``kvpush.commands.common.control``) and the side-channel client
(``kvpush.transport.client``, when ZMQ has not connected within 0.1 s) share one definition of
"looks like HTTP".

Why raw TCP: ZMQ reconnects silently, so a closed port looks like a slow peer until the deadline,
and a peer that is not a side channel at all (an HTTP server, kvpush's own ``/metrics`` port)
looks like one that does not answer. A TCP connect says "refused" at once, and a ZMQ peer greets
every new connection with its ZMTP signature before anything is sent. Only when nothing greets
us is ``HEAD / HTTP/1.0`` sent, which an HTTP server answers; to a ZMQ peer it is an unfinished
ZMTP/1.0 frame that libzmq drops without handing anything to the application, so even a vLLM
listener (which dies on unexpected messages) is safe.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from kvpush.address import format_address, parse_address

#: The bytes a ZMQ peer sends first on every connection: 0xFF, 8 length bytes, 0x7F.
ZMTP_FIRST = 0xFF
HTTP_PROBE = b"HEAD / HTTP/1.0\r\n\r\n"
GREETING_WAIT_S = 1.0

#: What ``Contact.kind`` may be; ``ANSWERED_NOT_ZMQ`` are the kinds that prove the peer answered
#: but is no side channel (a ZMQ client can never connect to it).
KINDS = ("zmq", "refused", "timeout", "unresolved", "unreachable", "http", "other", "silent",
         "closed")  # fmt: skip
ANSWERED_NOT_ZMQ = frozenset({"http", "other"})


@dataclass(frozen=True)
class Contact:
    """What a raw TCP connection to a peer found (``kind``) and the words for it."""

    address: str
    kind: str  # one of KINDS
    detail: str = ""

    @property
    def is_zmq(self) -> bool:
        return self.kind == "zmq"


def resolve(host: str, port: int) -> tuple[int, tuple[str, int]] | None:
    """The first (family, sockaddr) for ``host``; None when the name resolves to nothing."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    if not infos:
        return None
    family, _, _, _, sockaddr = infos[0]
    return int(family), (str(sockaddr[0]), int(sockaddr[1]))


def tcp_contact(
    address: str, timeout_s: float, look: bool = True, greeting_wait_s: float = GREETING_WAIT_S
) -> Contact:
    """Connect once to ``HOST:PORT`` and classify the peer (``look`` False: only check that it
    accepts). Never raises for the peer's behaviour; ``ConfigError`` for a malformed address."""
    host, port = parse_address(address)
    return contact(host, port, timeout_s, look=look, greeting_wait_s=greeting_wait_s)


def contact(
    host: str,
    port: int,
    timeout_s: float,
    *,
    look: bool = True,
    greeting_wait_s: float = GREETING_WAIT_S,
) -> Contact:
    """``tcp_contact`` for a parsed address: everything within ``timeout_s``."""
    addr = format_address(host, port)
    target = resolve(host, port)
    if target is None:
        return Contact(addr, "unresolved", f"{host!r} resolves to no address")
    family, sockaddr = target
    deadline = time.monotonic() + timeout_s
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(sockaddr)
        except ConnectionRefusedError:
            return Contact(addr, "refused", "connection refused")
        except TimeoutError:
            return Contact(addr, "timeout", f"no TCP connection within {timeout_s:g}s")
        except OSError as e:
            return Contact(addr, "unreachable", e.strerror or str(e))
        if not look:
            return Contact(addr, "zmq", "accepts connections")
        return _look(s, addr, deadline, timeout_s, greeting_wait_s)


def _look(
    s: socket.socket, addr: str, deadline: float, timeout_s: float, greeting_wait_s: float
) -> Contact:
    """Classify a connected peer: by what it says first, else by its answer to an HTTP probe."""
    first = _read_some(s, min(greeting_wait_s, max(0.05, deadline - time.monotonic())))
    if first is None:
        return Contact(addr, "closed", "closed the connection without a word")
    if first:
        return classify(addr, first)
    try:
        s.sendall(HTTP_PROBE)
    except OSError:
        return Contact(addr, "closed", "closed the connection without a word")
    reply = _read_some(s, max(0.05, deadline - time.monotonic()))
    if reply is None:
        return Contact(addr, "closed", "accepted the connection, then closed it unanswered")
    if reply:
        return classify(addr, reply)
    return Contact(
        addr, "silent", f"accepted the connection but sent nothing within {timeout_s:g}s"
    )


def _read_some(s: socket.socket, wait_s: float) -> bytes | None:
    """Up to 64 bytes within ``wait_s``: b"" when nothing came, None when the peer closed."""
    s.settimeout(wait_s)
    try:
        data = s.recv(64)
    except TimeoutError:
        return b""
    except OSError:
        return None
    return data if data else None


def classify(addr: str, data: bytes) -> Contact:
    """What the first bytes a peer sent say it is: ``zmq`` (a ZMTP greeting), ``http``, or
    ``other`` (with the bytes shown, escaped). Pure."""
    if data[0] == ZMTP_FIRST and (len(data) < 10 or data[9] & 0x01):
        return Contact(addr, "zmq", "ZMTP greeting")
    head = data[:64].lower()
    if head.startswith(b"http/") or b"<html" in head or b"<!doctype html" in head:
        return Contact(addr, "http", "looks like HTTP")
    shown = data[:24].decode("ascii", "backslashreplace").strip()
    return Contact(addr, "other", f"it sent {shown!r}")

"""The one control client of the operator tools, and what a peer is before any ZMQ is spoken.

Owns ``connect`` (the side-channel client every tool uses: probe, drive, demo, the tests' legs),
``call`` (one request whose errors always name the peer), ``ClientPool`` (a bounded set of
connections per peer that worker threads borrow one at a time, so the number of sockets is
planned, not one per thread) and ``first_contact`` (a raw TCP look at a peer: refused, timed
out, a name that resolves to nothing, a ZMQ socket, or something else such as HTTP).

Threads: a client belongs to the thread that borrowed it until it is given back (the pool's
lock and queue hand it over with a memory barrier, as ZMQ asks of a socket that changes
threads). ``first_contact`` runs on the caller's thread and uses plain sockets only; no zmq is
imported here (only ``kvpush.transport`` imports it).

Why raw TCP first: ZMQ reconnects silently, so a closed port looks like a slow peer until the
deadline ("did not accept a connection within 3s"), and a peer that is not a side channel at
all (kvpush's own ``/metrics`` port) looks like one that does not answer. A TCP connect says
"refused" at once, and a ZMQ peer greets every new connection with its ZMTP signature before
anything is sent. Only when nothing greets us is ``HEAD / HTTP/1.0`` sent, which an HTTP server
answers; to a ZMQ peer it is an unfinished ZMTP/1.0 frame that libzmq drops without handing
anything to the application, so even a vLLM listener (which dies on unexpected messages) is
safe.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvpush.address import parse_address
from kvpush.errors import AuthError, KvpushError, PeerError, PeerUnreachableError, ProtocolError
from kvpush.transport.contact import Contact, tcp_contact

if TYPE_CHECKING:
    from kvpush.transport.client import SideChannelClient
    from kvpush.wire import protocol


def connect(address: str, token: bytes | None = None, timeout_s: float = 5.0) -> SideChannelClient:
    """The side-channel client of one peer (not connected until its first request)."""
    from kvpush.transport.client import SideChannelClient
    from kvpush.wire.auth import Authenticator

    host, port = parse_address(address)
    return SideChannelClient(host, port, auth=Authenticator(token), timeout_s=timeout_s)


def call(
    client: SideChannelClient, req: protocol.SideRequest, timeout_s: float | None = None
) -> protocol.SideReply:
    """``client.request`` whose authentication and decoding errors name the peer."""
    try:
        return client.request(req, timeout_s)
    except (AuthError, ProtocolError) as e:
        if client.address in e.message:
            raise
        raise type(e)(f"{client.address}: {e.message}", e.hint or None) from None


# ----------------------------------------------------------------------------------- the pool


class ClientPool:
    """At most ``budget`` clients in all, shared by worker threads, each borrowed by one thread.

    ``borrow(address)`` hands out an idle client of that peer, or makes one while fewer than
    ``budget`` exist, or closes an idle client of another peer to make room, or else waits for
    one to be given back. A thread holds at most one client at a time, so with at most
    ``budget`` borrowing threads nobody waits for ever. A client that failed has closed its own
    socket (a fresh one next time), so giving it back is always safe.
    """

    def __init__(self, token: bytes | None, timeout_s: float, budget: int) -> None:
        self._token = token
        self._timeout = timeout_s
        self._budget = budget
        self._cond = threading.Condition()
        self._idle: dict[str, list[SideChannelClient]] = {}
        self._count = 0
        self._closed = False

    def _take(self, address: str) -> SideChannelClient:
        with self._cond:
            while True:
                if self._closed:
                    raise KvpushError(f"no client for {address}: the run's connections are closed")
                idle = self._idle.setdefault(address, [])
                if idle:
                    return idle.pop()
                if self._count < self._budget:
                    self._count += 1
                    return connect(address, self._token, self._timeout)
                other = next((lst for lst in self._idle.values() if lst), None)
                if other is not None:
                    other.pop().close()  # room for this peer: an idle socket of another
                    self._count -= 1
                    continue
                self._cond.wait()

    @contextlib.contextmanager
    def borrow(self, address: str) -> Iterator[SideChannelClient]:
        c = self._take(address)
        try:
            yield c
        finally:
            with self._cond:
                if self._closed:
                    c.close()
                    self._count -= 1
                else:
                    self._idle.setdefault(address, []).append(c)
                self._cond.notify()

    def grow(self, n: int) -> None:
        """Allow ``n`` more clients (a borrower that will not give its client back soon)."""
        with self._cond:
            self._budget += n
            self._cond.notify_all()

    def close(self) -> None:
        """Close the idle clients; a borrowed one is closed when it is given back."""
        with self._cond:
            self._closed = True
            for lst in self._idle.values():
                while lst:
                    lst.pop().close()
                    self._count -= 1
            self._cond.notify_all()  # a borrower waiting for room gets its error


# ------------------------------------------------------------------------- raw first contact
# What a peer is before any ZMQ is spoken: ``kvpush.transport.contact`` (one definition, shared
# with the side-channel client). ``first_contact`` turns what it found into a typed error.


UNREACHABLE_HINT = (
    "check the address, that the peer is running and that no firewall is in the way; "
    "raise --timeout for a slow link"
)
NOT_A_SIDE_CHANNEL_HINT = (
    "check the address: it must be a kvpush or vLLM NIXL side channel, not e.g. the "
    "Prometheus /metrics port"
)


class UnreachablePeer(PeerUnreachableError):
    """Nothing usable answered (exit 69); ``found`` says what: refused, timeout, silent..."""

    def __init__(self, message: str, found: str, hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.found = found


class NotASideChannel(PeerError):
    """Something answered, but not a ZMQ side channel (exit 3); ``found``: http, other..."""

    def __init__(self, message: str, found: str, hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.found = found


def first_contact(address: str, timeout_s: float) -> Contact:
    """Raise the typed error for a peer that cannot be a side channel; return a ZMQ contact.

    ``UnreachablePeer`` (exit 69): refused, no TCP connection in time, a name that resolves
    to nothing, a network error, or a peer that accepted and stayed silent.
    ``NotASideChannel`` (exit 3): it answered, but not as ZMQ (HTTP, a banner, a closed
    connection).
    """
    c = tcp_contact(address, timeout_s)
    if c.kind == "zmq":
        return c
    if c.kind == "refused":
        host, port = parse_address(address)
        raise UnreachablePeer(
            f"{c.address}: connection refused",
            c.kind,
            f"nothing listens on port {port} of {host}: check the port and that the peer runs",
        )
    if c.kind in ("timeout", "unresolved", "unreachable", "silent"):
        what = {
            "timeout": "timed out",
            "unresolved": "cannot resolve the name",
            "unreachable": "network error",
            "silent": "timed out",
        }[c.kind]
        raise UnreachablePeer(f"{c.address}: {what}: {c.detail}", c.kind, UNREACHABLE_HINT)
    raise NotASideChannel(
        f"{c.address} answered but is not a kvpush or vLLM side channel ({c.detail})",
        c.kind,
        NOT_A_SIDE_CHANNEL_HINT,
    )

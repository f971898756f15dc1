"""The one control client of the operator tools: ``connect`` and ``call``.

Every tool that talks to an endpoint's side channel (probe, drive, demo, the tests' legs) gets
its client from ``connect``, so that how a client is made (and later, how connections are
shared) changes in one place. ``call`` sends one request and makes sure its errors name the
peer. A client belongs to one thread (it wraps one ZMQ socket); no zmq is imported here (only
``kvpush.transport`` imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpush.config import parse_address
from kvpush.errors import AuthError, ProtocolError

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

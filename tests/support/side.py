"""Side-channel requests to running endpoints, for the fault and hostile suites.

``request`` sends one request on a fresh client (closed after: worker threads come and go), with
the endpoint's token when a ``tests.support.cluster.Cluster`` started it with one
(``remember_token``); ``snapshot`` and its ``gauges``, ``failures`` and ``counters`` read an
endpoint's telemetry through ``StatsReq``.
"""

from __future__ import annotations

from typing import Any

# The token of every endpoint a Cluster started with one: the test's clients use it.
_TOKENS: dict[str, bytes] = {}


def remember_token(address: str, token: object) -> None:
    if isinstance(token, str):
        _TOKENS[address] = token.encode()
    else:
        _TOKENS.pop(address, None)


def client(address: str, timeout_s: float) -> Any:
    """A side-channel client for ``address``, with the endpoint's token if it has one."""
    from kvpush.transport.client import SideChannelClient
    from kvpush.wire.auth import Authenticator

    host, port = address.rsplit(":", 1)
    auth = Authenticator(_TOKENS.get(address))
    return SideChannelClient(host, int(port), auth=auth, timeout_s=timeout_s)


def request(address: str, req: Any, timeout_s: float = 5.0) -> Any:
    """One side-channel request on a fresh socket (closed after: worker threads come and go)."""
    with client(address, timeout_s) as c:
        return c.request(req, timeout_s=timeout_s)


def snapshot(address: str, timeout_s: float = 5.0) -> dict[str, Any]:
    from kvpush.wire import protocol

    rep = request(address, protocol.StatsReq(), timeout_s)
    assert isinstance(rep, protocol.StatsRep), rep
    return rep.snapshot


def gauges(address: str) -> dict[str, float]:
    g = snapshot(address)["gauges"]
    assert isinstance(g, dict)
    return g


def failures(address: str) -> dict[str, int]:
    f = snapshot(address)["failures"]
    assert isinstance(f, dict)
    return f


def counters(address: str) -> dict[str, int]:
    c = snapshot(address)["counters"]
    assert isinstance(c, dict)
    return c

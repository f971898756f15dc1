"""An endpoint whose roles are stopping refuses every handshake, typed "shutting down", while its
side channel stays up to answer what the roles' stop ended (``kvpush.endpoint.core.stop``).

Before, the side channel stopped before the roles, and their last answers (``shutting_down``)
reached no one: each client waited out its own deadline. Keeping it up longer must not let a
peer handshake with roles that stopped -- it would register with nobody reading, and its request
would end ``prefill_dead`` when the agent went away. Real endpoints in this process (real NIXL
agents, real ZMQ side channels); the roles' stop is held open by the test so that the window it
judges is wide, instead of the milliseconds it lasts on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush.config import EndpointConfig, HandshakeMode, PoolConfig, Role, VllmWireConfig, Wire
from kvpush.endpoint import open_endpoint
from kvpush.errors import PeerShuttingDownError
from kvpush.peers.validation import handshake_failure
from kvpush.telemetry.names import Failure
from kvpush.transport.client import SideChannelClient
from kvpush.wire import protocol

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

POOL = PoolConfig(num_blocks=32, layers=1, block_bytes=4096)
VLLM = VllmWireConfig(compat_hash="ab" * 32, block_size=16, attn_backend_name="CPU_ATTN")


def _cfg(role: Role, wire: Wire) -> EndpointConfig:
    if wire == Wire.VLLM:
        return EndpointConfig(role=role, pool=POOL, wire=wire, vllm=VLLM)
    return EndpointConfig(role=role, pool=POOL)


class _HeldStop:
    """P stopping, its roles' stop held until ``release``: the window between the roles
    beginning to stop and the side channel closing."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.entered = threading.Event()
        self.go = threading.Event()
        for rk in ep.ranks:
            stop = rk.role.stop

            def held(timeout_s: float, stop: Any = stop) -> None:
                self.entered.set()
                assert self.go.wait(60), "the test never let the roles stop"
                stop(timeout_s)

            rk.role.stop = held
        self.thread = threading.Thread(target=ep.stop, daemon=True)

    def __enter__(self) -> _HeldStop:
        self.thread.start()
        assert self.entered.wait(30), "P's roles never began to stop"
        return self

    def __exit__(self, *exc: object) -> None:
        self.go.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "P's stop did not end"


@pytest.fixture(params=[Wire.KVPUSH, Wire.VLLM], ids=["kvpush-wire", "vllm-wire"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    p = open_endpoint(_cfg(Role.PREFILL, request.param))
    d = open_endpoint(_cfg(Role.DECODE, request.param))
    try:
        yield p, d
    finally:
        d.stop()
        p.stop()


def test_a_handshake_with_roles_that_stopped_is_refused_shutting_down(
    pair: tuple[Any, Any],
) -> None:
    p, d = pair
    d.handshake_to(p.address, HandshakeMode.NOTIF)  # served while P runs
    d.forget_peer(p.address, None, "peer_left", "the test drops it to handshake afresh")
    with _HeldStop(p):
        with pytest.raises(PeerShuttingDownError) as ei:
            d.handshake_to(p.address, HandshakeMode.NOTIF)
        assert "shutting down" in ei.value.message
        assert handshake_failure(ei.value, Role.PREFILL) == Failure.SHUTTING_DOWN
        # Its first-contact answer says so and carries nothing a peer could load; its stats
        # are still answered (an operator's probe sees it stopping, not gone).
        host, port = p.address.rsplit(":", 1)
        with SideChannelClient(host, int(port), timeout_s=5) as c:
            ident = c.identify(0, 0)
            assert ident.payload.kvpush is not None and ident.payload.kvpush.stopping
            assert ident.payload.agent_metadata_bytes == b""
            if p.cfg.wire == Wire.KVPUSH:
                rep = c.request(protocol.StatsReq())
                assert isinstance(rep, protocol.StatsRep)
                with pytest.raises(PeerShuttingDownError):
                    c.request(protocol.HandshakeReq(mode="notif", requester="t", tp_rank=0))

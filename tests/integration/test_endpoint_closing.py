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
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush.commands.probe.command import error_object
from kvpush.commands.probe.kvpush_peer import DRAINING
from kvpush.commands.probe.probe import probe
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
    """P stopping, held in one step of its stop until the test leaves the block: ``stop_intake``
    (draining: no new work, what it holds may finish) or ``stop`` (its roles stopping: the
    window between them ending their work and the side channel closing)."""

    def __init__(self, ep: Any, step: str) -> None:
        self.ep = ep
        self.entered = threading.Event()
        self.go = threading.Event()
        for rk in ep.ranks:
            real = getattr(rk.role, step)

            def held(timeout_s: float, real: Any = real) -> None:
                self.entered.set()
                assert self.go.wait(60), "the test never let P's stop go on"
                real(timeout_s)

            setattr(rk.role, step, held)
        self.thread = threading.Thread(target=ep.stop, daemon=True)

    def __enter__(self) -> _HeldStop:
        self.thread.start()
        assert self.entered.wait(30), "P's stop never reached the step held"
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
    # forget_peer is carried out on each rank's owner thread: a handshake asked before that
    # would find the old connection (seen once in a loaded run of make test).
    deadline = time.monotonic() + 10
    while d.holds_peer(p.address, None):
        assert time.monotonic() < deadline, "D never dropped its connection to P"
        time.sleep(0.02)
    with _HeldStop(p, "stop"):
        with pytest.raises(PeerShuttingDownError) as ei:
            d.handshake_to(p.address, HandshakeMode.NOTIF)
        assert "shutting down" in ei.value.message
        assert handshake_failure(ei.value, Role.PREFILL) == Failure.SHUTTING_DOWN
        # A registry hint checked now is proven: it refuses everything, whatever it is called.
        seen = d.look_at_peer(p.address)
        assert seen.kind == "refused" and seen.proves_gone(p.incarnation), seen
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
        # probe names it, typed: exit 3, status shutting_down, not "ask for rank 0,0".
        with pytest.raises(PeerShuttingDownError) as pe:
            probe(p.address, count=1)
        assert error_object(p.address, pe.value)["status"] == "shutting_down"
        assert "shutting down" in pe.value.message


def test_a_draining_endpoint_still_serves_handshakes_and_probe_says_it_drains(
    pair: tuple[Any, Any],
) -> None:
    """While it drains, the work it holds may still need a peer's handshake (a D that registers
    for a prefill P took before its drain): handshakes are served, new work is not."""
    p, d = pair
    with _HeldStop(p, "stop_intake"):
        conn = d.handshake_to(p.address, HandshakeMode.NOTIF)
        assert conn is not None
        report = probe(p.address, count=1)
        assert DRAINING in report.notes
        # A registry hint checked now is refuted: what it holds may still finish.
        seen = d.look_at_peer(p.address)
        assert seen.kind == "answers" and not seen.proves_gone(p.incarnation), seen

"""What an endpoint hands its role: the shared resources, built complete, and the role contract
(``RoleWorker``).

The endpoint core (``kvpush.endpoint``) builds every shared resource before any role exists --
pool, NIXL agent, handshake manager, the wire's dialect and its codec, telemetry, its own
metadata -- and passes them in one ``EndpointContext``; the role (P's ``PrefillRole``, D's
``DecodeRole``) owns its ``OwnerThread`` and serves its side-channel requests. Composition, not
a template: roles never import the endpoint, and nothing here is Optional until some start() ran.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from kvpush.config import EndpointConfig
from kvpush.instruments import NO_INSTRUMENTS, Instruments
from kvpush.memory.pool import KvPool
from kvpush.peers.dialect import Dialect
from kvpush.peers.handshakes import HandshakeManager, PeerGone
from kvpush.runtime.decline import Decliner
from kvpush.runtime.owner import OwnerThread
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import Agent
from kvpush.wire import protocol
from kvpush.wire.notifs import Codec


@dataclass(frozen=True)
class EndpointContext:
    cfg: EndpointConfig
    agent: Agent
    pool: KvPool
    handshakes: HandshakeManager
    codec: Codec  # the dialect's
    # The wire the endpoint speaks (keys, deadlines, ranks, handshakes): asked, never tested.
    dialect: Dialect
    telemetry: Telemetry
    metadata: protocol.EndpointMetadata
    # Ping notifications are the endpoint's business; the role's owner thread hands them over.
    on_ping: Callable[[str, protocol.Ping], None]
    # Slow control requests (P fills blocks) run here, never on the side-channel thread.
    control: ThreadPoolExecutor
    # Peers' TP sizes by side-channel address, shared by an endpoint's ranks (D learns P's once).
    peer_tp: dict[tuple[str, int], int] = field(default_factory=dict)
    # Tells a peer over its side channel that a transfer is declined (None: not on this wire).
    decliner: Decliner | None = None
    # Test and measurement hooks (none in production: ``kvpush.instruments``).
    instruments: Instruments = NO_INSTRUMENTS

    @property
    def incarnation(self) -> str:
        return self.metadata.incarnation


class RoleWorker(Protocol):
    """P's or D's part of an endpoint (what runs for its ``kvpush.config.Role``)."""

    owner: OwnerThread

    def start(self) -> None:
        """Start the owner thread; return once it runs, or raise."""

    def stop_intake(self, drain_s: float) -> None:
        """Refuse new work (D also finishes or fails its waiting requests)."""

    def stop(self, drain_s: float) -> None:
        """Drain in-flight work and stop the owner thread."""

    def failure(self) -> BaseException | None:
        """The first failure of the role's threads, if any."""

    def poke(self) -> None:
        """Wake the owner thread (so it polls notifications now)."""

    def forget_peer(self, gone: PeerGone) -> None:
        """From any thread: drop the peer ``gone`` names on the owner thread, at once (the work in
        flight with it fails with ``gone.reason``)."""

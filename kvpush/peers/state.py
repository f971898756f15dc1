"""A handshake peer as data: its key, its connection, its row in the peer table."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvpush.address import format_address
from kvpush.config import HandshakeMode
from kvpush.peers.tp import Slice
from kvpush.peers.vllm_peer import PeerHint
from kvpush.telemetry.names import Failure, PeerState
from kvpush.transport.nixl import DList
from kvpush.wire import protocol

PeerKey = tuple[str, int, int]
"""(host, side-channel port, tp rank): a rank of a peer endpoint; each rank is its own agent."""


def peer_key(host: str, port: int, rank: int = 0) -> PeerKey:
    return (host, port, rank)


def peer_name(key: PeerKey) -> str:
    """``HOST:PORT`` for rank 0 (the common case), ``HOST:PORT rank R`` otherwise."""
    host, port, rank = key
    addr = format_address(host, port)
    return addr if rank == 0 else f"{addr} rank {rank}"


@dataclass(frozen=True)
class PeerGone:
    """A peer endpoint proven gone (``peer_left``: its side channel refused) or replaced
    (``peer_restarted``: another incarnation answers at its address) after a registry hint
    (``kvpush.fleet.suspects``): every connection to ``incarnation`` goes at once, whatever
    address it was reached by; without an incarnation, every connection to ``host:port``."""

    host: str
    port: int
    incarnation: str | None
    reason: Failure
    detail: str

    def matches(self, conn: PeerConn) -> bool:
        if self.incarnation:
            return conn.metadata.incarnation == self.incarnation
        return (conn.key[0], conn.key[1]) == (self.host, self.port)


@dataclass
class PeerConn:
    """A connected peer: its metadata, loaded agent and (full mode) remote descriptor list."""

    key: PeerKey
    metadata: protocol.EndpointMetadata
    agent_name: str
    mode: HandshakeMode
    remote_dlist: DList | None
    timings: dict[str, float]
    rtt_s: float
    clock_offset_s: float
    # P -> D full handshake: what this P rank writes of each of that D rank's pages (the
    # remote descriptor list covers just that); None for any other handshake.
    write: Slice | None = None
    connected_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    released: bool = False
    evicted: bool = False  # forgotten by the peer table: its agent is stale once released

    @property
    def address(self) -> str:
        return peer_name(self.key)


@dataclass
class PeerEntry:
    """One row of the peer table (``kvpush.peers.table``; guarded by its lock)."""

    key: PeerKey
    mode: HandshakeMode
    state: PeerState
    future: Future[PeerConn]
    started: float
    conn: PeerConn | None = None
    failures: int = 0
    last_error: str = ""
    duration_s: float = 0.0
    hint: PeerHint = field(default_factory=PeerHint)
    errors: int = 0  # consecutive transport errors on its connection (0: healthy)
    doomed: bool = False  # transport errors decided its eviction (counted once)

"""The small public face a load generator drives an endpoint through (the measuring tools'
load generators, and tests).

``start_endpoint(cfg, instruments)`` opens a started P or D endpoint and wraps it in a
``LoadFacade``, which offers what a load generator legitimately needs and nothing of the roles'
or the runtime's insides: the model engine's calls (``prefill`` on P, ``decode`` on D, bound
straight to the endpoint's group, so a call costs what the engine's costs), handing P a
transfer whose blocks a model has just computed (``finish``: allocated and queued for the
writer, no bytes written), the pool's free blocks and whether it is idle (``free_blocks``,
``pool_counts``, ``wait_idle``), D's content check switched off for timed parts and on again
(``set_verify``), telemetry (``snapshot``), handshakes made and forgotten on purpose
(``handshake_to``, ``forget_handshake``), the size of what a handshake reply carries
(``metadata_sizes``), rank 0's KV pool (``pool``: a ``kvpush.memory`` component a load
generator measures on its own) and ``stop``; and ``freeze_startup_heap`` for a worker process
that serves nothing else, as ``serve-*`` does (``kvpush.runtime.heap``).

A load generator may import this module and the pure components (``kvpush.memory``,
``kvpush.config``) but never ``kvpush.prefill``, ``kvpush.decode``, ``kvpush.runtime`` or
``kvpush.peers``: an import-linter ``forbidden`` contract in pyproject.toml enforces it.

Threads: any. ``finish`` and ``prefill`` may run on several threads at once (the writer's inbox
and the allocator are thread-safe); ``forget_handshake`` releases the peer's NIXL resources on
the calling thread, which is safe only while no push to that peer is in flight (a load generator
calls it between rounds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from kvpush.address import parse_address
from kvpush.config import EndpointConfig, HandshakeMode, Role
from kvpush.decode.group import DecodeGroup
from kvpush.decode.role import DecodeRole
from kvpush.endpoint import open_decode, open_prefill
from kvpush.endpoint.core import Endpoint
from kvpush.errors import KvpushError
from kvpush.instruments import NO_INSTRUMENTS, Instruments
from kvpush.memory.pool import KvPool
from kvpush.peers.handshakes import PeerConn
from kvpush.prefill.group import PrefillGroup
from kvpush.prefill.role import PrefillRole
from kvpush.prefill.table import Finished
from kvpush.runtime.heap import freeze_startup_heap as freeze_startup_heap
from kvpush.telemetry.snapshot import Snapshot
from kvpush.wire import protocol

PrefillEndpoint = Endpoint[PrefillRole, PrefillGroup]
DecodeEndpoint = Endpoint[DecodeRole, DecodeGroup]


class LoadFacade:
    """One started endpoint, as a load generator sees it (see the module docstring)."""

    prefill: Callable[..., tuple[list[int], str]]
    """P: ``prefill(transfer_id, num_blocks, request_id="", digest=False)`` as the engine calls
    it (fill every rank's share with the pattern and hand it to the writer)."""
    decode: Callable[..., Future[protocol.DecodeRep]]
    """D: ``decode(transfer_id, prefill_address, num_blocks, deadline_s=0.0, ...)`` as the
    engine calls it; the future's ``DecodeRep`` says how it ended and how long it took."""

    def __init__(self, cfg: EndpointConfig, instruments: Instruments = NO_INSTRUMENTS) -> None:
        self._p: PrefillEndpoint | None = None
        self._d: DecodeEndpoint | None = None
        self._ep: PrefillEndpoint | DecodeEndpoint
        if cfg.role == Role.PREFILL:
            self._ep = self._p = open_prefill(cfg, instruments)
            self.prefill = self._p.group.prefill
        else:
            self._ep = self._d = open_decode(cfg, instruments)
            self.decode = self._d.group.decode
        self._pools = [rk.pool for rk in self._ep.ranks]
        # P: each rank's pool and its writer's inbox of finished transfers (``finish``).
        self._inboxes: list[tuple[KvPool, Callable[[Finished], None]]] = (
            [(role.ctx.pool, role.writer.finished.put) for role in self._p.roles]
            if self._p is not None
            else []
        )

    # ------------------------------------------------------------------ identity
    @property
    def address(self) -> str:
        return self._ep.address

    @property
    def incarnation(self) -> str:
        return self._ep.incarnation

    @property
    def cfg(self) -> EndpointConfig:
        return self._ep.cfg

    @property
    def pool(self) -> KvPool:
        """Rank 0's KV pool (its tensor; a load generator may swap in another allocator)."""
        return self._ep.pool

    # ------------------------------------------------------------------ P
    def finish(self, transfer_id: str, num_blocks: int) -> None:
        """P: allocate ``num_blocks`` on every rank and hand them to each rank's writer as
        finished *without* writing the pattern (the stand-in for a model that has just computed
        its KV, for timed parts whose D does not verify). Raises ``NoFreeBlocksError`` when a
        rank's pool is full (check ``free_blocks`` first)."""
        if self._p is None:
            raise KvpushError("finish() is P's", "call it on a prefill endpoint")
        for pool, put in self._inboxes:
            ids = pool.allocator.allocate(transfer_id, num_blocks)
            put(Finished(transfer_id, transfer_id, transfer_id, ids, time.monotonic()))

    # ------------------------------------------------------------------ D
    def set_verify(self, on: bool) -> None:
        """D: check every completed transfer's content against the pattern (``on``), or not
        (timed parts run without it, then a verified pass checks the bytes)."""
        if self._d is None:
            raise KvpushError("set_verify() is D's", "call it on a decode endpoint")
        for role in self._d.roles:
            role.completer.verify = on

    # ------------------------------------------------------------------ pool
    def free_blocks(self) -> int:
        """The fewest free blocks of any rank's pool (what one more transfer can count on)."""
        return min(p.allocator.counts()["free"] for p in self._pools)

    def pool_counts(self) -> dict[str, int]:
        """Every rank's allocator counts, summed (``total``, ``free``, ``quarantined``, ...)."""
        counts = [p.allocator.counts() for p in self._pools]
        return {k: sum(c[k] for c in counts) for k in counts[0]}

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Wait until no block is allocated or in flight (every push done or failed) or
        ``timeout_s`` passed; return the summed counts."""
        deadline = time.monotonic() + timeout_s
        while True:
            c = self.pool_counts()
            if c["free"] + c["quarantined"] == c["total"] or time.monotonic() > deadline:
                return c
            time.sleep(0.01)

    # ------------------------------------------------------------------ telemetry, handshakes
    def snapshot(self) -> Snapshot:
        return self._ep.snapshot()

    def handshake_to(self, address: str, mode: HandshakeMode) -> PeerConn:
        """Handshake with the endpoint at ``address`` now (rank 0); its phase timings are in
        the returned connection's ``timings``."""
        return self._ep.handshake_to(address, mode)

    def forget_handshake(self, address: str) -> None:
        """Forget rank 0's connection to ``address``'s rank 0 and release its NIXL resources, so
        that the next handshake starts from nothing (only between rounds: see the module)."""
        hs = self._ep.handshakes
        old = hs.evict((*parse_address(address), 0), "forgotten on purpose")
        if old is not None:
            hs.release_conn(old)

    def metadata_sizes(self) -> dict[str, int]:
        """Bytes this endpoint sends in a handshake reply: its NIXL agent metadata in each mode
        and kvpush's own endpoint metadata."""
        rk = self._ep.ranks[0]
        return {
            "agent_full": len(rk.agent_md_full),
            "agent_conn_only": len(rk.agent_md_conn),
            "endpoint": len(rk.md_bytes),
        }

    def stop(self, timeout_s: float | None = None) -> None:
        self._ep.stop(timeout_s)


def start_endpoint(cfg: EndpointConfig, instruments: Instruments = NO_INSTRUMENTS) -> LoadFacade:
    """A started endpoint of ``cfg.role`` with the hooks of ``instruments`` (a slow handshake
    reply, the blocking writer, ...), behind its facade; ``stop()`` it when done."""
    return LoadFacade(cfg, instruments)

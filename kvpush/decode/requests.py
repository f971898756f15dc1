"""D's request table: every request D is waiting for, and the abandoned ones still quarantined.

Pure (no threads, no I/O); owned by the receiver thread. A request's life::

    NEW ──handshake pending──▶ HANDSHAKING ──▶ REGISTERED ──completions──▶ DONE
      └──────────── P connected ─────────────▶ REGISTERED
    (connected, blocks held back: WAITING_BLOCKS, heartbeating P) ──blocks──▶ REGISTERED
    (any) ──failed/cancelled, bytes may still land──▶ ABANDONED ──fence / late completion──▶ gone

An abandoned request keeps its blocks quarantined (never handed to another request) until P's
fence or the WRITE's own completion says no more bytes can land, or until P is gone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kvpush.peers.handshakes import PeerConn, PeerKey
from kvpush.telemetry.names import StrEnum
from kvpush.wire import protocol


class DState(StrEnum):
    NEW = "new"
    HANDSHAKING = "handshaking"
    WAITING_BLOCKS = "waiting_blocks"  # connected to P, blocks not allocated yet
    REGISTERED = "registered"
    DONE = "done"
    ABANDONED = "abandoned"


@dataclass
class DRequest:
    request_id: str
    transfer_id: str
    p_key: PeerKey
    block_ids: np.ndarray
    future: Future[protocol.DecodeRep]
    t_start: float
    deadline: float
    nbytes: int
    state: DState = DState.NEW
    expected: int = 1  # completion notifications that make the request whole
    received: int = 0
    p_conn: PeerConn | None = None
    attempts: int = 0  # re-handshakes after P vanished
    # vLLM's wire: P's coordinates from its kv_transfer_params (the router contract).
    p_engine_id: str = ""
    p_tp_size: int = 1
    p_pp_size: int = 1
    digest: bool = False  # answer with the sha256 of the received bytes
    # An abandoned request whose P cannot fence (vLLM's wire) is released after this time.
    quarantine_until: float = math.inf
    # A request held in D's queue before it gets blocks (as a scheduled vLLM request waits):
    # allocate ``num_blocks`` at ``alloc_at``; P's lease is heartbeated meanwhile.
    num_blocks: int = 0
    alloc_at: float = 0.0


class RequestTable:
    def __init__(self) -> None:
        self._waiting: dict[str, DRequest] = {}
        self._abandoned: dict[str, DRequest] = {}

    # ------------------------------------------------------------------ reads
    def waiting(self, request_id: str) -> DRequest | None:
        return self._waiting.get(request_id)

    def abandoned(self, request_id: str) -> DRequest | None:
        return self._abandoned.get(request_id)

    def in_use(self, request_id: str) -> bool:
        return request_id in self._waiting or request_id in self._abandoned

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_abandoned(self) -> int:
        return len(self._abandoned)

    def all_waiting(self) -> list[DRequest]:
        return list(self._waiting.values())

    def expired(self, now: float) -> list[DRequest]:
        return [r for r in self._waiting.values() if now > r.deadline]

    def due_for_blocks(self, now: float) -> list[DRequest]:
        return [
            r
            for r in self._waiting.values()
            if r.state is DState.WAITING_BLOCKS and now >= r.alloc_at
        ]

    def quarantine_over(self, now: float) -> list[DRequest]:
        """Abandoned requests whose quarantine has a time limit that passed."""
        return [r for r in self._abandoned.values() if now > r.quarantine_until]

    def of_peer(self, key: PeerKey) -> tuple[list[DRequest], list[DRequest]]:
        """(waiting, abandoned) requests drawing from P at ``key``."""
        return (
            [r for r in self._waiting.values() if r.p_key == key],
            [r for r in self._abandoned.values() if r.p_key == key],
        )

    def busy_peers(self) -> set[PeerKey]:
        return {r.p_key for r in self._waiting.values()} | {
            r.p_key for r in self._abandoned.values()
        }

    def heartbeat_groups(self) -> Iterator[tuple[PeerConn, list[str]]]:
        """Per P agent, the transfer ids of the requests registered with it."""
        by_p: dict[str, tuple[PeerConn, list[str]]] = {}
        for r in self._waiting.values():
            if r.state in (DState.REGISTERED, DState.WAITING_BLOCKS) and r.p_conn is not None:
                by_p.setdefault(r.p_conn.agent_name, (r.p_conn, []))[1].append(r.transfer_id)
        return iter(by_p.values())

    # ------------------------------------------------------------------ transitions
    def add(self, req: DRequest) -> None:
        if self.in_use(req.request_id):
            raise ValueError(f"request id {req.request_id} in use")
        self._waiting[req.request_id] = req

    def finish(self, req: DRequest) -> None:
        """Done (ok or failed, nothing more can land): forget it."""
        self._waiting.pop(req.request_id, None)
        req.state = DState.DONE

    def abandon(self, req: DRequest) -> None:
        """Failed while bytes may still land: keep it (and its blocks) until fenced."""
        self._waiting.pop(req.request_id, None)
        req.state = DState.ABANDONED
        self._abandoned[req.request_id] = req

    def release_abandoned(self, req: DRequest) -> None:
        self._abandoned.pop(req.request_id, None)

"""D's request table: every request D is waiting for, and the abandoned ones still quarantined.

Pure (no threads, no I/O); owned by the receiver thread. A request's life::

    NEW ──handshake pending──▶ HANDSHAKING ──▶ REGISTERED ──completions──▶ DONE
      └──────────── P connected ─────────────▶ REGISTERED
    (connected, blocks held back: WAITING_BLOCKS, heartbeating P) ──blocks──▶ REGISTERED
    (any) ──failed/cancelled, bytes may still land──▶ ABANDONED ──fence / late completion──▶ gone

An abandoned request keeps its blocks quarantined (never handed to another request) until P's
fence or the WRITE's own completion says no more bytes can land, or until P is gone.

Housekeeping touches only what is due: deadlines, allocation times and quarantine limits each
have a deadline heap (``DueHeap``), filled when a request is added or abandoned; an entry whose
request moved on is dropped when it comes up. ``n_delayed`` counts the requests held back for
their allocation time (capped by the role, ``kvpush.decode.limits``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from kvpush.peers.handshakes import PeerConn, PeerKey
from kvpush.runtime.timers import DueHeap
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
    p_addr: tuple[str, int]  # P's side channel
    block_ids: np.ndarray
    future: Future[protocol.DecodeRep]
    t_start: float
    deadline: float
    nbytes: int
    state: DState = DState.NEW
    # Tensor parallelism: P's TP size (0 until known: from the request or P's handshake) and
    # the P ranks that write into this D rank (``kvpush.peers.tp.sources``), each connected,
    # registered with, and completing at most ``p_pp_size`` times.
    p_tp: int = 0
    sources: tuple[int, ...] = ()
    p_conns: dict[int, PeerConn] = field(default_factory=dict)
    registered: set[int] = field(default_factory=set)  # PUSH_REG sent to these P ranks
    completions: dict[int, int] = field(default_factory=dict)
    # An abandoned request: the P ranks that may still write into its blocks.
    outstanding: set[int] = field(default_factory=set)
    attempts: int = 0  # re-handshakes after P vanished
    tp_cached: bool = False  # p_tp came from what an earlier request learnt (may be stale)
    relearns: int = 0  # times P's TP size was re-learnt for this request (bounded)
    # vLLM's wire: P's coordinates from its kv_transfer_params (the router contract).
    p_engine_id: str = ""
    p_tp_size: int = 1
    p_pp_size: int = 1
    digest: bool = False  # answer with the sha256 of the received bytes
    # Keep the blocks after an ok answer (the rank group digests every rank's, then frees).
    hold: bool = False
    # An abandoned request whose P cannot fence (vLLM's wire) is released after this time.
    quarantine_until: float = math.inf
    t_abandoned: float = 0.0  # when it was abandoned (its blocks quarantined)
    reported: bool = False  # its long quarantine was reported
    # A request held in D's queue before it gets blocks (as a scheduled vLLM request waits):
    # allocate ``num_blocks`` at ``alloc_at``; P's lease is heartbeated meanwhile.
    num_blocks: int = 0
    alloc_at: float = 0.0
    # Phase stamps (kvpush.telemetry.phases) sent back in the answer; None: stamps are off.
    phases: dict[str, float] | None = None

    def key(self, p_rank: int) -> PeerKey:
        return (self.p_addr[0], self.p_addr[1], p_rank)

    @property
    def p_keys(self) -> list[PeerKey]:
        """The P ranks this request draws from (P's rank 0 while P's TP size is unknown)."""
        return [self.key(s) for s in self.sources] if self.sources else [self.key(0)]

    @property
    def expected(self) -> int:
        """Completions that make the request whole: per source rank, one per pipeline stage."""
        return len(self.sources) * self.p_pp_size

    @property
    def received(self) -> int:
        return sum(self.completions.values())

    def source_of(self, agent_name: str) -> int | None:
        """The source rank whose P agent is ``agent_name`` (None: not one of them)."""
        for s, conn in self.p_conns.items():
            if conn.agent_name == agent_name:
                return s
        return None


class RequestTable:
    def __init__(self) -> None:
        self._waiting: dict[str, DRequest] = {}
        self._abandoned: dict[str, DRequest] = {}
        self._deadlines: DueHeap[DRequest] = DueHeap()
        self._allocs: DueHeap[DRequest] = DueHeap()
        self._quarantines: DueHeap[DRequest] = DueHeap()
        self.n_delayed = 0  # waiting requests not allocated yet (``alloc_at`` > 0)

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
        """Waiting requests past their deadline (each returned once; the caller ends them)."""
        out: list[DRequest] = []
        for r in self._deadlines.pop_due(now):
            if self._waiting.get(r.request_id) is not r:
                continue  # ended since
            if now < r.deadline:
                self._deadlines.push(r.deadline, r)  # moved later since: due then
            else:
                out.append(r)
        return out

    def due_for_blocks(self, now: float) -> list[DRequest]:
        """Held-back requests whose allocation time came and that are ready for blocks; one
        still connecting to P comes up again shortly."""
        out: list[DRequest] = []
        later: list[DRequest] = []
        for r in self._allocs.pop_due(now):
            if self._waiting.get(r.request_id) is not r or r.alloc_at <= 0.0:
                continue
            if r.state is DState.WAITING_BLOCKS:
                out.append(r)
            else:
                later.append(r)
        for r in later:
            self._allocs.push(now + 0.05, r)
        return out

    def allocated(self, req: DRequest) -> None:
        """A held-back request got its blocks (or failed trying)."""
        if req.alloc_at > 0.0:
            req.alloc_at = 0.0
            self.n_delayed -= 1

    def quarantine_over(self, now: float) -> list[DRequest]:
        """Abandoned requests whose quarantine has a time limit that passed."""
        out: list[DRequest] = []
        for r in self._quarantines.pop_due(now):
            if self._abandoned.get(r.request_id) is not r:
                continue
            if now < r.quarantine_until:
                if r.quarantine_until != math.inf:
                    self._quarantines.push(r.quarantine_until, r)
            else:
                out.append(r)
        return out

    def of_peer(self, key: PeerKey) -> tuple[list[DRequest], list[DRequest]]:
        """(waiting, abandoned) requests drawing from the P rank at ``key``."""
        return (
            [r for r in self._waiting.values() if key in r.p_keys],
            [r for r in self._abandoned.values() if key in r.p_keys],
        )

    def busy_among(self, keys: list[PeerKey]) -> set[PeerKey]:
        """Which of ``keys`` some waiting or abandoned request draws from (one pass over the
        table; called only when idle peers are up for eviction)."""
        if not keys:
            return set()
        wanted = set(keys)
        busy: set[PeerKey] = set()
        for r in (*self._waiting.values(), *self._abandoned.values()):
            busy.update(k for k in r.p_keys if k in wanted)
            if busy == wanted:
                break
        return busy

    def heartbeat_groups(self) -> Iterator[tuple[PeerConn, list[str]]]:
        """Per P agent, the transfer ids of the requests registered with it.

        A P rank that only holds abandoned requests' blocks (waiting on its fence) is in it
        too, with no ids: the heartbeat is then only a liveness check, so that a P that died
        with nothing else registered still frees those blocks when the send fails."""
        by_p: dict[str, tuple[PeerConn, list[str]]] = {}
        for r in self._waiting.values():
            if r.state in (DState.REGISTERED, DState.WAITING_BLOCKS):
                for conn in r.p_conns.values():
                    by_p.setdefault(conn.agent_name, (conn, []))[1].append(r.transfer_id)
        for r in self._abandoned.values():
            if r.quarantine_until != math.inf:
                continue  # vLLM's wire: its lease bounds it, and vLLM gets no empty "HB:"
            for rank in r.outstanding:
                held = r.p_conns.get(rank)
                if held is not None:
                    by_p.setdefault(held.agent_name, (held, []))
        return iter(by_p.values())

    def held_by_gone(self) -> list[tuple[DRequest, int]]:
        """(abandoned request, P rank) pairs whose rank can fence nothing any more: D holds no
        connection to it, or the one it holds was evicted (its agent removed). Once per
        heartbeat; the abandoned table is capped."""
        out: list[tuple[DRequest, int]] = []
        for r in self._abandoned.values():
            if r.quarantine_until != math.inf:
                continue  # vLLM's wire: its lease bounds it
            for rank in r.outstanding:
                held = r.p_conns.get(rank)
                if held is None or held.evicted:
                    out.append((r, rank))
        return out

    def long_quarantined(self, now: float, after_s: float) -> list[DRequest]:
        """Abandoned requests quarantined for ``after_s`` or more, each returned once (to be
        reported). One pass over the abandoned table, whose size the pool bounds."""
        out = [
            r for r in self._abandoned.values() if not r.reported and now - r.t_abandoned >= after_s
        ]
        for r in out:
            r.reported = True
        return out

    # ------------------------------------------------------------------ transitions
    def add(self, req: DRequest) -> None:
        if self.in_use(req.request_id):
            raise ValueError(f"request id {req.request_id} in use")
        self._waiting[req.request_id] = req
        self._deadlines.push(req.deadline, req)
        if req.alloc_at > 0.0:
            self.n_delayed += 1
            self._allocs.push(req.alloc_at, req)

    def finish(self, req: DRequest) -> None:
        """Done (ok or failed, nothing more can land): forget it."""
        if self._waiting.pop(req.request_id, None) is req:
            self.allocated(req)
        req.state = DState.DONE

    def abandon(self, req: DRequest) -> None:
        """Failed while bytes may still land: keep it (and its blocks) until fenced."""
        if self._waiting.pop(req.request_id, None) is req:
            self.allocated(req)
        req.state = DState.ABANDONED
        req.t_abandoned = time.monotonic()
        self._abandoned[req.request_id] = req
        if req.quarantine_until != math.inf:
            self._quarantines.push(req.quarantine_until, req)

    def release_abandoned(self, req: DRequest) -> None:
        self._abandoned.pop(req.request_id, None)

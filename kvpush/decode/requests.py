"""D's request table: every request D is waiting for, and the abandoned ones still quarantined.

Pure (no threads, no I/O); owned by the receiver thread. A request is what D was asked
(``DRequest``, frozen) in exactly one typed state at a time::

    Waiting(NEW) ──handshake pending──▶ Waiting(HANDSHAKING) ──▶ Waiting(REGISTERED) ──▶ gone
      └──────────────── P connected ──────────────────────────▶ Waiting(REGISTERED)
    Waiting, delayed (connected, blocks held back: WAITING_BLOCKS) ──blocks──▶ REGISTERED
    Waiting ──failed/cancelled, bytes may still land──▶ Abandoned ──fence / late completion──▶ gone

A waiting request knows the P ranks it draws from (``PRanks``) and which of them it registered
with and heard complete; a delayed one (``Delay``) gets its blocks at its allocation time. An
``Abandoned`` request keeps its blocks quarantined (never handed to another request) until P's
fence or the WRITE's own completion says no more bytes can land from each ``outstanding`` rank,
until P is gone, or -- on vLLM's wire, where P cannot fence -- until ``quarantine_until``. A
request that leaves the table (done, or moved to ``Abandoned``) is ``WaitPhase.ENDED``.

The table moves requests between states and keeps the counts (per phase, delayed, abandoned).
Housekeeping touches only what is due: deadlines, allocation times, quarantine limits and
long-quarantine reports each have a deadline heap (``DueHeap``), filled when a request is added
or abandoned; an entry whose request moved on is dropped when it comes up, or when such
entries outnumber the live ones (``DueHeap.trim``). The deadline and allocation heaps hold
their requests weakly, so an ended one is freed when it ends, not when its entry goes.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from kvpush.decode.limits import QUARANTINE_REPORT_S
from kvpush.peers.handshakes import PeerConn, PeerKey
from kvpush.runtime.timers import DueHeap
from kvpush.telemetry.names import StrEnum
from kvpush.wire import protocol


class WaitPhase(StrEnum):
    NEW = "new"
    HANDSHAKING = "handshaking"
    WAITING_BLOCKS = "waiting_blocks"  # connected to P, blocks not allocated yet
    REGISTERED = "registered"
    ENDED = "ended"  # out of the waiting table: answered, or abandoned (``Abandoned``)


@dataclass(slots=True)  # not frozen: built per push, and a frozen init costs 4x
class DRequest:
    """What D was asked: fixed when the request is taken."""

    request_id: str
    transfer_id: str
    p_addr: tuple[str, int]  # P's side channel
    future: Future[protocol.DecodeRep]
    t_start: float
    deadline: float
    nbytes: int
    digest: bool = False  # answer with the sha256 of the received bytes
    # Keep the blocks after an ok answer (the rank group digests every rank's, then frees).
    hold: bool = False
    # vLLM's wire: P's coordinates from its kv_transfer_params (the router contract).
    p_engine_id: str = ""
    p_tp_size: int = 1
    p_pp_size: int = 1
    # Phase stamps (kvpush.telemetry.phases) sent back in the answer; None: stamps are off.
    phases: dict[str, float] | None = None
    # Told a failed answer just before it is out (``answer``): the rank group's decline to P.
    # On the failure path only -- a done-callback on every future cost each ok request ~2 us
    # on the caller's thread and ~2 us on the receiver's.
    on_failed: Callable[[protocol.DecodeRep], None] | None = None

    def answer(self, rep: protocol.DecodeRep) -> None:
        """The request's one answer out (every answer goes this way): a failed one is told to
        ``on_failed`` first."""
        if self.on_failed is not None and rep.outcome != "ok":
            self.on_failed(rep)
        self.future.set_result(rep)


@dataclass(frozen=True)
class Delay:
    """A request held in D's queue before it gets blocks (as a scheduled vLLM request waits):
    ``num_blocks`` are allocated at ``alloc_at``; P's lease is heartbeated meanwhile."""

    num_blocks: int
    alloc_at: float


@dataclass
class PRanks:
    """The P ranks a request draws from and D's connections to them.

    Tensor parallelism: P's TP size (0 until known: from the request or P's handshake) and
    the P ranks that write into this D rank (``kvpush.peers.tp.sources``)."""

    addr: tuple[str, int]  # P's side channel
    p_tp: int = 0
    sources: tuple[int, ...] = ()
    conns: dict[int, PeerConn] = field(default_factory=dict)
    tp_cached: bool = False  # p_tp came from what an earlier request learnt (may be stale)
    relearns: int = 0  # times P's TP size was re-learnt for this request (bounded: 2)
    attempts: int = 0  # re-handshakes after P vanished under a PUSH_REG (bounded: 1)

    def key(self, p_rank: int) -> PeerKey:
        return (self.addr[0], self.addr[1], p_rank)

    @property
    def keys(self) -> list[PeerKey]:
        """The P ranks drawn from (P's rank 0 while P's TP size is unknown)."""
        return [self.key(s) for s in self.sources] if self.sources else [self.key(0)]

    def source_of(self, agent_name: str) -> int | None:
        """The source rank whose P agent is ``agent_name`` (None: not one of them)."""
        for s, conn in self.conns.items():
            if conn.agent_name == agent_name:
                return s
        return None


#: The block ids of a request that has none yet (read-only, shared: 0.56 us a request saved).
NO_BLOCKS = np.empty(0, dtype=np.int64)
NO_BLOCKS.flags.writeable = False


@dataclass(eq=False)
class Waiting:
    """A request D waits for: connecting to its P ranks, registered with them, completing.

    ``delay``: its blocks are still to come (``block_ids`` empty until then). ``registered``:
    the source ranks sent PUSH_REG; ``completions``: per source rank, at most ``p_pp_size``."""

    req: DRequest
    ranks: PRanks
    block_ids: np.ndarray
    delay: Delay | None = None
    phase: WaitPhase = WaitPhase.NEW
    registered: set[int] = field(default_factory=set)
    completions: dict[int, int] = field(default_factory=dict)

    @property
    def expected(self) -> int:
        """Completions that make the request whole: per source rank, one per pipeline stage."""
        return len(self.ranks.sources) * self.req.p_pp_size

    @property
    def received(self) -> int:
        return sum(self.completions.values())


@dataclass(eq=False)
class Abandoned:
    """A failed request whose blocks stay quarantined while a P rank may still write into them.

    ``outstanding``: those P ranks. ``quarantine_until``: on vLLM's wire (no fence) the
    blocks are released then, when P's lease is over; None: only fences, late completions and
    P's going away release them."""

    req: DRequest
    ranks: PRanks
    block_ids: np.ndarray
    outstanding: set[int]
    t_abandoned: float  # when its blocks were quarantined
    quarantine_until: float | None = None


class RequestTable:
    def __init__(self, report_after_s: float = QUARANTINE_REPORT_S) -> None:
        self._report_after_s = report_after_s
        self._waiting: dict[str, Waiting] = {}
        self._abandoned: dict[str, Abandoned] = {}
        self._counts: dict[WaitPhase, int] = dict.fromkeys(WaitPhase, 0)
        # Held weakly: an ended request's objects are freed when it ends -- hot in the cache --
        # not hundreds at once, cold, when its entry is compacted away or comes up (a busy D
        # spent ~5 us a request so: ``bench rate``, py-spy).
        self._deadlines: DueHeap[weakref.ref[Waiting]] = DueHeap()
        self._allocs: DueHeap[weakref.ref[Waiting]] = DueHeap()
        self._quarantines: DueHeap[Abandoned] = DueHeap()
        self._reports: DueHeap[Abandoned] = DueHeap()
        self.n_delayed = 0  # waiting requests not allocated yet (with a ``delay``)

    # ------------------------------------------------------------------ reads
    def waiting(self, request_id: str) -> Waiting | None:
        return self._waiting.get(request_id)

    def abandoned(self, request_id: str) -> Abandoned | None:
        return self._abandoned.get(request_id)

    def in_use(self, request_id: str) -> bool:
        return request_id in self._waiting or request_id in self._abandoned

    def count(self, phase: WaitPhase) -> int:
        """Waiting requests in ``phase`` (ENDED: none, they left)."""
        return self._counts[phase]

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_abandoned(self) -> int:
        return len(self._abandoned)

    def all_waiting(self) -> list[Waiting]:
        return list(self._waiting.values())

    def _holds(self, w: Waiting) -> bool:
        return self._waiting.get(w.req.request_id) is w

    def _delayed(self, w: Waiting) -> bool:
        return w.delay is not None and self._holds(w)

    def _live(self, ref: weakref.ref[Waiting]) -> bool:
        w = ref()
        return w is not None and self._holds(w)

    def _live_delayed(self, ref: weakref.ref[Waiting]) -> bool:
        w = ref()
        return w is not None and self._delayed(w)

    def _holds_abandoned(self, ab: Abandoned) -> bool:
        return self._abandoned.get(ab.req.request_id) is ab

    def expired(self, now: float) -> list[Waiting]:
        """Waiting requests past their deadline (each returned once; the caller ends them)."""
        return [
            w for r in self._deadlines.pop_due(now) if (w := r()) is not None and self._holds(w)
        ]

    def due_for_blocks(self, now: float) -> list[tuple[Waiting, Delay]]:
        """Held-back requests whose allocation time came and that are ready for blocks, with
        their ``Delay``; one still connecting to P comes up again shortly."""
        out: list[tuple[Waiting, Delay]] = []
        later: list[Waiting] = []
        for r in self._allocs.pop_due(now):
            w = r()
            if w is None or not self._holds(w) or w.delay is None:
                continue
            if w.phase is WaitPhase.WAITING_BLOCKS:
                out.append((w, w.delay))
            else:
                later.append(w)
        for w in later:
            self._allocs.push(now + 0.05, weakref.ref(w))
        return out

    def quarantine_over(self, now: float) -> list[Abandoned]:
        """Abandoned requests whose quarantine has a time limit that passed."""
        return [ab for ab in self._quarantines.pop_due(now) if self._holds_abandoned(ab)]

    def of_peer(self, key: PeerKey) -> tuple[list[Waiting], list[Abandoned]]:
        """(waiting, abandoned) requests drawing from the P rank at ``key``."""
        return (
            [w for w in self._waiting.values() if key in w.ranks.keys],
            [ab for ab in self._abandoned.values() if key in ab.ranks.keys],
        )

    def busy_among(self, keys: list[PeerKey]) -> set[PeerKey]:
        """Which of ``keys`` some waiting or abandoned request draws from (one pass over the
        table; called only when idle peers are up for eviction)."""
        if not keys:
            return set()
        wanted = set(keys)
        busy: set[PeerKey] = set()
        held: Iterator[Waiting | Abandoned] = chain(
            self._waiting.values(), self._abandoned.values()
        )
        for r in held:
            busy.update(k for k in r.ranks.keys if k in wanted)
            if busy == wanted:
                break
        return busy

    def heartbeat_groups(self) -> Iterator[tuple[PeerConn, list[str]]]:
        """Per P agent, the transfer ids of the requests registered with it.

        A P rank that only holds abandoned requests' blocks (waiting on its fence) is in it
        too, with no ids: the heartbeat is then only a liveness check, so that a P that died
        with nothing else registered still frees those blocks when the send fails."""
        by_p: dict[str, tuple[PeerConn, list[str]]] = {}
        for w in self._waiting.values():
            if w.phase in (WaitPhase.REGISTERED, WaitPhase.WAITING_BLOCKS):
                for conn in w.ranks.conns.values():
                    by_p.setdefault(conn.agent_name, (conn, []))[1].append(w.req.transfer_id)
        for ab in self._fenced():
            for rank in ab.outstanding:
                held = ab.ranks.conns.get(rank)
                if held is not None:
                    by_p.setdefault(held.agent_name, (held, []))
        return iter(by_p.values())

    def held_by_gone(self) -> list[tuple[Abandoned, int]]:
        """(abandoned request, P rank) pairs whose rank can fence nothing any more: D holds no
        connection to it, or the one it holds was evicted (its agent removed). Once per
        heartbeat; the abandoned table is capped."""
        out: list[tuple[Abandoned, int]] = []
        for ab in self._fenced():
            for rank in ab.outstanding:
                held = ab.ranks.conns.get(rank)
                if held is None or held.evicted:
                    out.append((ab, rank))
        return out

    def _fenced(self) -> Iterator[Abandoned]:
        """Abandoned requests that wait for fences (on vLLM's wire P's lease bounds them, and
        vLLM gets no empty "HB:")."""
        return (ab for ab in self._abandoned.values() if ab.quarantine_until is None)

    def long_quarantined(self, now: float) -> list[Abandoned]:
        """Abandoned requests quarantined for ``report_after_s`` or more, each returned once
        (to be reported)."""
        return [ab for ab in self._reports.pop_due(now) if self._holds_abandoned(ab)]

    # ------------------------------------------------------------------ transitions
    def add(self, w: Waiting) -> None:
        if self.in_use(w.req.request_id):
            raise ValueError(f"request id {w.req.request_id} in use")
        self._waiting[w.req.request_id] = w
        self._counts[w.phase] += 1
        ref = weakref.ref(w)
        self._deadlines.push(w.req.deadline, ref)
        self._deadlines.trim(len(self._waiting), self._live)
        if w.delay is not None:
            self.n_delayed += 1
            self._allocs.push(w.delay.alloc_at, ref)
            self._allocs.trim(self.n_delayed, self._live_delayed)

    def move(self, w: Waiting, phase: WaitPhase) -> None:
        """A waiting request's next phase (HANDSHAKING, WAITING_BLOCKS, REGISTERED)."""
        if self._holds(w):
            self._counts[w.phase] -= 1
            self._counts[phase] += 1
        w.phase = phase

    def allocated(self, w: Waiting, block_ids: np.ndarray) -> None:
        """A held-back request got its blocks."""
        w.block_ids = block_ids
        self._undelay(w)

    def _undelay(self, w: Waiting) -> None:
        if w.delay is not None:
            w.delay = None
            self.n_delayed -= 1

    def _leave(self, w: Waiting) -> None:
        if self._holds(w):  # (another request under its id stays)
            del self._waiting[w.req.request_id]
            self._counts[w.phase] -= 1
            self._undelay(w)
        w.phase = WaitPhase.ENDED

    def finish(self, w: Waiting) -> None:
        """Done (ok or failed, nothing more can land): forget it."""
        self._leave(w)

    def abandon(
        self, w: Waiting, outstanding: set[int], quarantine_until: float | None = None
    ) -> Abandoned:
        """Failed while bytes may still land from the ``outstanding`` P ranks: keep it (and its
        blocks) until fenced, or until ``quarantine_until`` (P cannot fence)."""
        self._leave(w)
        now = time.monotonic()
        ab = Abandoned(w.req, w.ranks, w.block_ids, set(outstanding), now, quarantine_until)
        self._abandoned[w.req.request_id] = ab
        if quarantine_until is not None:
            self._quarantines.push(quarantine_until, ab)
            self._quarantines.trim(len(self._abandoned), self._holds_abandoned)
        self._reports.push(now + self._report_after_s, ab)
        self._reports.trim(len(self._abandoned), self._holds_abandoned)
        return ab

    def release_abandoned(self, ab: Abandoned) -> None:
        if self._holds_abandoned(ab):
            del self._abandoned[ab.req.request_id]

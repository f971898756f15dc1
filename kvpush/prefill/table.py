"""P's push table: the one place a transfer's state lives, from finished blocks to a done WRITE.

Pure (no threads, no I/O); owned by the writer thread. Each transfer key (the transfer id, or
the request id when a PUSH_REG carries none) is in exactly one typed state::

    Finished ──PUSH_REG──▶ (matched) ──▶ AwaitingHandshake ──▶ Writing ──▶ gone
    Registered ──blocks──▶ (matched) ──▶ Writing ──▶ gone            (P->D peer already connected)
    Registered ──Cancel──▶ CancelledEarly ──blocks──▶ gone (blocks freed at once)

A push may need several registrations: when D has k times P's ranks, each of P's pages is written
in k chunks to k D ranks, each of which registers; the push is matched once all k are here, and its
WRITEs are its *legs*, one per D rank.

Either side may arrive first. Finished blocks are held under a lease from when they finish, renewed
by D's heartbeats while D waits; an expired lease gives them back. A registration that never meets
its blocks is dropped after ``reg_ttl_s`` (D's own deadline fails it on D's side). Matching is O(1)
per arrival; expiry touches only what is due: each waiting state enters a deadline heap when set
(``DueHeap``: a renewed lease goes back in at its new time, an entry whose state moved on is
dropped when it comes up), so a hundred thousand declined ids cost a housekeeping tick nothing.

In-flight WRITEs (legs, or a ``Batch`` of coalesced legs) and fences are also indexed here, by NIXL
handle and per peer in posting order (``queues``): WRITEs on one connection complete in order, so
the writer polls each peer's oldest first and stops at the first one still in progress; a periodic
sweep (``inflight``) polls all.

The records that arrive and leave (``Finished``, ``Registration``, ``Push``, ``PushOutcome``) are
``kvpush.prefill.records``; this module re-exports them.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvpush.peers.handshakes import PeerConn, PeerKey
from kvpush.prefill.records import Finished, Push, PushOutcome, Registration, reg_key
from kvpush.runtime.timers import DueHeap
from kvpush.transport.nixl import Xfer

# --------------------------------------------------------------------------- the typed states


@dataclass
class Waiting:
    """Finished blocks awaiting D's PUSH_REGs (``regs`` has those already here), under a lease."""

    finished: Finished
    lease_until: float
    regs: dict[int, Registration] = field(default_factory=dict)  # by D rank
    expected: int = 0  # registrations the push needs; 0 until the first one says


@dataclass
class Registered:
    """PUSH_REGs (one per target D rank, ``expected`` of them) awaiting P's blocks."""

    regs: dict[int, Registration]
    expected: int = 1

    @property
    def registration(self) -> Registration:
        return next(iter(self.regs.values()))


@dataclass
class AwaitingHandshake:
    """Matched; P->D handshakes run in the background. ``cancelled``: D cancelled meanwhile."""

    push: Push
    cancelled: bool = False


@dataclass
class Leg:
    """One posted WRITE of a push: P's share (or chunk) into one D rank."""

    writing: Writing
    registration: Registration
    xfer: Xfer
    conn: PeerConn
    t_post: float
    deadline: float
    nbytes: int
    post_s: float = 0.0  # spent in NIXL's prep+post calls (``kvpush.prefill.lanestats``)

    @property
    def push(self) -> Push:
        return self.writing.push

    @property
    def d_rank(self) -> int:
        return self.registration.reg.decode_tp_rank


@dataclass
class Batch:
    """One WRITE of several pushes' legs to one D rank (``Completions``): ended as one."""

    xfer: Xfer
    conn: PeerConn
    t_post: float
    deadline: float
    nbytes: int
    legs: list[Leg]
    post_s: float = 0.0


@dataclass
class Writing:
    """A push whose WRITEs are posted: legs still in flight, and how the others ended."""

    push: Push
    legs: dict[int, Leg] = field(default_factory=dict)  # in flight, by D rank
    failed: dict[int, tuple[str, bool]] = field(default_factory=dict)  # reason, may_have_written
    nbytes: int = 0  # of the legs that completed
    unposted: int = 0  # legs not posted yet (the push is not over while any is left)
    settled: bool = False
    released: bool = False  # its blocks went back with its batch's (``Legs.complete``)
    t_start: float = 0.0  # monotonic: legs started (handshakes done)
    t_posted: float = 0.0  # monotonic: last WRITE posted
    t_done: float = 0.0  # monotonic: last WRITE seen done


@dataclass
class CancelledEarly:
    """D cancelled or declined before P's blocks finished: free them the moment they do (the
    push ends with ``reason``). ``refused``: P itself refused the transfer: a registration that
    arrives is declined back to its D at once."""

    since: float
    reason: str = "cancelled"
    detail: str = "cancelled by D"
    refused: bool = False


@dataclass(frozen=True)
class FenceEntry:
    """A quarantined transfer a fence covers: P's key, one of D's blocks of it, D's request id,
    and the D incarnation its WRITE went to (the block is that incarnation's; "" if unknown)."""

    key: str
    d_block: int
    d_request_id: str
    incarnation: str = ""


@dataclass
class FenceWrite:
    """A posted fence: a one-block WRITE + Fence notification to one peer."""

    fence_id: str
    xfer: Xfer
    conn: PeerConn
    t_post: float
    deadline: float
    nbytes: int
    entries: list[FenceEntry] = field(default_factory=list)


State = Waiting | Registered | AwaitingHandshake | Writing | CancelledEarly
InFlight = Leg | Batch | FenceWrite


class DuplicateError(ValueError):
    pass


class PushTable:
    def __init__(self, lease_s: float, reg_ttl_s: float) -> None:
        self.lease_s = lease_s
        self.reg_ttl_s = reg_ttl_s
        self._states: dict[str, State] = {}
        self._inflight: dict[int, InFlight] = {}
        # Per peer, its in-flight entries in posting order (the oldest first).
        self._queues: dict[PeerKey, OrderedDict[int, InFlight]] = {}
        self._counts: dict[type, int] = dict.fromkeys(
            (Waiting, Registered, AwaitingHandshake, Writing, CancelledEarly), 0
        )
        # When each waiting state (Waiting, Registered, CancelledEarly) expires; held weakly: a
        # state that moved on (matched, mostly) is freed then, not later, cold, in a compaction.
        self._due: DueHeap[tuple[str, weakref.ref[State]]] = DueHeap()

    # ------------------------------------------------------------------ reads
    def get(self, key: str) -> State | None:
        return self._states.get(key)

    def count(self, kind: type) -> int:
        return self._counts[kind]

    def __len__(self) -> int:
        return len(self._states)

    def _regs_of(self, key: str) -> Iterable[Registration]:
        st = self._states.get(key)
        if isinstance(st, (Registered, Waiting)):
            return st.regs.values()
        return st.push.registrations if isinstance(st, (AwaitingHandshake, Writing)) else ()

    def senders(self, key: str) -> set[str]:
        """The NIXL agents whose PUSH_REGs P holds for ``key`` (registered, matched, writing)."""
        return {r.sender for r in self._regs_of(key)}

    def inflight(self) -> list[InFlight]:
        """A copy: the caller may complete or abandon entries while iterating."""
        return list(self._inflight.values())

    def tracks(self, entry: InFlight) -> bool:
        """Whether ``entry`` is still in flight here."""
        return self._inflight.get(id(entry.xfer)) is entry

    def has_inflight(self) -> bool:
        return bool(self._inflight)

    def queues(self) -> list[OrderedDict[int, InFlight]]:
        """Each peer's in-flight entries, oldest first (live: ``done`` removes from them)."""
        return list(self._queues.values())

    def peers_in_flight(self) -> set[PeerKey]:
        return set(self._queues)

    def legs_to(self, peer: PeerKey) -> list[InFlight]:
        q = self._queues.get(peer)
        return list(q.values()) if q else []

    def request_ids(self, key: str) -> set[str]:
        """D's request ids of the PUSH_REGs P holds for ``key``."""
        return {r.reg.request_id for r in self._regs_of(key)}

    def waiting_handshake(self) -> Iterator[AwaitingHandshake]:
        return (s for s in list(self._states.values()) if isinstance(s, AwaitingHandshake))

    # ------------------------------------------------------------------ transitions
    def _set(self, key: str, st: State) -> None:
        old = self._states.get(key)
        if old is not None:
            self._counts[type(old)] -= 1
        self._states[key] = st
        self._counts[type(st)] += 1
        due = self._due_at(st)
        if due is not None:
            self._due.push(due, (key, weakref.ref(st)))
            self._due.trim(len(self._states), self._current)

    def _current(self, entry: tuple[str, weakref.ref[State]]) -> bool:  # (a due entry)
        st = entry[1]()
        return st is not None and self._states.get(entry[0]) is st

    def _due_at(self, st: State) -> float | None:
        if isinstance(st, Waiting):
            return st.lease_until
        # Registrations and early cancels expire once *past* their TTL (strictly later).
        if isinstance(st, Registered):
            return math.nextafter(st.registration.t_arrived + self.reg_ttl_s, math.inf)
        if isinstance(st, CancelledEarly):
            return math.nextafter(st.since + self.reg_ttl_s, math.inf)
        return None

    def pop(self, key: str) -> State | None:
        st = self._states.pop(key, None)
        if st is not None:
            self._counts[type(st)] -= 1
        return st

    def add_finished(self, f: Finished, now: float) -> Push | CancelledEarly | None:
        """P's blocks finished: the matched push, the early cancel they meet, or None (wait)."""
        st = self._states.get(f.key)
        if isinstance(st, CancelledEarly):
            self.pop(f.key)
            if not st.refused:
                return st
            st = None  # P refused it earlier; these blocks are a new prefill of the transfer
        if isinstance(st, Registered):
            if len(st.regs) >= st.expected:
                self.pop(f.key)
                return Push(f, _in_rank_order(st.regs))
            self._set(f.key, Waiting(f, now + self.lease_s, st.regs, st.expected))
            return None
        if isinstance(st, Waiting):
            raise DuplicateError(f"transfer {f.key} already finished and waiting")
        if st is not None:
            raise DuplicateError(f"transfer {f.key} already matched ({type(st).__name__})")
        self._set(f.key, Waiting(f, now + self.lease_s))
        return None

    def add_registration(self, r: Registration, expected: int = 1) -> Push | CancelledEarly | None:
        """D's PUSH_REG (from one D rank; ``expected`` of them make the push): the matched
        push, an early cancel it meets, or None (wait for blocks or the other D ranks)."""
        st = self._states.get(r.key)
        rank = r.reg.decode_tp_rank
        if isinstance(st, CancelledEarly):
            if st.refused:
                return st
            # D cancelled or declined it before; this registration is D trying it again.
            self.pop(r.key)
            st = None
        if isinstance(st, (Waiting, Registered)):
            if rank in st.regs:
                raise DuplicateError(f"transfer {r.key} already registered (D rank {rank})")
            st.regs[rank] = r
            st.expected = max(st.expected, expected)
            if isinstance(st, Waiting) and len(st.regs) >= st.expected:
                self.pop(r.key)
                return Push(st.finished, _in_rank_order(st.regs))
            return None
        if st is not None:
            raise DuplicateError(f"transfer {r.key} already matched ({type(st).__name__})")
        self._set(r.key, Registered({rank: r}, expected))
        return None

    def await_handshake(self, push: Push) -> None:
        self._set(push.key, AwaitingHandshake(push))

    def writing(self, w: Writing) -> None:
        self._set(w.push.key, w)

    def leg_posted(self, entry: Leg | Batch) -> None:
        for leg in entry.legs if isinstance(entry, Batch) else (entry,):
            leg.writing.legs[leg.d_rank] = leg
        self._track(entry)

    def _track(self, entry: InFlight) -> None:
        k = id(entry.xfer)
        self._inflight[k] = entry
        q = self._queues.get(entry.conn.key)
        if q is None:
            q = self._queues[entry.conn.key] = OrderedDict()
        q[k] = entry

    def forget(self, w: Writing) -> None:
        """A push none of whose WRITEs could be posted."""
        if self._states.get(w.push.key) is w:
            self.pop(w.push.key)

    def fence_posted(self, fw: FenceWrite) -> None:
        self._track(fw)

    def done(self, entry: InFlight) -> Writing | None:
        """A WRITE leg, batch or fence completed or was abandoned: forget it. Returns the
        push's Writing once its last leg is gone (the caller then settles it), else None."""
        k = id(entry.xfer)
        if self._inflight.get(k) is entry:
            del self._inflight[k]
            peer = entry.conn.key
            q = self._queues[peer]
            del q[k]
            if not q:
                del self._queues[peer]
        if isinstance(entry, (FenceWrite, Batch)):
            return None  # (a batch's legs then end one by one: ``done`` of each)
        w = entry.writing
        w.legs.pop(entry.d_rank, None)
        if w.legs or w.unposted:
            return None
        if self._states.get(w.push.key) is w:
            self.pop(w.push.key)
        return w

    def cancel_early(
        self,
        key: str,
        now: float,
        reason: str = "cancelled",
        detail: str = "cancelled by D",
        refused: bool = False,
    ) -> None:
        self._set(key, CancelledEarly(now, reason, detail, refused))

    # ------------------------------------------------------------------ leases and expiry
    def renew(self, keys: list[str], now: float) -> int:
        """Heartbeat: extend each waiting lease to at least now + 2/3 of its length."""
        n = 0
        ext = now + self.lease_s * 2 / 3
        for k in keys:
            st = self._states.get(k)
            if isinstance(st, Waiting):
                if st.lease_until < ext:
                    st.lease_until = ext
                n += 1
        return n

    def expire(self, now: float) -> tuple[list[Finished], list[Registration]]:
        """Remove and return finished transfers whose lease lapsed, and stale registrations
        (early cancels are forgotten after the registration TTL too)."""
        fins: list[Finished] = []
        regs: list[Registration] = []
        for k, ref in self._due.pop_due(now):
            st = ref()
            if st is None or self._states.get(k) is not st:
                continue  # moved on since: matched, cancelled, popped
            if isinstance(st, Waiting):
                if st.lease_until > now:  # renewed by D's heartbeats: due again later
                    self._due.push(st.lease_until, (k, ref))
                    continue
                self.pop(k)
                fins.append(st.finished)
                regs.extend(st.regs.values())  # D ranks that registered: the push is off
            elif isinstance(st, Registered):
                self.pop(k)
                regs.extend(st.regs.values())
            elif isinstance(st, CancelledEarly):
                self.pop(k)
        return fins, regs

    def drain_waiting(self) -> tuple[list[Finished], list[Registration]]:
        """Shutdown: remove every transfer not yet matched."""
        fins: list[Finished] = []
        regs: list[Registration] = []
        for k, st in list(self._states.items()):
            if isinstance(st, Waiting):
                fins.append(st.finished)
                regs.extend(st.regs.values())
                self.pop(k)
            elif isinstance(st, Registered):
                regs.extend(st.regs.values())
                self.pop(k)
            elif isinstance(st, CancelledEarly):
                self.pop(k)
        self._due.clear()
        return fins, regs


def _in_rank_order(regs: dict[int, Registration]) -> tuple[Registration, ...]:
    return tuple(regs.values()) if len(regs) == 1 else tuple(regs[r] for r in sorted(regs))


__all__ = [
    "AwaitingHandshake",
    "Batch",
    "CancelledEarly",
    "DuplicateError",
    "FenceEntry",
    "FenceWrite",
    "Finished",
    "InFlight",
    "Leg",
    "Push",
    "PushOutcome",
    "PushTable",
    "Registered",
    "Registration",
    "State",
    "Waiting",
    "Writing",
    "reg_key",
]

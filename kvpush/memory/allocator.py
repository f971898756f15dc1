"""Block ownership bookkeeping of one pool: pure (no torch, no NIXL), thread-safe (one lock).

Block states (``BlockState``)::

    FREE --allocate--> ALLOCATED <--mark_inflight / mark_allocated--> INFLIGHT
    ALLOCATED | INFLIGHT --release--> FREE
    ALLOCATED | INFLIGHT --quarantine--> QUARANTINED --release_quarantined--> FREE

QUARANTINED exists because releasing an in-flight NIXL transfer does not stop its bytes
(DESIGN.md section 3): blocks of a cancelled push may be reused only after a fence, so they stay
out of the free space, still listed under their owner, until ``release_quarantined``.

Two free-space policies share that state machine (``_Allocator``):

* ``BlockAllocator`` (the pool's, the default): an **extent free list** that keeps runs of
  consecutive ids together. Freed runs coalesce with free neighbours; a request of ``n`` blocks
  takes the smallest free run of at least ``n`` (best fit by run length, lowest id on ties) and,
  when no run is long enough, the fewest runs (the longest ones, the last piece best fit).
  Why: NIXL merges descriptors of consecutive blocks (local *and* remote), and a descriptor
  costs a fixed few us; at 4 KiB pages shuffled ids ran 5x slower than contiguous ones
  (DESIGN.md section 3, issue 10). O(log R) per allocate/release in the number R of free runs
  (a ``SortedList`` of ``(length, start)`` keys, dicts of run starts and ends).
* ``FreeListAllocator``: the plain LIFO stack of block ids kvpush used before -- a baseline for
  comparisons only, so that the same churn can be measured on both.

``fragmentation()`` is a pure reading (``Fragmentation``) for telemetry: mean run length of the
current allocations, number and largest of the free runs, a free-run-length histogram.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Sequence

import numpy as np
from sortedcontainers import SortedList

from kvpush.errors import NoFreeBlocksError
from kvpush.memory.fragmentation import Fragmentation, runs_in, trimmed

_INT32_MAX = 2**31 - 1
_HIST_BUCKETS = 32  # power-of-two buckets: run lengths 1 .. 2^32-1 (num_blocks < 2^31)
_START_BITS = 32
_START_MASK = (1 << _START_BITS) - 1
#: A 1-block id array is this one copied and set: 0.34 us, where ``np.array((start,), ...)``
#: took 0.94 (a 1-block allocation is the commonest small one; P and D each make one a push).
_ONE_ID = np.zeros(1, dtype=np.int64)


class BlockState(enum.IntEnum):
    FREE = 0
    ALLOCATED = 1
    INFLIGHT = 2
    QUARANTINED = 3


_COUNT_KEYS = {
    BlockState.FREE: "free",
    BlockState.ALLOCATED: "allocated",
    BlockState.INFLIGHT: "inflight",
    BlockState.QUARANTINED: "quarantined",
}


class _Allocator:
    """The owner state machine shared by both policies; subclasses own the free space.

    An owner (a request id) holds one set of blocks, all in the same state. Misuse by the
    caller (a transition from the wrong state, an unknown owner for a transition) raises
    ``ValueError``: it is a bug in kvpush, not an operator error.

    Subclasses implement, called under the lock: ``_take(owner, n)`` (remove ``n`` <= free
    blocks from the free space for ``owner``, return their ids and the number of runs they
    form), ``_give(owner, ids)`` (put the owner's blocks back; ``_give_all`` does several
    owners', one by one unless a policy does better) and ``_free_summary()`` (free runs,
    largest, histogram).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0 or num_blocks > _INT32_MAX:
            raise ValueError(f"num_blocks must be in 1..{_INT32_MAX}, got {num_blocks}")
        self.num_blocks = num_blocks
        self._lock = threading.Lock()
        self._blocks: dict[str, np.ndarray] = {}
        self._owner_state: dict[str, BlockState] = {}
        self._owner_runs: dict[str, int] = {}
        self._reasons: dict[str, str] = {}
        self._counts = dict.fromkeys(BlockState, 0)
        self._counts[BlockState.FREE] = num_blocks
        self._held_runs = 0

    # -- public API -----------------------------------------------------------------------

    def allocate(self, owner: str, n: int) -> np.ndarray:
        """Give ``owner`` ``n`` free blocks (int64 ids), all or nothing."""
        if n <= 0:
            raise ValueError(f"allocate needs n > 0, got {n} for {owner!r}")
        with self._lock:
            if owner in self._blocks:
                raise ValueError(
                    f"owner {owner!r} already holds {self._blocks[owner].size} blocks "
                    f"({self._owner_state[owner].name})"
                )
            nfree = self._counts[BlockState.FREE]
            if n > nfree:
                raise NoFreeBlocksError(
                    f"no_free_blocks: need {n}, {nfree} free of {self.num_blocks}"
                )
            ids, runs = self._take(owner, n)
            self._blocks[owner] = ids
            self._owner_state[owner] = BlockState.ALLOCATED
            self._owner_runs[owner] = runs
            self._held_runs += runs
            self._counts[BlockState.FREE] -= n
            self._counts[BlockState.ALLOCATED] += n
            return ids.copy()

    def mark_inflight(self, owner: str) -> None:
        """ALLOCATED -> INFLIGHT (a WRITE into or out of these blocks was posted)."""
        with self._lock:
            self._transition(owner, (BlockState.ALLOCATED,), BlockState.INFLIGHT)

    def mark_allocated(self, owner: str) -> None:
        """INFLIGHT -> ALLOCATED (the WRITE completed)."""
        with self._lock:
            self._transition(owner, (BlockState.INFLIGHT,), BlockState.ALLOCATED)

    def release(self, owner: str) -> int:
        """Free the owner's ALLOCATED/INFLIGHT blocks; return how many (0: unknown owner).

        Quarantined blocks are not released here (0 is returned): see ``release_quarantined``.
        """
        with self._lock:
            state = self._owner_state.get(owner)
            if state not in (BlockState.ALLOCATED, BlockState.INFLIGHT):
                return 0
            return self._free_owner(owner)

    def release_many(self, owners: Iterable[str]) -> int:
        """``release`` of each owner in turn, under one lock (the free space ends the same);
        the total freed. The extent allocator first joins the runs they free among themselves:
        a batch of pushes whose blocks follow on costs one run's bookkeeping, not one each."""
        with self._lock:
            held = (BlockState.ALLOCATED, BlockState.INFLIGHT)
            freed = [(o, self._detach(o)) for o in owners if self._owner_state.get(o) in held]
            if freed:
                self._give_all(freed)
            return sum(int(ids.size) for _, ids in freed)

    def quarantine(self, owner: str, reason: str) -> int:
        """Move the owner's blocks to QUARANTINED (kept under ``owner``); return how many moved.

        Unknown owner -> 0. Already quarantined -> 0, and the first reason is kept.
        """
        with self._lock:
            state = self._owner_state.get(owner)
            if state not in (BlockState.ALLOCATED, BlockState.INFLIGHT):
                return 0
            n = self._transition(owner, (state,), BlockState.QUARANTINED)
            self._reasons[owner] = reason
            return n

    def release_quarantined(self, owner: str) -> int:
        """QUARANTINED -> FREE (after the fence); return how many (0 if not quarantined)."""
        with self._lock:
            if self._owner_state.get(owner) is not BlockState.QUARANTINED:
                return 0
            del self._reasons[owner]
            return self._free_owner(owner)

    def blocks_of(self, owner: str) -> np.ndarray:
        """A copy of the owner's block ids, in allocation order; empty if unknown."""
        with self._lock:
            ids = self._blocks.get(owner)
            return ids.copy() if ids is not None else np.empty(0, dtype=np.int64)

    def state_of(self, owner: str) -> BlockState | None:
        with self._lock:
            return self._owner_state.get(owner)

    def owners(self) -> list[str]:
        """Every owner holding blocks, in any state (quarantined included)."""
        with self._lock:
            return list(self._blocks)

    def quarantined(self) -> dict[str, str]:
        """Owner -> reason of every quarantined owner."""
        with self._lock:
            return dict(self._reasons)

    def counts(self) -> dict[str, int]:
        """Consistent snapshot: total, free, allocated, inflight, quarantined (block counts)."""
        with self._lock:
            out = {"total": self.num_blocks}
            out.update({_COUNT_KEYS[s]: c for s, c in self._counts.items()})
            return out

    def fragmentation(self) -> Fragmentation:
        """Consistent snapshot of how fragmented the pool is (see ``Fragmentation``)."""
        with self._lock:
            runs, largest, hist = self._free_summary()
            free = self._counts[BlockState.FREE]
            return Fragmentation(
                total=self.num_blocks,
                free=free,
                free_runs=runs,
                largest_free_run=largest,
                free_run_hist=trimmed(hist),
                alloc_blocks=self.num_blocks - free,
                alloc_runs=self._held_runs,
            )

    # -- under the lock -------------------------------------------------------------------

    def _transition(self, owner: str, allowed: tuple[BlockState, ...], to: BlockState) -> int:
        state = self._owner_state.get(owner)
        if state is None:
            raise ValueError(f"owner {owner!r} holds no blocks (cannot move them to {to.name})")
        if state not in allowed:
            raise ValueError(f"owner {owner!r} blocks are {state.name}, cannot move to {to.name}")
        n = int(self._blocks[owner].size)
        self._owner_state[owner] = to
        self._counts[state] -= n
        self._counts[to] += n
        return n

    def _free_owner(self, owner: str) -> int:
        ids = self._detach(owner)
        self._give(owner, ids)
        return int(ids.size)

    def _detach(self, owner: str) -> np.ndarray:
        """Forget ``owner`` and count its blocks free; the caller gives them back."""
        ids = self._blocks.pop(owner)
        state = self._owner_state.pop(owner)
        self._held_runs -= self._owner_runs.pop(owner)
        n = int(ids.size)
        self._counts[state] -= n
        self._counts[BlockState.FREE] += n
        return ids

    def _give_all(self, freed: list[tuple[str, np.ndarray]]) -> None:
        for owner, ids in freed:
            self._give(owner, ids)

    def _take(self, owner: str, n: int) -> tuple[np.ndarray, int]:  # pragma: no cover
        raise NotImplementedError

    def _give(self, owner: str, ids: np.ndarray) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _free_summary(self) -> tuple[int, int, list[int]]:  # pragma: no cover - abstract
        raise NotImplementedError


class BlockAllocator(_Allocator):
    """The pool's allocator: an extent free list, best fit by run length, coalescing on free.

    Free space is a set of maximal runs ``[start, start+length)`` (neighbouring free runs are
    always merged). ``allocate(owner, n)``:

    1. the smallest free run with ``length >= n`` (lowest start among equals) gives its first
       ``n`` ids; the rest of it stays a free run;
    2. if no run is that long: the longest runs are taken whole until what is left fits in
       one run, which is then chosen by rule 1 -- the fewest runs that can hold ``n``.

    Ids come back ascending (pieces in address order), so a fresh pool hands out 0, 1, 2, ...
    and a released request's run is the first candidate for the next request of its size.
    """

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._by_len = SortedList()  # (length << 32) | start of every free run
        self._len_at: dict[int, int] = {}  # free run start -> length
        self._start_at_end: dict[int, int] = {}  # free run end (exclusive) -> start
        self._hist = [0] * _HIST_BUCKETS
        self._pieces: dict[str, list[tuple[int, int]]] = {}  # owner -> its runs (start, len)
        self._add_run(0, num_blocks)

    def free_runs(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every free run, by start (a reading for tests and baselines)."""
        with self._lock:
            return sorted(self._len_at.items())

    def _add_run(self, start: int, length: int) -> None:
        self._by_len.add((length << _START_BITS) | start)
        self._len_at[start] = length
        self._start_at_end[start + length] = start
        self._hist[length.bit_length() - 1] += 1

    def _del_run(self, start: int, length: int) -> None:
        self._by_len.remove((length << _START_BITS) | start)
        del self._len_at[start]
        del self._start_at_end[start + length]
        self._hist[length.bit_length() - 1] -= 1

    def _take(self, owner: str, n: int) -> tuple[np.ndarray, int]:
        if n == 1:
            return self._take_one(owner)
        pieces: list[tuple[int, int]] = []
        left = n
        while True:
            i = self._by_len.bisect_left(left << _START_BITS)
            if i < len(self._by_len):  # best fit for what is left
                pieces.append((self._cut(i, left), left))
                break
            # No run holds the rest: take the longest whole (the caller checked n <= free).
            key = int(self._by_len[-1])
            start, length = key & _START_MASK, key >> _START_BITS
            self._del_run(start, length)
            pieces.append((start, length))
            left -= length
        self._pieces[owner] = pieces
        if len(pieces) == 1:
            s, k = pieces[0]
            return np.arange(s, s + k, dtype=np.int64), 1
        pieces.sort()
        ids = np.concatenate([np.arange(s, s + k, dtype=np.int64) for s, k in pieces])
        return ids, len(pieces)

    def _take_one(self, owner: str) -> tuple[np.ndarray, int]:
        """One block (a 1-block request, the commonest small one): rule 1 in one step -- the
        shortest run, lowest start among equals, is the sorted list's first."""
        start = self._cut(0, 1)
        self._pieces[owner] = [(start, 1)]
        ids = _ONE_ID.copy()
        ids[0] = start
        return ids, 1

    def _cut(self, i: int, k: int) -> int:
        """Take the first ``k`` blocks of the free run at ``i`` in the sorted list (``k`` <= its
        length); its start. The run is popped by index and its rest put back, in place of a
        search-and-remove and a fresh add through ``_del_run``/``_add_run``."""
        key = int(self._by_len.pop(i))
        start, length = key & _START_MASK, key >> _START_BITS
        hist = self._hist
        hist[length.bit_length() - 1] -= 1
        del self._len_at[start]
        if length > k:
            rest, at = length - k, start + k
            self._by_len.add((rest << _START_BITS) | at)
            self._len_at[at] = rest
            self._start_at_end[start + length] = at
            hist[rest.bit_length() - 1] += 1
        else:
            del self._start_at_end[start + length]
        return start

    def _give(self, owner: str, ids: np.ndarray) -> None:
        for start, length in self._pieces.pop(owner):  # (from distinct free runs: apart)
            self._free_run(start, length)

    def _give_all(self, freed: list[tuple[str, np.ndarray]]) -> None:
        # The owners' pieces joined among themselves first (they never overlap: each block
        # has one owner), then each joined run once with its free neighbours.
        pieces = sorted(p for owner, _ in freed for p in self._pieces.pop(owner))
        s, k = pieces[0]
        for start, length in pieces[1:]:
            if start == s + k:
                k += length
            else:
                self._free_run(s, k)
                s, k = start, length
        self._free_run(s, k)

    def _free_run(self, s: int, k: int) -> None:
        """``[s, s + k)`` is free again: one run with its free neighbours on either side."""
        left_start = self._start_at_end.get(s)
        if left_start is not None:
            left_len = s - left_start
            self._del_run(left_start, left_len)
            s, k = left_start, k + left_len
        right_len = self._len_at.get(s + k)
        if right_len is not None:
            self._del_run(s + k, right_len)
            k += right_len
        self._add_run(s, k)

    def _free_summary(self) -> tuple[int, int, list[int]]:
        largest = int(self._by_len[-1]) >> _START_BITS if self._by_len else 0
        return len(self._by_len), largest, list(self._hist)


#: The pool's allocator under the name of its policy.
ExtentAllocator = BlockAllocator


class FreeListAllocator(_Allocator):
    """Baseline only (to compare the extent allocator with): the plain LIFO stack of free ids.

    Hands out the top ``n`` ids of the stack and pushes an owner's ids back in reverse on
    release, so the next request of the same size gets the same ids; a fresh pool hands out
    ``order`` (default ``0, 1, 2, ...``). Under churn of mixed sizes the stack interleaves
    ids of many past requests, and runs shrink. ``fragmentation()`` sorts the free ids
    (O(F log F)): fine for a measurement, not for a hot telemetry path.
    """

    def __init__(self, num_blocks: int, order: Sequence[int] | np.ndarray | None = None) -> None:
        super().__init__(num_blocks)
        first = (
            np.arange(num_blocks, dtype=np.int64)
            if order is None
            else np.asarray(order, dtype=np.int64).reshape(-1)
        )
        if first.size != num_blocks or not np.array_equal(
            np.sort(first), np.arange(num_blocks, dtype=np.int64)
        ):
            raise ValueError("order must be a permutation of range(num_blocks)")
        # _free[:_nfree] are free ids, the top at the end; reversed so that popping n gives
        # order[0..n-1] first.
        self._free = first[::-1].copy()
        self._nfree = num_blocks

    def _take(self, owner: str, n: int) -> tuple[np.ndarray, int]:
        top = self._nfree
        ids = self._free[top - n : top][::-1].copy()
        self._nfree = top - n
        return ids, runs_in(ids)

    def _give(self, owner: str, ids: np.ndarray) -> None:
        n = int(ids.size)
        self._free[self._nfree : self._nfree + n] = ids[::-1]
        self._nfree += n

    def _free_summary(self) -> tuple[int, int, list[int]]:
        free = np.sort(self._free[: self._nfree])
        hist = [0] * _HIST_BUCKETS
        if free.size == 0:
            return 0, 0, hist
        cut = np.flatnonzero(np.diff(free) != 1) + 1
        lens = np.diff(np.concatenate(([0], cut, [free.size])))
        for length in lens.tolist():
            hist[length.bit_length() - 1] += 1
        return int(lens.size), int(lens.max()), hist


#: Allocator classes by policy name (for a measurement that picks one by name).
ALLOCATORS: dict[str, type[_Allocator]] = {
    "extent": BlockAllocator,
    "freelist": FreeListAllocator,
}

"""Block ownership bookkeeping of one pool: pure (no torch, no NIXL), thread-safe (one lock).

Block states (``BlockState``)::

    FREE --allocate--> ALLOCATED <--mark_inflight / mark_allocated--> INFLIGHT
    ALLOCATED | INFLIGHT --release--> FREE
    ALLOCATED | INFLIGHT --quarantine--> QUARANTINED --release_quarantined--> FREE

QUARANTINED exists because releasing an in-flight NIXL transfer does not stop its bytes
(DESIGN.md section 3): blocks of a cancelled push may be reused only after a fence, so they stay
out of the free stack, still listed under their owner, until ``release_quarantined``.
"""

from __future__ import annotations

import enum
import threading

import numpy as np

from kvpush.errors import NoFreeBlocksError

_INT32_MAX = 2**31 - 1


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


class BlockAllocator:
    """Pure block ownership bookkeeping; thread-safe (one lock); numpy state array + free stack.

    An owner (a request id) holds one set of blocks, all in the same state. The free stack is
    LIFO and hands out ascending ids from a fresh pool and ids in their original order after a
    release, so requests tend to get contiguous runs (fewer NIXL descriptors, see
    ``contiguous_runs``).

    Misuse by the caller (a transition from the wrong state, an unknown owner for a
    transition) raises ``ValueError``: it is a bug in kvpush, not an operator error.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0 or num_blocks > _INT32_MAX:
            raise ValueError(f"num_blocks must be in 1..{_INT32_MAX}, got {num_blocks}")
        self.num_blocks = num_blocks
        self._lock = threading.Lock()
        self._state = np.zeros(num_blocks, dtype=np.int8)  # BlockState per block id
        # Free stack: _free[:_nfree] are free ids, the top at the end; reversed so that
        # popping n gives 0..n-1 first.
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)
        self._nfree = num_blocks
        self._blocks: dict[str, np.ndarray] = {}
        self._owner_state: dict[str, BlockState] = {}
        self._reasons: dict[str, str] = {}
        self._counts = dict.fromkeys(BlockState, 0)
        self._counts[BlockState.FREE] = num_blocks

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
            if n > self._nfree:
                raise NoFreeBlocksError(
                    f"no_free_blocks: need {n}, {self._nfree} free of {self.num_blocks}"
                )
            top = self._nfree
            ids = self._free[top - n : top][::-1].copy()
            self._nfree = top - n
            self._state[ids] = BlockState.ALLOCATED
            self._blocks[owner] = ids
            self._owner_state[owner] = BlockState.ALLOCATED
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

    # -- under the lock -------------------------------------------------------------------

    def _transition(self, owner: str, allowed: tuple[BlockState, ...], to: BlockState) -> int:
        state = self._owner_state.get(owner)
        if state is None:
            raise ValueError(f"owner {owner!r} holds no blocks (cannot move them to {to.name})")
        if state not in allowed:
            raise ValueError(f"owner {owner!r} blocks are {state.name}, cannot move to {to.name}")
        ids = self._blocks[owner]
        self._state[ids] = to
        self._owner_state[owner] = to
        self._counts[state] -= ids.size
        self._counts[to] += ids.size
        return int(ids.size)

    def _free_owner(self, owner: str) -> int:
        ids = self._blocks.pop(owner)
        state = self._owner_state.pop(owner)
        n = int(ids.size)
        self._state[ids] = BlockState.FREE
        # Push reversed so the next allocate of the same size gets the same ids, same order.
        self._free[self._nfree : self._nfree + n] = ids[::-1]
        self._nfree += n
        self._counts[state] -= n
        self._counts[BlockState.FREE] += n
        return n

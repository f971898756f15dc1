"""The KV pool of one endpoint: its registered memory, who owns which block, descriptor arithmetic.

Owns

- ``BlockAllocator``: pure ownership bookkeeping of block ids (one lock; any thread may call it;
  every method is O(blocks of the owner), never O(pool), except construction);
- ``block_descs`` / ``xfer_indices`` / ``contiguous_runs``: pure, vectorized block -> NIXL
  descriptor arithmetic (no Python loop per block: handshakes build a million rows);
- ``KvPool``: the one torch allocation (DRAM or VRAM) that the NIXL adapter registers, plus
  ``fill`` / ``verify`` / ``scrub`` of blocks. These take no lock: they are called by whichever
  thread currently owns the blocks in question (the allocator says who that is).

This module imports torch and numpy, never nixl or zmq.

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
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvpush.config import PoolConfig
from kvpush.errors import ConfigError, DeviceError, NoFreeBlocksError
from kvpush.pattern import write_expected

POISON_BYTE = 0xA5
"""What ``scrub`` writes: neither zero nor a likely pattern byte run, easy to spot in a dump."""
_POISON_WORD = int.from_bytes(bytes([POISON_BYTE]) * 8, "little", signed=True)  # as int64 words

_CHUNK_BYTES = 16 * 1024 * 1024  # fill/verify/scrub work in slices of this size (scratch x 2)
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


# -- descriptor arithmetic (pure) -------------------------------------------------------------


def block_descs(
    region_base_addrs: np.ndarray | Sequence[int],
    num_blocks: int,
    block_bytes: int,
    device_id: int,
) -> np.ndarray:
    """``(R*num_blocks, 3)`` int64 rows ``(addr, len, device_id)``, region-major.

    Row ``r*num_blocks + b`` is block ``b`` of region ``r``. Region-major order matters: NIXL's
    ``prep_xfer_dlist`` on a million descriptors took 41 ms region-major and ~200 ms interleaved
    (DESIGN.md section 3). Built with int64 broadcasting (uint64 ``//``/``%`` is far slower).
    """
    bases = np.asarray(region_base_addrs, dtype=np.int64).reshape(-1)
    if num_blocks < 0 or block_bytes <= 0:
        raise ValueError(f"bad geometry: num_blocks={num_blocks} block_bytes={block_bytes}")
    out = np.empty((bases.size * num_blocks, 3), dtype=np.int64)
    grid = out.reshape(bases.size, num_blocks, 3)
    offsets = np.arange(num_blocks, dtype=np.int64) * np.int64(block_bytes)
    np.add(bases[:, None], offsets[None, :], out=grid[:, :, 0])
    out[:, 1] = block_bytes
    out[:, 2] = device_id
    return out


def xfer_indices(block_ids: np.ndarray, num_blocks: int, regions: int) -> np.ndarray:
    """int32 indices into the region-major descriptor list of ``block_ids`` in every region.

    Order: for each region ``r``, for each id ``b`` in ``block_ids``: ``r*num_blocks + b``; so
    local and remote index lists built from position-matched block ids pair up row by row.
    """
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if regions * num_blocks - 1 > _INT32_MAX:
        raise ValueError(
            f"{regions} regions x {num_blocks} blocks exceed the int32 descriptor index range"
        )
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(
            f"block ids out of range 0..{num_blocks - 1}: min {ids.min()}, max {ids.max()}"
        )
    idx = np.arange(regions, dtype=np.int64)[:, None] * num_blocks + ids[None, :]
    return idx.reshape(-1).astype(np.int32)


def contiguous_runs(local_ids: np.ndarray, remote_ids: np.ndarray) -> np.ndarray:
    """``(K, 3)`` int64 rows ``(local_start, remote_start, length)`` of maximal merged runs.

    A run continues while both the local and the remote id go up by exactly 1 from one
    position to the next; each run can then be sent as one descriptor per region (a fixed
    ~4 us per descriptor dominates small blocks, DESIGN.md section 3).
    """
    local = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    remote = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    if local.size != remote.size:
        raise ValueError(f"{local.size} local ids but {remote.size} remote ids")
    if local.size == 0:
        return np.empty((0, 3), dtype=np.int64)
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(np.append(starts, local.size))
    return np.stack((local[starts], remote[starts], lengths), axis=1).astype(np.int64)


# -- the registered pool ----------------------------------------------------------------------


def _resolve_device(spec: str) -> tuple[torch.device, str, int]:
    """``cpu`` / ``cuda`` / ``cuda:N`` -> (torch device, "DRAM" | "VRAM", device id)."""
    if spec == "cpu":
        return torch.device("cpu"), "DRAM", 0
    if not torch.cuda.is_available():
        raise DeviceError(
            f"CUDA requested (--device {spec}) but this host has no usable CUDA device",
            hint="use --device cpu",
        )
    count = torch.cuda.device_count()
    index = int(spec.partition(":")[2]) if ":" in spec else torch.cuda.current_device()
    if index >= count:
        raise DeviceError(
            f"CUDA device {index} requested (--device {spec}) but this host has {count} "
            f"CUDA device{'s' if count != 1 else ''} (0..{count - 1})",
            hint=f"use --device cuda:N with N below {count}, or --device cpu",
        )
    return torch.device("cuda", index), "VRAM", index


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """View uint8 blocks as int64 words when the block size allows it.

    torch's element-wise CPU kernels (index_copy_, equal, index_fill_) move ~1 GB/s on uint8
    and ~10 GB/s on int64 here; the bytes are the same.
    """
    return t.view(torch.int64) if t.shape[-1] % 8 == 0 else t


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "cpu":
        # numpy compares int64 words at ~14 GB/s here; torch.equal varies between 4 and 14.
        return bool(np.array_equal(_as_words(a).numpy(), _as_words(b).numpy()))
    return torch.equal(_as_words(a), _as_words(b))


class KvPool:
    """One registered allocation per endpoint: uint8 tensor ``(regions, num_blocks, block_bytes)``.

    The tensor is allocated with ``torch.zeros``: touching every page up front makes an
    over-committed host fail here, at startup with a clear ``ConfigError``, rather than at the
    first transfer; it costs a fraction of a second per GiB. Region ``r`` starts at
    ``base_addr + r*region_stride``; block ``b`` of it at ``+ b*block_bytes``.

    ``fill`` / ``verify`` / ``scrub`` work on slices of at most ~16 MiB (or one block in every
    region, if larger); a run of consecutive ids is read and written in place, other ids go
    through one reusable scratch buffer per calling thread, so they allocate nothing after
    the first call and run at several GB/s.
    """

    def __init__(self, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self.device, self.device_kind, self.device_id = _resolve_device(cfg.device)
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # fill/verify are many small ops: torch's intra-op thread pool only fights the
            # endpoint's owner threads for cores (measured: a 64 KiB verify took tens of ms
            # instead of ~0.2 ms on 2 cores, and D's p99 rose from ~10 ms to ~470 ms).
            torch.set_num_threads(1)
        shape = (cfg.regions, cfg.num_blocks, cfg.block_bytes)
        try:
            self.tensor = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cannot allocate the KV pool: {cfg.total_bytes} bytes "
                f"({cfg.total_bytes / 2**30:.2f} GiB) on {cfg.device}: {exc}",
                hint="lower --num-blocks, --layers or --block-bytes",
            ) from exc
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.base_addr: int = self.tensor.data_ptr()
        self.region_stride: int = cfg.num_blocks * cfg.block_bytes
        self._chunk_blocks = max(1, _CHUNK_BYTES // cfg.bytes_per_block_all_regions)
        self._scratch = threading.local()

    def region_base_addrs(self) -> list[int]:
        return [self.base_addr + r * self.region_stride for r in range(self.cfg.regions)]

    def all_block_descs(self) -> np.ndarray:
        """Descriptors of every block of every region (region-major), for registration/handshake."""
        return block_descs(
            self.region_base_addrs(), self.cfg.num_blocks, self.cfg.block_bytes, self.device_id
        )

    def fill(self, transfer_id: str, block_ids: np.ndarray) -> None:
        """Write the pattern of ``transfer_id`` into these blocks (position j = index in ids)."""
        for j0, ids in self._chunks(block_ids):
            start = _run_start(ids)
            if start is not None:
                write_expected(self.tensor[:, start : start + ids.size], transfer_id, first_j=j0)
                continue
            exp = write_expected(self._scratch_view(0, ids.size), transfer_id, first_j=j0)
            _as_words(self.tensor).index_copy_(1, self._index(ids), _as_words(exp))

    def verify(self, transfer_id: str, block_ids: np.ndarray) -> bool:
        """True iff every byte of these blocks, in every region, equals the pattern."""
        for j0, ids in self._chunks(block_ids):
            exp = write_expected(self._scratch_view(0, ids.size), transfer_id, first_j=j0)
            start = _run_start(ids)
            if start is not None:
                got = self.tensor[:, start : start + ids.size]
            else:
                got = torch.index_select(
                    self.tensor, 1, self._index(ids), out=self._scratch_view(1, ids.size)
                )
            if not _equal(got, exp):
                return False
        return True

    def scrub(self, block_ids: np.ndarray) -> None:
        """Overwrite these blocks in every region with ``POISON_BYTE``."""
        words = _as_words(self.tensor)
        poison = POISON_BYTE if words is self.tensor else _POISON_WORD
        for _, ids in self._chunks(block_ids):
            words.index_fill_(1, self._index(ids), poison)

    # -- helpers ------------------------------------------------------------------------------

    def _chunks(self, block_ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Validated int64 ids in slices of ``_chunk_blocks``, each with its first position j."""
        ids = np.ascontiguousarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.num_blocks):
            raise ValueError(
                f"block ids out of range 0..{self.cfg.num_blocks - 1}: "
                f"min {ids.min()}, max {ids.max()}"
            )
        step = self._chunk_blocks
        return [(j0, ids[j0 : j0 + step]) for j0 in range(0, ids.size, step)]

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(ids).to(self.device)

    def _scratch_view(self, which: int, nblocks: int) -> torch.Tensor:
        """This thread's scratch buffer ``which`` (0 or 1) as a (regions, nblocks, B) tensor."""
        buf: torch.Tensor | None = getattr(self._scratch, "buf", None)
        per_block = self.cfg.bytes_per_block_all_regions
        size = self._chunk_blocks * per_block
        if buf is None:
            buf = torch.empty(2 * size, dtype=torch.uint8, device=self.device)
            self._scratch.buf = buf
        flat = buf[which * size : which * size + nblocks * per_block]
        return flat.view(self.cfg.regions, nblocks, self.cfg.block_bytes)


def _run_start(ids: np.ndarray) -> int | None:
    """First id if ``ids`` are consecutive ascending (one slice covers them), else None."""
    if ids.size == 1 or (ids.size > 1 and bool(np.all(np.diff(ids) == 1))):
        return int(ids[0])
    return None

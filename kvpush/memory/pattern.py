"""The verification pattern: what every byte of a pushed block must be.

Owns the pure, deterministic mapping ``(transfer_id, region, j) -> block bytes`` that P writes
before a push and D checks after it (``KvPool.fill`` / ``KvPool.verify``). Pure functions, safe
to call from any thread; the only state is a small cache of base rows.

A block's bytes are ``base + offset`` (wrapping uint8 add), where

- ``base`` is one fixed pseudo-random row of ``block_bytes`` bytes, generated once per
  ``(block_bytes, device)`` from a constant seed, so a block shifted *within* itself fails;
- ``offset`` is one byte derived from the transfer seed, the region and ``j`` (the block's
  position within the request), so most wrong blocks differ in every byte;
- when ``block_bytes >= 16`` the first 16 bytes are a tag: 8 bytes of ``blake2b(transfer_id)``,
  then ``region`` and ``j`` as little-endian uint32, so a block from another request, another
  region or another position (a misaligned prefix trim, DESIGN.md C3) or a stale block always
  fails, not merely with probability 255/256.

Head by head. With tensor parallelism a page is ``heads`` head slices (heads outermost), and
the pattern is defined per *model* head: the slice of head ``h`` (a global head index; a rank's
page starts at ``first_head``) has its own offset byte and its own tag, whose region word carries
``h`` in its high 16 bits (``region | h << 16``; head 0 is the whole-block pattern above). So a
head landing at another head's place, from the wrong rank, or a page written twice over the
wrong one, fails verification, and the tag found there tells which head it was.

Generation is one broadcast add per call (memory bandwidth for MB-sized blocks when written into
warm memory, see ``write_expected``) plus a vectorized tag write; there is no loop over blocks.
Host memory only (numpy): a pool on a GPU generates here and copies (``kvpush.memory.pool``), so
that no endpoint imports torch unless its pool is on a GPU.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np

TAG_BYTES = 16
"""Bytes at the start of each block that hold the tag (when the block is that large)."""

_BASE_SEED = 0x6B7670757368  # "kvpush": the base row never changes between runs or versions
_BASE_CACHE_MAX = 16
_base_cache: dict[int, np.ndarray] = {}
_base_lock = threading.Lock()

# splitmix64 constants (Steele, Lea, Flood 2014), used to mix (seed, region, j) into one byte.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_REGION_MUL = np.uint64(0xD6E8FEB86659FD93)


def transfer_digest(transfer_id: str) -> bytes:
    """8-byte blake2b digest of the transfer id: the first 8 bytes of every block's tag."""
    return hashlib.blake2b(transfer_id.encode("utf-8"), digest_size=8).digest()


def transfer_seed(transfer_id: str) -> int:
    """Stable 64-bit seed of a transfer id (the digest read as a little-endian integer)."""
    return int.from_bytes(transfer_digest(transfer_id), "little")


def base_row(block_bytes: int) -> np.ndarray:
    """The fixed pseudo-random row of ``block_bytes`` uint8 (cached, read only)."""
    with _base_lock:
        row = _base_cache.get(block_bytes)
    if row is not None:
        return row
    row = np.random.default_rng(_BASE_SEED).integers(0, 256, size=block_bytes, dtype=np.uint8)
    row.flags.writeable = False
    with _base_lock:
        if len(_base_cache) >= _BASE_CACHE_MAX:
            _base_cache.pop(next(iter(_base_cache)))
        return _base_cache.setdefault(block_bytes, row)


_HEAD_MUL = np.uint64(0xA24BAED4963EE407)


def _offsets(
    seed: int, regions: int, first_j: int, nblocks: int, heads: int = 1, first_head: int = 0
) -> np.ndarray:
    """(regions, nblocks, heads) uint8 offsets: splitmix64 of (seed, region, j, head)."""
    r = np.arange(regions, dtype=np.uint64)[:, None, None]
    j = np.arange(first_j, first_j + nblocks, dtype=np.uint64)[None, :, None]
    h = np.arange(first_head, first_head + heads, dtype=np.uint64)[None, None, :]
    # Arrays only: numpy wraps uint64 array arithmetic silently (scalars would warn).
    x = np.full((1, 1, 1), seed, dtype=np.uint64) + r * _REGION_MUL + (j + np.uint64(1)) * _GOLDEN
    x = x + h * _HEAD_MUL
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    x = x ^ (x >> np.uint64(31))
    low: np.ndarray = (x & np.uint64(0xFF)).astype(np.uint8)
    return low


def _tags(
    transfer_id: str, regions: int, first_j: int, nblocks: int, heads: int = 1, first_head: int = 0
) -> np.ndarray:
    """(regions, nblocks, heads, 16) uint8 tags: digest, uint32 (region | head << 16) LE,
    uint32 j LE."""
    tags = np.empty((regions, nblocks, heads, TAG_BYTES), dtype=np.uint8)
    tags[..., :8] = np.frombuffer(transfer_digest(transfer_id), dtype=np.uint8)
    words = tags[..., 8:].view("<u4")  # (regions, nblocks, heads, 2) little-endian uint32
    region = np.arange(regions, dtype=np.uint32)[:, None, None]
    head = np.arange(first_head, first_head + heads, dtype=np.uint32)[None, None, :]
    words[..., 0] = region | (head << np.uint32(16))
    words[..., 1] = np.arange(first_j, first_j + nblocks, dtype=np.uint32)[None, :, None]
    return tags


def read_tag(head_slice: np.ndarray) -> tuple[bytes, int, int, int]:
    """(digest, region, head, j) of a head slice's first 16 bytes (what was found there)."""
    words = head_slice[8:TAG_BYTES].view("<u4")
    return bytes(head_slice[:8]), int(words[0]) & 0xFFFF, int(words[0]) >> 16, int(words[1])


def expected_blocks(
    transfer_id: str,
    regions: int,
    nblocks: int,
    block_bytes: int,
    *,
    first_j: int = 0,
    heads: int = 1,
    first_head: int = 0,
) -> np.ndarray:
    """A new uint8 ``(regions, nblocks, block_bytes)`` array holding a request's blocks.

    Block ``j`` of the result is the block at position ``first_j + j`` of the request; pass
    ``first_j`` to generate a slice of a large request without generating the rest. ``heads``
    head slices per block, the first being model head ``first_head`` (a rank's share).
    """
    if regions < 0 or nblocks < 0 or block_bytes <= 0:
        raise ValueError(
            f"bad pattern geometry: regions={regions} nblocks={nblocks} block_bytes={block_bytes}"
        )
    out = np.empty((regions, nblocks, block_bytes), dtype=np.uint8)
    return write_expected(out, transfer_id, first_j=first_j, heads=heads, first_head=first_head)


def write_expected(
    out: np.ndarray, transfer_id: str, *, first_j: int = 0, heads: int = 1, first_head: int = 0
) -> np.ndarray:
    """Write the pattern into ``out`` (uint8, ``(regions, nblocks, block_bytes)``); return it.

    ``out`` may be a strided view, e.g. ``pool[:, start:stop]``, so contiguous blocks are
    filled in place and a caller can reuse a warm buffer: a fresh allocation pays its page
    faults (~2 GB/s here), the broadcast add into warm memory runs at ~25 GB/s. Each block is
    ``heads`` head slices of ``block_bytes // heads`` bytes, model heads ``first_head`` on.
    """
    if out.dtype != np.uint8 or out.ndim != 3:
        raise ValueError(f"need a 3-d uint8 array, got {out.dtype} of shape {tuple(out.shape)}")
    if first_j < 0 or first_head < 0 or heads < 1:
        raise ValueError(f"bad pattern slice: first_j={first_j} heads={heads} first={first_head}")
    regions, nblocks, block_bytes = out.shape
    if block_bytes % heads:
        raise ValueError(f"a block of {block_bytes} bytes is not {heads} whole heads")
    if out.size == 0:
        return out
    hb = block_bytes // heads
    if out.strides[2] != 1:
        raise ValueError("write_expected needs blocks whose bytes are contiguous")
    # The last dim split in two, same memory (a strided view of a pool keeps its strides).
    view = np.lib.stride_tricks.as_strided(
        out, shape=(regions, nblocks, heads, hb), strides=(*out.strides[:2], hb, 1)
    )
    base = base_row(hb).reshape(1, 1, 1, hb)
    offsets = _offsets(transfer_seed(transfer_id), regions, first_j, nblocks, heads, first_head)
    np.add(base, offsets.reshape(regions, nblocks, heads, 1), out=view)  # uint8: wraps
    if hb >= TAG_BYTES:
        view[..., :TAG_BYTES] = _tags(transfer_id, regions, first_j, nblocks, heads, first_head)
    return out

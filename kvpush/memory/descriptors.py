"""Block -> NIXL descriptor arithmetic: pure and vectorized (numpy; no loop per block).

Handshakes build a million rows; every WRITE maps its block ids to descriptor indices here
(a short push's as a plain list: numpy's fixed cost per call would be most of its plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np

_INT32_MAX = 2**31 - 1

#: Index lists up to this long are built with plain Python: numpy's fixed cost per call (~1-2 us
#: for ``min``/``max``/``arange`` each) is most of a small push's planning otherwise (issue 10).
SMALL_XFER = 64


def block_descs(
    region_base_addrs: np.ndarray | Sequence[int],
    num_blocks: int,
    block_bytes: int,
    device_id: int,
    strides: Sequence[int] | None = None,
    offset: int = 0,
) -> np.ndarray:
    """``(R*num_blocks, 3)`` int64 rows ``(addr, len, device_id)``, region-major.

    Row ``r*num_blocks + b`` is block ``b`` of region ``r``, at ``base[r] + b*stride[r] +
    offset``, ``block_bytes`` long (the stride is ``block_bytes`` unless given: a peer's padded
    blocks, or a slice of each block -- one rank's heads -- with its own ``offset``).
    Region-major order matters: NIXL's ``prep_xfer_dlist`` on a million descriptors took 41 ms
    region-major and ~200 ms interleaved (DESIGN.md section 3). Built with int64 broadcasting
    (uint64 ``//``/``%`` is far slower).
    """
    bases = np.asarray(region_base_addrs, dtype=np.int64).reshape(-1)
    if num_blocks < 0 or block_bytes <= 0:
        raise ValueError(f"bad geometry: num_blocks={num_blocks} block_bytes={block_bytes}")
    step = np.full(bases.size, block_bytes, dtype=np.int64)
    if strides is not None:
        step = np.asarray(strides, dtype=np.int64).reshape(-1)
        if step.size != bases.size or bool(np.any(step < block_bytes + offset)):
            raise ValueError("one stride per region, each at least the slice's end")
    out = np.empty((bases.size * num_blocks, 3), dtype=np.int64)
    grid = out.reshape(bases.size, num_blocks, 3)
    blocks = np.arange(num_blocks, dtype=np.int64)
    np.add(bases[:, None] + offset, blocks[None, :] * step[:, None], out=grid[:, :, 0])
    out[:, 1] = block_bytes
    out[:, 2] = device_id
    return out


#: What NIXL's ``make_prepped_xfer`` takes as descriptor indices: an int32 array or a list.
Indices: TypeAlias = np.ndarray | list[int]


def xfer_indices(
    block_ids: np.ndarray | Sequence[int], num_blocks: int, regions: int
) -> np.ndarray:
    """int32 indices into the region-major descriptor list of ``block_ids`` in every region.

    Order: for each region ``r``, for each id ``b`` in ``block_ids``: ``r*num_blocks + b``; so
    local and remote index lists built from position-matched block ids pair up row by row.
    """
    got = xfer_index_list(block_ids, num_blocks, regions)
    return got if isinstance(got, np.ndarray) else np.array(got, dtype=np.int32)


def xfer_index_list(
    block_ids: np.ndarray | Sequence[int], num_blocks: int, regions: int
) -> Indices:
    """``xfer_indices``, except that a short result (``SMALL_XFER`` indices or fewer) is a plain
    list: NIXL takes either, and for a 1-block push building small numpy arrays costs more than
    the rest of its plan. An id outside ``0..num_blocks-1`` raises ``ValueError``."""
    if regions * num_blocks - 1 > _INT32_MAX:
        raise ValueError(
            f"{regions} regions x {num_blocks} blocks exceed the int32 descriptor index range"
        )
    ids: Sequence[int]
    if isinstance(block_ids, np.ndarray):
        n = block_ids.size
        if n * regions > SMALL_XFER:  # (before any list is made: a long push stays in numpy)
            return _xfer_array(block_ids, num_blocks, regions)
        ids = [block_ids.item()] if n == 1 else block_ids.ravel().tolist()
    else:
        if len(block_ids) * regions > SMALL_XFER:
            return _xfer_array(block_ids, num_blocks, regions)
        ids = block_ids
    if len(ids) == 1:  # a 1-block push, the most common small one: one check, no min/max
        b = int(ids[0])  # (a numpy scalar in a list would ride into NIXL otherwise)
        if not 0 <= b < num_blocks:
            raise ValueError(f"block ids out of range 0..{num_blocks - 1}: {b}")
        return [b + first for first in range(0, regions * num_blocks, num_blocks)]
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        raise ValueError(
            f"block ids out of range 0..{num_blocks - 1}: min {min(ids)}, max {max(ids)}"
        )
    return [r * num_blocks + int(b) for r in range(regions) for b in ids]


def _xfer_array(block_ids: np.ndarray | Sequence[int], num_blocks: int, regions: int) -> np.ndarray:
    arr = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_blocks):
        raise ValueError(
            f"block ids out of range 0..{num_blocks - 1}: min {arr.min()}, max {arr.max()}"
        )
    idx = np.arange(regions, dtype=np.int64)[:, None] * num_blocks + arr[None, :]
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


def merged_descriptors(local_ids: np.ndarray, remote_ids: np.ndarray, regions: int) -> int:
    """Descriptors a WRITE of these position-matched ids needs once consecutive blocks merge:
    one per run of consecutive local *and* remote ids, in every region (``contiguous_runs``).

    What NIXL's own merge of a prepped transfer can reach (``make_prepped_xfer`` without
    ``skip_desc_merge``); without merging a WRITE has ``len(local_ids) * regions``.
    """
    return int(contiguous_runs(local_ids, remote_ids).shape[0]) * regions

"""The write plan of one push: which local descriptors go to which remote ones. Pure.

Given P's finished block ids, D's registration and D's metadata, ``plan_write`` checks what a
peer sent (one block group, as many blocks as P holds: a misaligned prefix is refused, never
written -- vLLM's C3 --, ids inside D's pool) and returns the paired descriptor indices into the
two region-major descriptor lists, with the byte count. No threads, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpush.memory.descriptors import Indices, xfer_index_list
from kvpush.peers.tp import Slice
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol


@dataclass(slots=True)  # not frozen: built per push, and a frozen init costs 4x
class WritePlan:
    local_idx: Indices  # indices into P's local descriptor list
    remote_idx: Indices  # indices into D's remote descriptor list
    nbytes: int


class PlanError(Exception):
    """The registration cannot be written as asked: ``reason`` says why."""

    def __init__(self, reason: Failure, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class LocalGeometry:
    num_blocks: int
    regions: int
    block_bytes: int


def plan_write(
    local_ids: np.ndarray,
    reg: protocol.PushReg,
    remote: protocol.EndpointMetadata,
    local: LocalGeometry,
    sl: Slice | None = None,
) -> WritePlan:
    """``sl``: the part of each page this WRITE moves (whole pages when None); the descriptor
    lists it indexes into carry the slice's offsets."""
    if len(reg.local_block_ids) != 1:
        raise PlanError(Failure.BAD_REGISTRATION, "only one block group is supported")
    remote_ids = reg.local_block_ids[0]  # a list, as decoded
    if len(remote_ids) != len(local_ids):
        raise PlanError(
            Failure.BLOCK_COUNT_MISMATCH,
            f"P finished {len(local_ids)} blocks, D registered {len(remote_ids)}",
        )
    try:
        remote_idx = xfer_index_list(remote_ids, remote.num_blocks, remote.regions)
    except ValueError as e:  # an id outside D's pool (or a pool beyond int32 indices)
        detail = f"D's block ids do not fit D's pool: {e}"
        raise PlanError(Failure.BAD_REGISTRATION, detail) from None
    return WritePlan(
        xfer_index_list(local_ids, local.num_blocks, local.regions),
        remote_idx,
        len(local_ids) * local.regions * (local.block_bytes if sl is None else sl.length),
    )


def fence_plan(
    src_block: int, remote_block: int, remote: protocol.EndpointMetadata, local: LocalGeometry
) -> WritePlan:
    """A fence: one block of region 0, P's ``src_block`` onto D's ``remote_block``."""
    lidx = xfer_index_list([src_block], local.num_blocks, local.regions)
    ridx = xfer_index_list([remote_block], remote.num_blocks, remote.regions)
    return WritePlan(local_idx=lidx[:1], remote_idx=ridx[:1], nbytes=local.block_bytes)

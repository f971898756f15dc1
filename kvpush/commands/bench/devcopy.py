"""The device's own copy rate, in a bench worker: ``torch`` copies of the bytes a push moves.

``device_copy_pairs`` replays the (P ids, D ids) pairs of a kvpush pass (``kvpush bench
device``) as ``torch`` copies inside the endpoint's process: from its pool's blocks ``P ids``
into the blocks ``D ids`` of a second pool-shaped buffer on the same device, every region, one
``copy_`` per run of consecutive ids (what NIXL's merged descriptors move in one piece). On a
GPU that is a device-to-device copy (the ceiling of a push between two pools of one GPU); on
the CPU, memcpy. ``n`` copies, ``inflight`` is not needed: the copies queue on one stream and
the clock stops after ``torch.cuda.synchronize``.

Threads: the worker's command thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypedDict

from kvpush.commands.bench.worker_state import WorkerState


class DeviceCopyResult(TypedDict):
    """The reply of ``device_copy_pairs``."""

    n: int
    bytes: int
    elapsed_s: float
    gbps: float
    device: str
    copies_per_request: float


def _pieces(lo: list[int], ro: list[int]) -> list[tuple[int, int, int]]:
    """``[(src, dst, length)]``: position-matched ids cut where either side's run breaks."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(lo, ro, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def device_copy_pairs(
    state: WorkerState, pairs: list[list[list[int]]], n: int, warmup: int = 2
) -> DeviceCopyResult:
    """``n`` requests' bytes copied with torch, cycling through ``pairs`` (see the module)."""
    import torch

    src = state.endpoint.get().pool.as_tensor()
    dst = state.copy_dst
    if dst is None or dst.shape != src.shape or dst.device != src.device:
        dst = torch.zeros_like(src)
        state.copy_dst = dst
    plans = [_pieces(lo, ro) for lo, ro in pairs]
    regions, _, block_bytes = (int(x) for x in src.shape)
    sizes = [len(lo) * regions * block_bytes for lo, _ in pairs]
    cuda = src.is_cuda

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(src.device)

    def copy(i: int) -> None:
        for s, d, k in plans[i % len(plans)]:
            dst[:, d : d + k].copy_(src[:, s : s + k])

    for i in range(warmup):
        copy(i)
    sync()
    t0 = time.perf_counter()
    for i in range(n):
        copy(i)
    sync()
    elapsed = time.perf_counter() - t0
    nbytes = sum(sizes[i % len(sizes)] for i in range(n))
    return {
        "n": n,
        "bytes": nbytes,
        "elapsed_s": elapsed,
        "gbps": nbytes / elapsed / 1e9 if elapsed > 0 else 0.0,
        "device": str(src.device),
        "copies_per_request": sum(len(p) for p in plans) / len(plans) if plans else 0.0,
    }


def release_copy(state: WorkerState) -> None:
    """Free the second buffer (its memory goes back to the device)."""
    state.copy_dst = None


COMMANDS: dict[str, Callable[..., object]] = {
    "device_copy_pairs": device_copy_pairs,
    "release_copy": release_copy,
}

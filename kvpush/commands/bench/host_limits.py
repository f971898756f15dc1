"""The machine's own limits, measured inside a bench worker beside the raw NIXL loops:
``process_vm_writev`` (the syscall UCX's CMA transport uses) and single-threaded memcpy.

``pvw_loop`` writes ``raw.raw_write_loop``'s descriptor shape (one iovec per block per region)
from this worker's ``RawNode`` buffer (``kvpush.commands.bench.raw_node``) into a target's;
``pvw_pairs`` the same bytes as ``raw.raw_pairs_loop`` (one iovec per merged run per region);
``memcpy_loop`` copies the same shape between two fresh buffers of this process.

Threads: the worker's command thread.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import NotRequired, TypedDict

import numpy as np

from kvpush.commands.bench.raw_node import RawNodeInfo, block_starts, pool_buffer, region_bases
from kvpush.commands.bench.worker_state import WorkerState

#: libc's ``process_vm_writev``: (pid, local iovecs, count, remote iovecs, count, flags) -> bytes
PvwFn = Callable[..., int]


class CopyResult(TypedDict):
    """The reply of ``pvw_loop``, ``pvw_pairs`` and ``memcpy_loop``."""

    n: int
    bytes: int
    elapsed_s: float
    gbps: float
    iovecs_per_request: NotRequired[float]  # pvw_pairs's only


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_IOV_MAX = 1024


def _pvw_fn() -> PvwFn:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_writev
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    call: PvwFn = fn
    return call


def pvw_loop(state: WorkerState, target: RawNodeInfo, blocks: int, n: int) -> CopyResult:
    """``process_vm_writev`` of the same descriptor shape (one iovec per block per region)."""
    fn = _pvw_fn()
    node = state.raw.get()
    regions, num_blocks, block_bytes = node.geometry
    t_blocks = target["geometry"][1]
    lbases = region_bases(node.tensor)
    rbases = target["bases"]
    pid = int(target["pid"])
    starts = block_starts(min(num_blocks, t_blocks), blocks, 256)
    nvec = regions * blocks
    if nvec > _IOV_MAX:
        raise ValueError(f"{nvec} iovecs exceed IOV_MAX")
    vecs = []
    for s in starts:
        lv = (_IOVec * nvec)()
        rv = (_IOVec * nvec)()
        k = 0
        for r in range(regions):
            for b in range(s, s + blocks):
                lv[k].iov_base = lbases[r] + b * block_bytes
                lv[k].iov_len = block_bytes
                rv[k].iov_base = rbases[r] + b * block_bytes
                rv[k].iov_len = block_bytes
                k += 1
        vecs.append((lv, rv))
    nbytes = nvec * block_bytes

    def run(count: int) -> float:
        t0 = time.perf_counter()
        for i in range(count):
            lv, rv = vecs[i % len(vecs)]
            got = fn(pid, lv, nvec, rv, nvec, 0)
            if got != nbytes:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_writev wrote {got} of {nbytes} bytes")
        return time.perf_counter() - t0

    run(min(n, 8))
    elapsed = run(n)
    return {"n": n, "bytes": n * nbytes, "elapsed_s": elapsed, "gbps": n * nbytes / elapsed / 1e9}


def _iovecs(
    pair: list[list[int]], lbases: list[int], rbases: list[int], block_bytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Local and remote iovec arrays (``(K, 2)`` uint64: base, length) of one pair of id lists:
    one iovec per merged run per region, region-major (the fewest a copy of them can use)."""
    from kvpush.memory.descriptors import contiguous_runs

    runs = contiguous_runs(np.asarray(pair[0], dtype=np.int64), np.asarray(pair[1], np.int64))
    lb = np.asarray(lbases, dtype=np.int64)[:, None]
    rb = np.asarray(rbases, dtype=np.int64)[:, None]
    bb = np.int64(block_bytes)
    lens = np.broadcast_to(runs[None, :, 2] * bb, (lb.shape[0], runs.shape[0])).reshape(-1)
    lv = np.stack(((lb + runs[None, :, 0] * bb).reshape(-1), lens), axis=1).astype(np.uint64)
    rv = np.stack(((rb + runs[None, :, 1] * bb).reshape(-1), lens), axis=1).astype(np.uint64)
    return np.ascontiguousarray(lv), np.ascontiguousarray(rv)


def pvw_pairs(
    state: WorkerState, target: RawNodeInfo, pairs: list[list[list[int]]], n: int
) -> CopyResult:
    """``process_vm_writev`` of the same bytes as ``raw_pairs_loop``: for each pair, its merged
    runs in every region as iovecs, ``IOV_MAX`` per call; ``n`` pairs, cycling."""
    fn = _pvw_fn()
    node = state.raw.get()
    block_bytes = node.geometry[2]
    lbases = region_bases(node.tensor)
    pid = int(target["pid"])
    calls = []  # per pair: [(lv pointer, rv pointer, count, bytes)], arrays kept alive
    keep = []
    sizes = []
    for pair in pairs:
        lv, rv = _iovecs(pair, lbases, target["bases"], block_bytes)
        keep.append((lv, rv))
        chunks = []
        for k0 in range(0, lv.shape[0], _IOV_MAX):
            k1 = min(lv.shape[0], k0 + _IOV_MAX)
            chunks.append(
                (
                    ctypes.cast(lv.ctypes.data + k0 * 16, ctypes.POINTER(_IOVec)),
                    ctypes.cast(rv.ctypes.data + k0 * 16, ctypes.POINTER(_IOVec)),
                    k1 - k0,
                    int(lv[k0:k1, 1].sum()),
                )
            )
        calls.append(chunks)
        sizes.append(int(lv[:, 1].sum()))

    def run(count: int) -> float:
        t0 = time.perf_counter()
        for i in range(count):
            for lp, rp, k, want in calls[i % len(calls)]:
                got = fn(pid, lp, k, rp, k, 0)
                if got != want:
                    err = ctypes.get_errno()
                    raise OSError(err, f"process_vm_writev wrote {got} of {want} bytes")
        return time.perf_counter() - t0

    run(1)
    elapsed = run(n)
    nbytes = sum(sizes[i % len(sizes)] for i in range(n))
    iov = sum(sum(c[2] for c in calls[i % len(calls)]) for i in range(n)) / n
    return {
        "n": n,
        "bytes": nbytes,
        "elapsed_s": elapsed,
        "gbps": nbytes / elapsed / 1e9,
        "iovecs_per_request": iov,
    }


def memcpy_loop(
    state: WorkerState, regions: int, num_blocks: int, block_bytes: int, blocks: int, n: int
) -> CopyResult:
    """Single-threaded memcpy (numpy ``copyto``) of the same shape inside this process: one
    copy per region of ``blocks`` consecutive blocks (contiguous there)."""
    src = pool_buffer(regions, num_blocks, block_bytes).numpy()
    dst = pool_buffer(regions, num_blocks, block_bytes).numpy()
    starts = block_starts(num_blocks, blocks, 256)
    nbytes = regions * blocks * block_bytes

    def run(count: int) -> float:
        t0 = time.perf_counter()
        for i in range(count):
            s = starts[i % len(starts)]
            for r in range(regions):
                np.copyto(dst[r, s : s + blocks], src[r, s : s + blocks])
        return time.perf_counter() - t0

    run(min(n, 8))
    elapsed = run(n)
    return {"n": n, "bytes": n * nbytes, "elapsed_s": elapsed, "gbps": n * nbytes / elapsed / 1e9}


COMMANDS: dict[str, Callable[..., object]] = {
    "pvw_loop": pvw_loop,
    "memcpy_loop": memcpy_loop,
    "pvw_pairs": pvw_pairs,
}

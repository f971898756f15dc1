"""Raw baselines that run inside a bench worker: NIXL WRITE loops without kvpush, and the
machine's own limits (``process_vm_writev``, ``memcpy``).

Everything NIXL goes through ``kvpush.transport.nixl.NixlAgent`` (the only module that imports
nixl), with the same agent configuration knobs kvpush exposes (``AgentConfig``). The descriptor
shape is kvpush's: one descriptor per block per region, region-major lists, a transfer covering
``blocks`` consecutive blocks in every region (``kvpush.memory.descriptors``).

A *target* registers a pool-shaped buffer and, with the progress thread off, polls its agent
(``get_notifs``) on a thread: without that polling the first WRITE to it never completes. An
*initiator* loads the target's metadata, prepares both descriptor lists once and loops.

Threads: the command thread (initiator loop), the target's polling thread.
"""

from __future__ import annotations

import base64
import ctypes
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpush.bench.loadgen import process_cpu_s


def _buffer(regions: int, num_blocks: int, block_bytes: int) -> Any:
    import torch

    # torch.zeros touches every page (as KvPool does), so no page faults in the timed part.
    return torch.zeros((regions, num_blocks, block_bytes), dtype=torch.uint8)


def _region_bases(t: Any) -> list[int]:
    base = int(t.data_ptr())
    stride = int(t.shape[1] * t.shape[2])
    return [base + r * stride for r in range(int(t.shape[0]))]


class RawNode:
    """A NIXL agent with one registered pool-shaped buffer; optionally polling notifications."""

    def __init__(
        self, regions: int, num_blocks: int, block_bytes: int, progress_thread: bool, poll: str
    ) -> None:
        from kvpush.config import AgentConfig
        from kvpush.transport.nixl import NixlAgent

        self.geometry = (regions, num_blocks, block_bytes)
        self.tensor = _buffer(regions, num_blocks, block_bytes)
        self.agent = NixlAgent(
            f"raw-{uuid.uuid4().hex[:12]}", AgentConfig(progress_thread=progress_thread)
        )
        self.agent.register(self.tensor)
        self.notifs = 0
        self._stop = threading.Event()
        self._poll_mode = poll
        self._poller: threading.Thread | None = None
        if poll != "none":
            self._poller = threading.Thread(target=self._poll, name="raw-poller", daemon=True)
            self._poller.start()

    def _poll(self) -> None:
        # "spin": poll back to back, yielding the GIL; "backoff": like kvpush's IdleWaiter
        # (spin 2 ms after activity, then sleep up to 1 ms).
        last = time.monotonic()
        sleep = 50e-6
        while not self._stop.is_set():
            got = self.agent.get_notifs()
            n = sum(len(v) for v in got.values())
            if n:
                self.notifs += n
                last = time.monotonic()
                sleep = 50e-6
                continue
            if self._poll_mode == "spin" or time.monotonic() - last < 0.002:
                time.sleep(0)
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, 0.001)

    def info(self) -> dict[str, Any]:
        import os

        return {
            "metadata": base64.b64encode(self.agent.metadata_full()).decode(),
            "bases": _region_bases(self.tensor),
            "pid": os.getpid(),
            "geometry": list(self.geometry),
        }

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(2)
        self.agent.close()


def raw_node(
    state: Any,
    regions: int,
    num_blocks: int,
    block_bytes: int,
    progress_thread: bool = False,
    poll: str = "spin",
) -> dict[str, Any]:
    if state.raw is not None:
        state.raw.close()
    node = RawNode(regions, num_blocks, block_bytes, progress_thread, poll)
    state.raw = node
    return node.info()


def raw_close(state: Any) -> None:
    if state.raw is not None:
        state.raw.close()
        state.raw = None


def raw_notifs(state: Any) -> int:
    return int(state.raw.notifs)


def _block_starts(num_blocks: int, blocks: int, count: int) -> list[int]:
    """Start block of each distinct transfer: consecutive, non-overlapping, cycling the pool."""
    per = max(1, num_blocks // blocks)
    return [(k % per) * blocks for k in range(min(count, per))]


def raw_write_loop(
    state: Any,
    target: dict[str, Any],
    blocks: int,
    n: int,
    inflight: int,
    notif: bool,
    warmup: int = 8,
) -> dict[str, Any]:
    """``n`` WRITEs of ``blocks`` blocks x every region into the target, ``inflight`` at a time.

    Each WRITE is ``make_prepped_xfer`` + ``transfer`` on prepared lists, then polled with
    ``check_xfer_state`` until DONE and released; ``notif`` attaches a short notification.
    """
    from kvpush.memory.descriptors import block_descs, xfer_indices

    node: RawNode = state.raw
    agent = node.agent
    regions, num_blocks, block_bytes = node.geometry
    t_regions, t_blocks, t_bb = target["geometry"]
    assert (t_regions, t_bb) == (regions, block_bytes), "geometry mismatch"
    name = agent.add_remote(base64.b64decode(target["metadata"]))
    local = agent.prep_local(
        block_descs(_region_bases(node.tensor), num_blocks, block_bytes, 0), "DRAM"
    )
    remote = agent.prep_remote(name, block_descs(target["bases"], t_blocks, block_bytes, 0), "DRAM")
    agent.make_connection(name)
    # Like kvpush's pools: the source cycles through the initiator's whole pool, the
    # destination through the target's (so neither side is kept warmer in cache than kvpush's).
    lstarts = _block_starts(num_blocks, blocks, n)
    rstarts = _block_starts(t_blocks, blocks, n)
    k = max(len(lstarts), len(rstarts))
    idx = [
        (
            xfer_indices(np.arange(ls, ls + blocks), num_blocks, regions),
            xfer_indices(np.arange(rs, rs + blocks), t_blocks, regions),
        )
        for ls, rs in zip(
            (lstarts[j % len(lstarts)] for j in range(k)),
            (rstarts[j % len(rstarts)] for j in range(k)),
            strict=True,
        )
    ]
    nbytes = blocks * regions * block_bytes

    def run(count: int) -> tuple[float, float, float]:
        pending: deque[Any] = deque()
        lat: list[float] = []
        posted: deque[float] = deque()
        c0 = process_cpu_s()
        th0 = time.thread_time()
        t0 = time.perf_counter()
        for i in range(count):
            while len(pending) >= inflight:
                x = pending[0]
                st = agent.state(x)
                if st == "DONE":
                    agent.release(pending.popleft())
                    lat.append(time.perf_counter() - posted.popleft())
                elif st == "ERR":
                    raise RuntimeError("raw WRITE failed")
            li, ri = idx[i % len(idx)]
            x, st = agent.post_write(local, li, remote, ri, (b"n%d" % i) if notif else b"")
            tp = time.perf_counter()
            if st == "DONE":
                agent.release(x)
                lat.append(0.0)
            else:
                pending.append(x)
                posted.append(tp)
        while pending:
            st = agent.state(pending[0])
            if st == "DONE":
                agent.release(pending.popleft())
                lat.append(time.perf_counter() - posted.popleft())
            elif st == "ERR":
                raise RuntimeError("raw WRITE failed")
        t1 = time.perf_counter()
        run.lat = lat  # type: ignore[attr-defined]
        return t1 - t0, process_cpu_s() - c0, time.thread_time() - th0

    try:
        run(warmup)
        elapsed, cpu_s, thread_s = run(n)
        lat = sorted(run.lat)  # type: ignore[attr-defined]
    finally:
        agent.release_dlist(local)
        agent.release_dlist(remote)
        agent.remove_remote(name)
    return {
        "n": n,
        "bytes": n * nbytes,
        "elapsed_s": elapsed,
        "cpu_s": cpu_s,
        "thread_cpu_s": thread_s,
        "gbps": n * nbytes / elapsed / 1e9,
        "per_s": n / elapsed,
        "post_to_done_p50_s": lat[len(lat) // 2] if lat else 0.0,
        "post_to_done_p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0,
    }


# --------------------------------------------------------------------------- machine limits


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_IOV_MAX = 1024


def pvw_loop(state: Any, target: dict[str, Any], blocks: int, n: int) -> dict[str, Any]:
    """``process_vm_writev`` of the same descriptor shape (one iovec per block per region)."""
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
    node: RawNode = state.raw
    regions, num_blocks, block_bytes = node.geometry
    t_blocks = target["geometry"][1]
    lbases = _region_bases(node.tensor)
    rbases = target["bases"]
    pid = int(target["pid"])
    starts = _block_starts(min(num_blocks, t_blocks), blocks, 256)
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


def memcpy_loop(
    state: Any, regions: int, num_blocks: int, block_bytes: int, blocks: int, n: int
) -> dict[str, Any]:
    """Single-threaded memcpy (numpy ``copyto``) of the same shape inside this process: one
    copy per region of ``blocks`` consecutive blocks (contiguous there)."""
    src = _buffer(regions, num_blocks, block_bytes).numpy()
    dst = _buffer(regions, num_blocks, block_bytes).numpy()
    starts = _block_starts(num_blocks, blocks, 256)
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


COMMANDS: dict[str, Callable[..., Any]] = {
    "raw_node": raw_node,
    "raw_notifs": raw_notifs,
    "raw_close": raw_close,
    "raw_write_loop": raw_write_loop,
    "pvw_loop": pvw_loop,
    "memcpy_loop": memcpy_loop,
}

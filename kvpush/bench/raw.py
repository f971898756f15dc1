"""Raw baselines that run inside a bench worker: NIXL WRITE loops without kvpush, and the
machine's own limits (``process_vm_writev``, ``memcpy``).

Everything NIXL goes through ``kvpush.transport.nixl.NixlAgent`` (the only module that imports
nixl), with the same agent configuration knobs kvpush exposes (``AgentConfig``). The descriptor
shape is kvpush's: one descriptor per block per region, region-major lists, a transfer covering
``blocks`` consecutive blocks in every region (``kvpush.memory.descriptors``).

A *target* registers a pool-shaped buffer and, with the progress thread off, polls its agent
(``get_notifs``) on a thread: without that polling the first WRITE to it never completes. An
*initiator* loads the target's metadata, prepares both descriptor lists once and loops.

``kvpush bench model`` runs its raw baselines *inside* the endpoint processes, on the
endpoints' own pool tensors (``raw_pool_node``: a second agent registering the same memory;
its poller paused while kvpush runs), and replays the exact block-id pairs kvpush's last pass
used (``raw_pairs_loop``, with NIXL's descriptor merge on or off; ``pvw_pairs``): same bytes,
same pages, same layout.

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
        self,
        regions: int,
        num_blocks: int,
        block_bytes: int,
        progress_thread: bool,
        poll: str,
        tensor: Any = None,
        paused: bool = False,
    ) -> None:
        from kvpush.config import AgentConfig
        from kvpush.transport.nixl import NixlAgent

        self.geometry = (regions, num_blocks, block_bytes)
        # ``tensor``: an existing (regions, num_blocks, block_bytes) buffer, e.g. a pool's.
        self.tensor = _buffer(regions, num_blocks, block_bytes) if tensor is None else tensor
        self.agent = NixlAgent(
            f"raw-{uuid.uuid4().hex[:12]}", AgentConfig(progress_thread=progress_thread)
        )
        self.agent.register(self.tensor)
        self.peer: _Peer | None = None
        self.notifs = 0
        self._stop = threading.Event()
        self._active = threading.Event()
        if not paused:
            self._active.set()
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
            if not self._active.is_set():  # paused: no CPU taken from what runs meanwhile
                self._active.wait(0.05)
                last = time.monotonic()
                continue
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

    def set_polling(self, on: bool) -> None:
        if on:
            self._active.set()
        else:
            self._active.clear()

    def close(self) -> None:
        self._stop.set()
        self._active.set()
        if self._poller is not None:
            self._poller.join(2)
        if self.peer is not None:
            self.peer.close(self.agent)
            self.peer = None
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


def _run_writes(
    agent: Any, post: Callable[[int], tuple[Any, str]], count: int, inflight: int
) -> tuple[float, float, float, list[float]]:
    """``count`` WRITEs ``post(i)``-ed with at most ``inflight`` outstanding, each polled with
    ``check_xfer_state`` until DONE and released. Returns elapsed, process CPU and thread CPU
    seconds and the sorted post -> DONE latencies."""
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
        x, st = post(i)
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
    return t1 - t0, process_cpu_s() - c0, time.thread_time() - th0, sorted(lat)


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

    def post(i: int) -> tuple[Any, str]:
        li, ri = idx[i % len(idx)]
        return agent.post_write(local, li, remote, ri, (b"n%d" % i) if notif else b"")

    try:
        _run_writes(agent, post, warmup, inflight)
        elapsed, cpu_s, thread_s, lat = _run_writes(agent, post, n, inflight)
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


# --------------------------------------------------------------------------- model: in-pool


class _Peer:
    """A target loaded into a raw initiator, both whole-pool descriptor lists prepped once."""

    def __init__(self, agent: Any, node: RawNode, target: dict[str, Any]) -> None:
        from kvpush.memory.descriptors import block_descs

        regions, num_blocks, block_bytes = node.geometry
        t_regions, t_blocks, t_bb = target["geometry"]
        if (t_regions, t_bb) != (regions, block_bytes):
            raise ValueError(f"geometry mismatch: {node.geometry} vs {target['geometry']}")
        self.target = target
        self.t_blocks = int(t_blocks)
        self.name = agent.add_remote(base64.b64decode(target["metadata"]))
        self.local = agent.prep_local(
            block_descs(_region_bases(node.tensor), num_blocks, block_bytes, 0), "DRAM"
        )
        self.remote = agent.prep_remote(
            self.name, block_descs(target["bases"], t_blocks, block_bytes, 0), "DRAM"
        )
        agent.make_connection(self.name)

    def close(self, agent: Any) -> None:
        agent.release_dlist(self.local)
        agent.release_dlist(self.remote)
        agent.remove_remote(self.name)


def raw_pool_node(state: Any, poll: str = "spin", paused: bool = True) -> dict[str, Any]:
    """A raw agent registering this endpoint's own pool tensor (a second registration of the
    same memory), its poller ``paused`` until ``raw_poll(on=True)``."""
    if state.raw is not None:
        state.raw.close()
    t = state.endpoint.pool.tensor
    regions, num_blocks, block_bytes = (int(x) for x in t.shape)
    node = RawNode(regions, num_blocks, block_bytes, False, poll, tensor=t, paused=paused)
    state.raw = node
    return node.info()


def raw_poll(state: Any, on: bool) -> None:
    state.raw.set_polling(on)


def raw_prepare(state: Any, target: dict[str, Any]) -> None:
    """Load ``target`` (a ``raw_pool_node`` info) and prep both pools' descriptor lists."""
    node: RawNode = state.raw
    if node.peer is not None:
        node.peer.close(node.agent)
    node.peer = None
    node.peer = _Peer(node.agent, node, target)


def _post_unmerged(
    agent: Any, local: Any, li: Any, remote: Any, ri: Any, notif: bytes
) -> tuple[Any, str]:
    """A WRITE with NIXL's descriptor merge off (``skip_desc_merge=True``, documented as
    deprecated in nixl 1.5.1). ``NixlAgent.post_write`` has no such switch (kvpush always
    merges), so this one baseline calls the agent inside the adapter directly."""
    from kvpush.transport.nixl import Xfer

    raw = agent._agent
    h = raw.make_prepped_xfer(
        "WRITE", local.handle, li, remote.handle, ri, notif, skip_desc_merge=True
    )
    x = Xfer(h)
    try:
        st = raw.transfer(h)
    except BaseException:
        agent.release(x)
        raise
    return x, str(st)


def raw_pairs_loop(
    state: Any,
    pairs: list[list[list[int]]],
    n: int,
    inflight: int,
    merge: bool = True,
    notif: bool = True,
    warmup: int = 1,
) -> dict[str, Any]:
    """``n`` WRITEs cycling through ``pairs`` (``[local_ids, remote_ids]``, position-matched,
    every region), ``inflight`` at a time, into the prepared target; ``merge=False`` turns
    NIXL's merge of consecutive descriptors off."""
    from kvpush.memory.descriptors import xfer_indices

    node: RawNode = state.raw
    peer = node.peer
    if peer is None:
        raise RuntimeError("raw_prepare first")
    agent = node.agent
    regions, num_blocks, block_bytes = node.geometry
    idx = [
        (
            xfer_indices(np.asarray(lo, dtype=np.int64), num_blocks, regions),
            xfer_indices(np.asarray(ro, dtype=np.int64), peer.t_blocks, regions),
        )
        for lo, ro in pairs
    ]
    sizes = [len(lo) * regions * block_bytes for lo, _ in pairs]

    def post(i: int) -> tuple[Any, str]:
        li, ri = idx[i % len(idx)]
        msg = (b"n%d" % i) if notif else b""
        if merge:
            return agent.post_write(peer.local, li, peer.remote, ri, msg)
        return _post_unmerged(agent, peer.local, li, peer.remote, ri, msg)

    _run_writes(agent, post, warmup, inflight)
    elapsed, cpu_s, thread_s, lat = _run_writes(agent, post, n, inflight)
    nbytes = sum(sizes[i % len(sizes)] for i in range(n))
    return {
        "n": n,
        "bytes": nbytes,
        "elapsed_s": elapsed,
        "cpu_s": cpu_s,
        "thread_cpu_s": thread_s,
        "gbps": nbytes / elapsed / 1e9,
        "per_s": n / elapsed,
        "post_to_done_p50_s": lat[len(lat) // 2] if lat else 0.0,
    }


# --------------------------------------------------------------------------- machine limits


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_IOV_MAX = 1024


def _pvw_fn() -> Any:
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
    return fn


def pvw_loop(state: Any, target: dict[str, Any], blocks: int, n: int) -> dict[str, Any]:
    """``process_vm_writev`` of the same descriptor shape (one iovec per block per region)."""
    fn = _pvw_fn()
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


def pvw_pairs(state: Any, target: dict[str, Any], pairs: list[list[list[int]]], n: int) -> Any:
    """``process_vm_writev`` of the same bytes as ``raw_pairs_loop``: for each pair, its merged
    runs in every region as iovecs, ``IOV_MAX`` per call; ``n`` pairs, cycling."""
    fn = _pvw_fn()
    node: RawNode = state.raw
    block_bytes = node.geometry[2]
    lbases = _region_bases(node.tensor)
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
    "raw_pool_node": raw_pool_node,
    "raw_poll": raw_poll,
    "raw_prepare": raw_prepare,
    "raw_pairs_loop": raw_pairs_loop,
    "pvw_pairs": pvw_pairs,
}

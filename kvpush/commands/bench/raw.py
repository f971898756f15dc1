"""Raw NIXL WRITE loops without kvpush, run inside a bench worker on its ``RawNode``
(``kvpush.commands.bench.raw_node``): the baselines kvpush's pushes are measured against.

The descriptor shape is kvpush's: one descriptor per block per region, region-major lists, a
transfer covering ``blocks`` consecutive blocks in every region (``kvpush.memory.descriptors``).
In ``raw_write_loop`` an *initiator* loads the target's metadata, prepares both descriptor lists
once and loops. ``kvpush bench model`` runs its raw baselines *inside* the endpoint processes, on
the endpoints' own pool tensors (``raw_node.raw_pool_node``), and replays the exact block-id
pairs kvpush's last pass used (``raw_pairs_loop``, with NIXL's descriptor merge on or off;
``host_limits.pvw_pairs``): same bytes, same pages, same layout.

Threads: the worker's command thread (the initiator loop); the target's polling thread belongs to
the target's node.
"""

from __future__ import annotations

import base64
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, NotRequired, Protocol, TypedDict, cast

import numpy as np

from kvpush.commands.bench.probes import process_cpu_s
from kvpush.commands.bench.raw_node import RawNodeInfo, block_starts, region_bases
from kvpush.commands.bench.worker_state import WorkerState

if TYPE_CHECKING:
    from kvpush.transport.agent import DList, Handle, Xfer
    from kvpush.transport.nixl import NixlAgent

#: Posts WRITE ``i``: its transfer and first state (DONE, PROC or ERR).
Post = Callable[[int], "tuple[Xfer, str]"]


class RawLoopResult(TypedDict):
    """The reply of ``raw_write_loop`` and ``raw_pairs_loop``."""

    n: int
    bytes: int
    elapsed_s: float
    cpu_s: float
    thread_cpu_s: float
    gbps: float
    per_s: float
    post_to_done_p50_s: float
    post_to_done_p99_s: NotRequired[float]  # raw_write_loop's only
    post_us_per_desc: NotRequired[float]  # raw_write_loop's: wall time in post() a descriptor


class _UnmergedAgent(Protocol):
    """The two calls of NIXL's own agent a WRITE with the descriptor merge off makes."""

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: object,
        local_indices: np.ndarray,
        remote_xfer_side: object,
        remote_indices: np.ndarray,
        notif_msg: bytes,
        skip_desc_merge: bool,
    ) -> Handle: ...
    def transfer(self, handle: object) -> str: ...


class _Run(NamedTuple):
    elapsed_s: float
    cpu_s: float  # the process's
    thread_s: float  # the loop thread's
    post_s: float  # wall time inside post() (make_prepped_xfer + transfer)
    lat: list[float]  # post -> DONE, sorted


def _reap(
    agent: NixlAgent, pending: deque[Xfer], posted: deque[float], lat: list[float], keep: int
) -> None:
    """Poll the oldest WRITE until it is DONE (release it, record its latency) while more than
    ``keep`` are outstanding; a WRITE in ERR ends the run."""
    while len(pending) > keep:
        state = agent.state(pending[0])
        if state == "DONE":
            agent.release(pending.popleft())
            lat.append(time.perf_counter() - posted.popleft())
        elif state == "ERR":
            raise RuntimeError("raw WRITE failed")


def _run_writes(agent: NixlAgent, post: Post, count: int, inflight: int) -> _Run:
    """``count`` WRITEs ``post(i)``-ed with at most ``inflight`` outstanding, each polled with
    ``check_xfer_state`` until DONE and released."""
    pending: deque[Xfer] = deque()
    lat: list[float] = []
    posted: deque[float] = deque()
    post_s = 0.0
    c0 = process_cpu_s()
    th0 = time.thread_time()
    t0 = time.perf_counter()
    for i in range(count):
        _reap(agent, pending, posted, lat, keep=inflight - 1)
        tb = time.perf_counter()
        x, st = post(i)
        tp = time.perf_counter()
        post_s += tp - tb
        if st == "DONE":
            agent.release(x)
            lat.append(0.0)
        else:
            pending.append(x)
            posted.append(tp)
    _reap(agent, pending, posted, lat, keep=0)
    t1 = time.perf_counter()
    return _Run(t1 - t0, process_cpu_s() - c0, time.thread_time() - th0, post_s, sorted(lat))


def raw_write_loop(
    state: WorkerState,
    target: RawNodeInfo,
    blocks: int,
    n: int,
    inflight: int,
    notif: bool,
    warmup: int = 8,
) -> RawLoopResult:
    """``n`` WRITEs of ``blocks`` blocks x every region into the target, ``inflight`` at a time.

    Each WRITE is ``make_prepped_xfer`` + ``transfer`` on prepared lists, then polled with
    ``check_xfer_state`` until DONE and released; ``notif`` attaches a short notification.
    """
    from kvpush.memory.descriptors import block_descs, xfer_indices

    node = state.raw.get()
    agent = node.agent
    regions, num_blocks, block_bytes = node.geometry
    t_regions, t_blocks, t_bb = target["geometry"]
    assert (t_regions, t_bb) == (regions, block_bytes), "geometry mismatch"
    name = agent.add_remote(base64.b64decode(target["metadata"]))
    local = agent.prep_local(
        block_descs(region_bases(node.tensor), num_blocks, block_bytes, 0), "DRAM"
    )
    remote = agent.prep_remote(name, block_descs(target["bases"], t_blocks, block_bytes, 0), "DRAM")
    agent.make_connection(name)
    # Like kvpush's pools: the source cycles through the initiator's whole pool, the
    # destination through the target's (so neither side is kept warmer in cache than kvpush's).
    lstarts = block_starts(num_blocks, blocks, n)
    rstarts = block_starts(t_blocks, blocks, n)
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

    def post(i: int) -> tuple[Xfer, str]:
        li, ri = idx[i % len(idx)]
        return agent.post_write(local, li, remote, ri, (b"n%d" % i) if notif else b"")

    try:
        _run_writes(agent, post, warmup, inflight)
        run = _run_writes(agent, post, n, inflight)
    finally:
        agent.release_dlist(local)
        agent.release_dlist(remote)
        agent.remove_remote(name)
    lat = run.lat
    return {
        "n": n,
        "bytes": n * nbytes,
        "elapsed_s": run.elapsed_s,
        "cpu_s": run.cpu_s,
        "thread_cpu_s": run.thread_s,
        "gbps": n * nbytes / run.elapsed_s / 1e9,
        "per_s": n / run.elapsed_s,
        "post_to_done_p50_s": lat[len(lat) // 2] if lat else 0.0,
        "post_to_done_p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0,
        "post_us_per_desc": run.post_s / n / (blocks * regions) * 1e6,
    }


def _post_unmerged(
    agent: NixlAgent, local: DList, li: np.ndarray, remote: DList, ri: np.ndarray, notif: bytes
) -> tuple[Xfer, str]:
    """A WRITE with NIXL's descriptor merge off (``skip_desc_merge=True``, documented as
    deprecated in nixl 1.5.1). ``NixlAgent.post_write`` has no such switch (kvpush always
    merges), so this one baseline calls the agent inside the adapter directly."""
    from kvpush.transport.nixl import Xfer

    raw = cast(_UnmergedAgent, agent._agent)
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
    state: WorkerState,
    pairs: list[list[list[int]]],
    n: int,
    inflight: int,
    merge: bool = True,
    notif: bool = True,
    warmup: int = 1,
) -> RawLoopResult:
    """``n`` WRITEs cycling through ``pairs`` (``[local_ids, remote_ids]``, position-matched,
    every region), ``inflight`` at a time, into the prepared target; ``merge=False`` turns
    NIXL's merge of consecutive descriptors off."""
    from kvpush.memory.descriptors import xfer_indices

    node = state.raw.get()
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

    def post(i: int) -> tuple[Xfer, str]:
        li, ri = idx[i % len(idx)]
        msg = (b"n%d" % i) if notif else b""
        if merge:
            return agent.post_write(peer.local, li, peer.remote, ri, msg)
        return _post_unmerged(agent, peer.local, li, peer.remote, ri, msg)

    _run_writes(agent, post, warmup, inflight)
    run = _run_writes(agent, post, n, inflight)
    nbytes = sum(sizes[i % len(sizes)] for i in range(n))
    return {
        "n": n,
        "bytes": nbytes,
        "elapsed_s": run.elapsed_s,
        "cpu_s": run.cpu_s,
        "thread_cpu_s": run.thread_s,
        "gbps": nbytes / run.elapsed_s / 1e9,
        "per_s": n / run.elapsed_s,
        "post_to_done_p50_s": run.lat[len(run.lat) // 2] if run.lat else 0.0,
    }


COMMANDS: dict[str, Callable[..., object]] = {
    "raw_write_loop": raw_write_loop,
    "raw_pairs_loop": raw_pairs_loop,
}

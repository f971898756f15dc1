"""Worker-side commands of ``kvpush bench model``: the endpoint's pool as churn leaves it.

Run inside a bench worker that hosts an endpoint (``kvpush.commands.bench.worker``). Between
measurements, with the endpoint idle, ``model_pool`` replaces the pool's allocator by a fresh
one of the chosen policy (the extent allocator kvpush uses, or the plain free list baseline,
optionally in shuffled order) wrapped in a ``RecordingAllocator``; ``model_churn`` runs a
seeded churn on it and leaves its residents allocated; ``model_recorded`` hands back the
block ids the endpoint's own requests got, so that the orchestrator can count descriptors per
WRITE and replay the very same ids with raw NIXL and ``process_vm_writev``.

The endpoint code is untouched: its P writer and D receiver keep calling
``pool.allocator.<method>``; they just find another allocator there.

Threads: the worker's command threads; the recorder is called from the endpoint's threads.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import TypedDict, final

import numpy as np

from kvpush.commands.bench.churn import (
    CHURN_PREFIX,
    Allocator,
    ChurnFields,
    ChurnSpec,
    churn,
    make_room,
)
from kvpush.commands.bench.worker_state import WorkerState
from kvpush.memory.allocator import BlockAllocator, FreeListAllocator
from kvpush.memory.fragmentation import Fragmentation


class FragInfo(TypedDict):
    """A pool's ``Fragmentation`` as JSON (the reply of ``model_frag``)."""

    total: int
    free: int
    free_runs: int
    largest_free_run: int
    free_run_hist: list[int]
    alloc_mean_run_len: float


@final
class ChurnInfo(TypedDict):
    """What churn left in a pool (the reply of ``model_churn``)."""

    allocations: int
    forced_finishes: int
    churn_mean_run_len: float
    residents: int
    resident_blocks: int
    finished_for_room: int
    fragmentation: FragInfo


class PoolInfo(TypedDict):
    """The reply of ``model_pool``."""

    kind: str
    num_blocks: int


class RecordingAllocator:
    """An allocator proxy that remembers the ids of every allocation but churn's."""

    def __init__(self, inner: Allocator) -> None:
        self.inner = inner
        self.recorded: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def allocate(self, owner: str, n: int) -> np.ndarray:
        ids: np.ndarray = self.inner.allocate(owner, n)
        if not owner.startswith(CHURN_PREFIX):
            with self._lock:
                self.recorded[owner] = ids
        return ids

    def take(self, prefix: str) -> dict[str, list[int]]:
        with self._lock:
            keys = [k for k in self.recorded if k.startswith(prefix)]
            return {k: self.recorded.pop(k).tolist() for k in keys}

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def _recorder(state: WorkerState) -> RecordingAllocator:
    alloc = state.endpoint.get().pool.allocator
    if not isinstance(alloc, RecordingAllocator):
        raise RuntimeError("model_pool first")
    return alloc


def model_pool(state: WorkerState, kind: str, order_seed: int | None = None) -> PoolInfo:
    """Give the (idle) endpoint a fresh allocator: ``extent`` (kvpush's) or ``freelist``
    (in id order, or shuffled with ``order_seed``)."""
    pool = state.endpoint.get().pool
    deadline = time.monotonic() + 30.0
    while not _idle(pool.allocator):  # the last completions may still be releasing
        if time.monotonic() > deadline:
            raise RuntimeError(f"pool not idle: {pool.allocator.counts()}")
        time.sleep(0.01)
    n = int(pool.cfg.num_blocks)
    if kind == "extent":
        inner: Allocator = BlockAllocator(n)
    elif kind == "freelist":
        order = None
        if order_seed is not None:
            order = np.random.default_rng(order_seed).permutation(n)
        inner = FreeListAllocator(n, order=order)
    else:
        raise ValueError(f"unknown allocator {kind!r}")
    # A duck-typed proxy in the allocator's place: the endpoint's code is untouched.
    pool.allocator = RecordingAllocator(inner)  # type: ignore[assignment]
    gc.collect()  # see model_churn
    return {"kind": kind, "num_blocks": n}


def _idle(alloc: Allocator) -> bool:
    """Nothing but churn residents allocated (no request of the endpoint's own)."""
    return all(o.startswith(CHURN_PREFIX) for o in alloc.owners())


def model_churn(
    state: WorkerState, spec: ChurnFields, block_tokens: int, need_blocks: int
) -> ChurnInfo:
    """Churn the fresh allocator (``ChurnSpec`` fields), then finish residents until
    ``need_blocks`` are free. Returns what churn left: residents, fragmentation."""
    rec = _recorder(state)
    cs = ChurnSpec(**spec)
    res = churn(rec.inner, cs, block_tokens)
    finished = make_room(rec.inner, res.residents, need_blocks, cs.seed + 1000)
    # Churn leaves thousands of dead id arrays and dict entries behind: collect them now, so
    # that a full garbage collection (it stops every thread, the P writer's included) does
    # not land in the measurement that follows.
    gc.collect()
    f = rec.inner.fragmentation()
    return {
        "allocations": res.allocations,
        "forced_finishes": res.forced_finishes,
        "churn_mean_run_len": res.mean_run_len,
        "residents": len(res.residents),
        "resident_blocks": res.resident_blocks(),
        "finished_for_room": finished,
        "fragmentation": _frag(f),
    }


def model_recorded(state: WorkerState, prefix: str) -> dict[str, list[int]]:
    """Block ids of this endpoint's allocations whose owner starts with ``prefix`` (once)."""
    return _recorder(state).take(prefix)


def model_frag(state: WorkerState) -> FragInfo:
    return _frag(state.endpoint.get().pool.allocator.fragmentation())


def _frag(f: Fragmentation) -> FragInfo:
    return {
        "total": f.total,
        "free": f.free,
        "free_runs": f.free_runs,
        "largest_free_run": f.largest_free_run,
        "free_run_hist": list(f.free_run_hist),
        "alloc_mean_run_len": f.alloc_mean_run_len,
    }


COMMANDS: dict[str, Callable[..., object]] = {
    "model_pool": model_pool,
    "model_churn": model_churn,
    "model_recorded": model_recorded,
    "model_frag": model_frag,
}

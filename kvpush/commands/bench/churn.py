"""Pool churn and allocator cost: pure (an allocator in, readings out; no I/O, no threads).

``churn`` runs a seeded mix of request sizes and lifetimes on an allocator, the way a busy
decode (or prefill) pool lives: one request arrives per step with a size drawn log-uniformly
between ``min_tokens`` and ``max_tokens`` and an exponential lifetime whose mean keeps the pool
about ``occupancy`` full; a request that does not fit makes the soonest-finishing ones finish
first (a scheduler would queue it). What is left allocated at the end -- the *residents* -- is
the pool as churn leaves it. ``make_room`` then finishes residents (in seeded order) until a
measurement's requests fit. The same spec and seed give the same sequence of calls on any
allocator, so the extent allocator and the plain free list see exactly the same churn.

``alloc_cost`` times ``allocate``/``release`` at a steady churn, for the claim that allocation
stays flat in pool size (O(log n) in free runs).

Runs inside a bench worker on the endpoint's own allocator (``kvpush.commands.bench.modelgen``), and
in the orchestrator for ``alloc_cost`` and for tests.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeAlias, TypedDict

import numpy as np

from kvpush.memory.allocator import BlockAllocator, FreeListAllocator
from kvpush.memory.fragmentation import runs_in

#: Either of the pool's allocation policies (kvpush's extent allocator, the plain free list).
Allocator: TypeAlias = BlockAllocator | FreeListAllocator


class ChurnAllocator(Protocol):
    """What churn calls on an allocator (either policy, or a wrapper of one)."""

    num_blocks: int

    def allocate(self, owner: str, n: int) -> np.ndarray: ...
    def release(self, owner: str) -> int: ...
    def counts(self) -> dict[str, int]: ...


CHURN_PREFIX = "churn."


@dataclass(frozen=True)
class ChurnSpec:
    seed: int = 1
    steps: int = 4000
    occupancy: float = 0.75
    min_tokens: int = 64
    max_tokens: int = 8192


class ChurnFields(TypedDict):
    """A ``ChurnSpec`` as JSON (what ``model_churn`` is sent)."""

    seed: int
    steps: int
    occupancy: float
    min_tokens: int
    max_tokens: int


@dataclass
class ChurnResult:
    residents: dict[str, int]  # owner -> blocks, still allocated
    allocations: int
    forced_finishes: int  # requests finished early so that a new one fits
    mean_run_len: float  # blocks / runs over every churn allocation (how fragmented it got)

    def resident_blocks(self) -> int:
        return sum(self.residents.values())


def churn(alloc: ChurnAllocator, spec: ChurnSpec, block_tokens: int) -> ChurnResult:
    """Run ``spec`` on ``alloc`` (any allocator with the ``BlockAllocator`` API); owners are
    ``churn.<i>``. Deterministic for a given spec, block size and pool size."""
    rng = random.Random(spec.seed)
    total = int(alloc.num_blocks)
    lo, hi = math.log(spec.min_tokens), math.log(max(spec.min_tokens, spec.max_tokens))
    # Mean blocks of a log-uniform token count, then the lifetime that keeps ``occupancy``.
    mean_tokens = (
        (spec.max_tokens - spec.min_tokens) / (hi - lo) if hi > lo else float(spec.min_tokens)
    )
    mean_blocks = max(1.0, mean_tokens / block_tokens)
    mean_life = max(1.0, spec.occupancy * total / mean_blocks)
    live: dict[str, int] = {}
    ends: list[tuple[float, str]] = []  # (finish step, owner) heap
    held = forced = runs = blocks = 0
    for step in range(spec.steps):
        while ends and ends[0][0] <= step:
            _, owner = heapq.heappop(ends)
            held -= live.pop(owner)
            alloc.release(owner)
        tokens = math.exp(rng.uniform(lo, hi))
        n = min(total, max(1, math.ceil(tokens / block_tokens)))
        life = rng.expovariate(1.0 / mean_life)
        while total - held < n:  # finish the soonest-finishing first
            _, owner = heapq.heappop(ends)
            held -= live.pop(owner)
            alloc.release(owner)
            forced += 1
        owner = f"{CHURN_PREFIX}{step}"
        ids = alloc.allocate(owner, n)
        runs += runs_in(ids)
        blocks += n
        live[owner] = n
        held += n
        heapq.heappush(ends, (step + life, owner))
    return ChurnResult(live, spec.steps, forced, blocks / runs if runs else 0.0)


def make_room(alloc: ChurnAllocator, residents: dict[str, int], need_blocks: int, seed: int) -> int:
    """Finish residents in seeded random order until ``need_blocks`` are free; return how many
    were finished (``residents`` is updated)."""
    rng = random.Random(seed)
    order = sorted(residents)
    rng.shuffle(order)
    done = 0
    for owner in order:
        if alloc.counts()["free"] >= need_blocks:
            break
        alloc.release(owner)
        del residents[owner]
        done += 1
    return done


def alloc_cost(
    make: Callable[[int], Allocator],
    num_blocks: int,
    sizes: tuple[int, ...],
    ops: int,
    seed: int = 3,
    occupancy: float = 0.5,
    batch: int = 100,
) -> dict[str, float]:
    """ns per ``allocate`` and per ``release`` at a steady churn of ``ops`` allocations
    (request sizes drawn from ``sizes``, clipped to the pool; random releases keep the pool
    about ``occupancy`` full), after a warm-up that fills and churns the pool once.

    Every call is timed on its own; the figure is the median over batches of ``batch`` calls
    of their mean, so a preemption by another process on a shared host spoils one batch, not
    the figure (the plain mean is reported too)."""
    a = make(num_blocks)
    rng = random.Random(seed)
    target = max(1, int(num_blocks * occupancy))
    live: list[str] = []
    size_of: dict[str, int] = {}
    held = 0
    warm = 2 * max(1, target // max(1, min(sizes)))
    t_alloc: list[int] = []
    t_rel: list[int] = []
    runs_seen = 0
    clock = time.perf_counter_ns
    for i in range(warm + ops):
        timed = i >= warm
        k = min(num_blocks, rng.choice(sizes))
        while live and (held + k > max(k, target) or num_blocks - held < k):
            j = rng.randrange(len(live))
            owner = live[j]
            live[j] = live[-1]
            live.pop()
            held -= size_of.pop(owner)
            t0 = clock()
            a.release(owner)
            if timed:
                t_rel.append(clock() - t0)
        owner = f"o{i}"
        t0 = clock()
        a.allocate(owner, k)
        if timed:
            t_alloc.append(clock() - t0)
            if i % 64 == 0:
                runs_seen = max(runs_seen, a.fragmentation().free_runs)
        live.append(owner)
        size_of[owner] = k
        held += k
    return {
        "num_blocks": num_blocks,
        "allocate_ns": _batched_median(t_alloc, batch),
        "release_ns": _batched_median(t_rel, batch),
        "allocate_mean_ns": sum(t_alloc) / max(1, len(t_alloc)),
        "release_mean_ns": sum(t_rel) / max(1, len(t_rel)),
        "allocations": len(t_alloc),
        "max_free_runs": runs_seen,
    }


def _batched_median(xs: list[int], batch: int) -> float:
    """Median of the means of consecutive batches of ``xs`` (the last, partial one included)."""
    if not xs:
        return 0.0
    means = sorted(
        sum(xs[i : i + batch]) / len(xs[i : i + batch]) for i in range(0, len(xs), batch)
    )
    mid = len(means) // 2
    return means[mid] if len(means) % 2 else (means[mid - 1] + means[mid]) / 2

"""Property tests of kvpush.memory.allocator against a simple reference model.

A hypothesis state machine drives each allocator with random allocate / mark / release /
quarantine sequences and checks, after every step, that it agrees with a model written the
slow, obvious way: a set of free ids, owners with their ids and state, and the policy's choice
computed from scratch (best fit by run length for ``BlockAllocator``, a LIFO stack for the
``FreeListAllocator`` baseline). Plus unit tests of the policy's corner cases.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpush.config import PoolConfig
from kvpush.errors import NoFreeBlocksError
from kvpush.memory.allocator import (
    ALLOCATORS,
    BlockAllocator,
    BlockState,
    ExtentAllocator,
    FreeListAllocator,
)
from kvpush.memory.fragmentation import Fragmentation, runs_in

OWNERS = st.sampled_from([f"r{i}" for i in range(12)])


def runs_of_set(free: set[int]) -> list[tuple[int, int]]:
    """Maximal runs ``(start, length)`` of a set of ids, by start: the slow way."""
    out: list[tuple[int, int]] = []
    for b in sorted(free):
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def ordered_runs(ids: list[int]) -> int:
    """Runs a WRITE can merge, in the order the ids are held: the slow way."""
    return sum(1 for j, b in enumerate(ids) if j == 0 or b != ids[j - 1] + 1)


def best_fit_choice(free: set[int], n: int) -> list[int]:
    """The extent policy, from scratch: the smallest run >= n (lowest start on ties); when no
    run is long enough, the longest runs whole (highest start on ties) until the rest fits one
    run, chosen the same way. Ids ascending."""
    runs = runs_of_set(free)
    taken: list[tuple[int, int]] = []
    left = n
    while True:
        fits = [r for r in runs if r[1] >= left]
        if fits:
            s, _ = min(fits, key=lambda r: (r[1], r[0]))
            taken.append((s, left))
            break
        s, k = max(runs, key=lambda r: (r[1], r[0]))
        runs.remove((s, k))
        taken.append((s, k))
        left -= k
    return [b for s, k in sorted(taken) for b in range(s, s + k)]


def min_runs_needed(free: set[int], n: int) -> int:
    lens = sorted((k for _, k in runs_of_set(free)), reverse=True)
    total = 0
    for i, k in enumerate(lens, 1):
        total += k
        if total >= n:
            return i
    raise AssertionError("not enough free blocks")


class _Model(RuleBasedStateMachine):
    """Shared rules; subclasses say which allocator and how the model picks free ids."""

    policy = "extent"

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.a: BlockAllocator | FreeListAllocator = BlockAllocator(1)
        self.free: set[int] = set()
        self.held: dict[str, tuple[list[int], BlockState]] = {}
        self.reasons: dict[str, str] = {}

    # -- the policy's choice, computed from the model ------------------------------------
    def expected(self, n: int) -> list[int]:
        raise NotImplementedError

    def on_free(self, ids: list[int]) -> None:
        self.free.update(ids)

    def make(self, n: int) -> BlockAllocator | FreeListAllocator:
        raise NotImplementedError

    @initialize(n=st.integers(1, 48))
    def start(self, n: int) -> None:
        self.n = n
        self.a = self.make(n)
        self.free = set(range(n))

    # -- rules --------------------------------------------------------------------------
    @rule(owner=OWNERS)
    def allocate_one(self, owner: str) -> None:
        """A 1-block request, the commonest one (``BlockAllocator`` has a path of its own)."""
        self.allocate(owner, 1)

    @rule(owner=OWNERS, k=st.integers(1, 50))
    def allocate(self, owner: str, k: int) -> None:
        if owner in self.held:
            with pytest.raises(ValueError, match="already holds"):
                self.a.allocate(owner, k)
            return
        if k > len(self.free):
            with pytest.raises(NoFreeBlocksError) as info:
                self.a.allocate(owner, k)
            assert str(info.value) == f"no_free_blocks: need {k}, {len(self.free)} free of {self.n}"
            return
        want = self.expected(k)
        if self.policy == "extent":
            assert len(runs_of_set(set(want))) == min_runs_needed(self.free, k)
        got = self.a.allocate(owner, k)
        assert got.dtype == np.int64
        assert got.tolist() == want
        # never a block someone holds (quarantined ones included)
        held_now = {b for ids, _ in self.held.values() for b in ids}
        assert not held_now & set(want)
        self.free -= set(want)
        self.held[owner] = (want, BlockState.ALLOCATED)

    @rule(owner=OWNERS)
    def mark_inflight(self, owner: str) -> None:
        ids, state = self.held.get(owner, ([], None))
        if state is not BlockState.ALLOCATED:
            with pytest.raises(ValueError):
                self.a.mark_inflight(owner)
            return
        self.a.mark_inflight(owner)
        self.held[owner] = (ids, BlockState.INFLIGHT)

    @rule(owner=OWNERS)
    def mark_allocated(self, owner: str) -> None:
        ids, state = self.held.get(owner, ([], None))
        if state is not BlockState.INFLIGHT:
            with pytest.raises(ValueError):
                self.a.mark_allocated(owner)
            return
        self.a.mark_allocated(owner)
        self.held[owner] = (ids, BlockState.ALLOCATED)

    @rule(owner=OWNERS)
    def release(self, owner: str) -> None:
        ids, state = self.held.get(owner, ([], None))
        if state in (BlockState.ALLOCATED, BlockState.INFLIGHT):
            assert self.a.release(owner) == len(ids)
            del self.held[owner]
            self.on_free(ids)
        else:
            assert self.a.release(owner) == 0  # unknown, or quarantined: not released

    @rule(owners=st.lists(OWNERS, max_size=8))
    def release_many(self, owners: list[str]) -> None:
        """As ``release`` of each in turn (duplicates, unknown and quarantined owners free
        nothing); the free runs the invariant checks are the same either way."""
        want = 0
        for owner in owners:
            ids, state = self.held.get(owner, ([], None))
            if state in (BlockState.ALLOCATED, BlockState.INFLIGHT):
                want += len(ids)
                del self.held[owner]
                self.on_free(ids)
        assert self.a.release_many(owners) == want

    @rule(owner=OWNERS, reason=st.sampled_from(["cancelled", "write_timeout"]))
    def quarantine(self, owner: str, reason: str) -> None:
        ids, state = self.held.get(owner, ([], None))
        if state in (BlockState.ALLOCATED, BlockState.INFLIGHT):
            assert self.a.quarantine(owner, reason) == len(ids)
            self.held[owner] = (ids, BlockState.QUARANTINED)
            self.reasons[owner] = reason
        else:
            assert self.a.quarantine(owner, reason) == 0  # first reason kept

    @rule(owner=OWNERS)
    def release_quarantined(self, owner: str) -> None:
        ids, state = self.held.get(owner, ([], None))
        if state is BlockState.QUARANTINED:
            assert self.a.release_quarantined(owner) == len(ids)
            del self.held[owner]
            del self.reasons[owner]
            self.on_free(ids)
        else:
            assert self.a.release_quarantined(owner) == 0

    @precondition(lambda self: self.n > 0)
    @rule()
    def drain(self) -> None:
        """Release everything: the pool is one free run again (coalescing)."""
        for owner in list(self.held):
            ids, state = self.held.pop(owner)
            if state is BlockState.QUARANTINED:
                assert self.a.release_quarantined(owner) == len(ids)
                del self.reasons[owner]
            else:
                assert self.a.release(owner) == len(ids)
            self.on_free(ids)
        f = self.a.fragmentation()
        assert f.free == self.n
        if isinstance(self.a, BlockAllocator):
            assert f.free_runs == 1 and f.largest_free_run == self.n
            assert self.a.free_runs() == [(0, self.n)]
        assert f.alloc_runs == 0 and f.alloc_mean_run_len == 0.0

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        if self.n == 0:
            return
        by = dict.fromkeys(BlockState, 0)
        for ids, state in self.held.values():
            by[state] += len(ids)
        assert self.a.counts() == {
            "total": self.n,
            "free": len(self.free),
            "allocated": by[BlockState.ALLOCATED],
            "inflight": by[BlockState.INFLIGHT],
            "quarantined": by[BlockState.QUARANTINED],
        }
        assert sorted(self.a.owners()) == sorted(self.held)
        for owner, (ids, state) in self.held.items():
            assert self.a.blocks_of(owner).tolist() == ids
            assert self.a.state_of(owner) is state
        assert self.a.quarantined() == self.reasons
        # no block owned twice; free and held partition the pool
        held = [b for ids, _ in self.held.values() for b in ids]
        assert len(held) == len(set(held))
        assert set(held) | self.free == set(range(self.n))
        assert not set(held) & self.free
        # fragmentation readings, from the model
        runs = runs_of_set(self.free)
        f = self.a.fragmentation()
        assert f.free == len(self.free)
        assert f.free_runs == len(runs)
        assert f.largest_free_run == max((k for _, k in runs), default=0)
        hist = [0] * 8
        for _, k in runs:
            hist[k.bit_length() - 1] += 1
        while hist and not hist[-1]:
            hist.pop()
        assert f.free_run_hist == tuple(hist)
        n_runs = sum(ordered_runs(ids) for ids, _ in self.held.values())
        assert f.alloc_runs == n_runs
        assert f.alloc_blocks == len(held)
        if isinstance(self.a, BlockAllocator):
            assert self.a.free_runs() == runs  # coalesced: maximal runs only


class ExtentMachine(_Model):
    policy = "extent"

    def make(self, n: int) -> BlockAllocator:
        return BlockAllocator(n)

    def expected(self, n: int) -> list[int]:
        return best_fit_choice(self.free, n)


class FreeListMachine(_Model):
    policy = "freelist"

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[int] = []

    def make(self, n: int) -> FreeListAllocator:
        self.stack = list(range(n - 1, -1, -1))  # top at the end: 0 first
        return FreeListAllocator(n)

    def expected(self, n: int) -> list[int]:
        got = self.stack[-n:][::-1]
        del self.stack[-n:]
        return got

    def on_free(self, ids: list[int]) -> None:
        super().on_free(ids)
        self.stack.extend(reversed(ids))


_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestExtentAllocator = ExtentMachine.TestCase
TestExtentAllocator.settings = _SETTINGS
TestFreeListAllocator = FreeListMachine.TestCase
TestFreeListAllocator.settings = _SETTINGS


# -- unit tests of the policy -----------------------------------------------------------------


def _fragment(a: BlockAllocator, pattern: str) -> None:
    """Allocate one block per character, then release the '.' ones: 'xx..x' -> free [2, 4)."""
    for i in range(len(pattern)):
        a.allocate(f"b{i}", 1)
    for i, c in enumerate(pattern):
        if c == ".":
            a.release(f"b{i}")


def test_best_fit_takes_the_smallest_run_that_holds_the_request() -> None:
    a = BlockAllocator(20)
    _fragment(a, "x....x..x...x" + "x" * 7)  # free runs: [1,5) len 4, [6,8) len 2, [9,12) len 3
    assert a.free_runs() == [(1, 4), (6, 2), (9, 3)]
    assert a.allocate("q", 3).tolist() == [9, 10, 11]  # the 3-run, not the first-fit 4-run
    assert a.allocate("r", 2).tolist() == [6, 7]
    assert a.allocate("s", 1).tolist() == [1]  # only the 4-run is left: its head
    assert a.free_runs() == [(2, 3)]


def test_ties_go_to_the_lowest_start() -> None:
    a = BlockAllocator(10)
    _fragment(a, "x..x..x..x")
    assert a.allocate("q", 2).tolist() == [1, 2]
    assert a.allocate("r", 1).tolist() == [4]


def test_no_run_long_enough_takes_the_fewest_longest_runs() -> None:
    a = BlockAllocator(24)
    # free runs of lengths 1, 3, 2, 5, 1
    _fragment(a, "x.x...x..x.....x.xxxxxxx")
    assert [k for _, k in a.free_runs()] == [1, 3, 2, 5, 1]
    ids = a.allocate("q", 7)  # 5 + 2 (best fit for the rest), not 5 + 3 split
    assert ids.tolist() == [7, 8, 10, 11, 12, 13, 14]
    assert runs_in(ids) == 2
    assert a.fragmentation().alloc_runs == 12 + 2  # 12 single-block holders + q's two runs
    assert [k for _, k in a.free_runs()] == [1, 3, 1]


def test_release_coalesces_both_neighbours() -> None:
    a = BlockAllocator(9)
    for o in ("a", "b", "c"):
        a.allocate(o, 3)
    a.release("a")
    a.release("c")
    assert a.free_runs() == [(0, 3), (6, 3)]
    a.release("b")
    assert a.free_runs() == [(0, 9)]
    assert a.allocate("big", 9).tolist() == list(range(9))


def test_release_many_gives_a_batch_back_as_one_run() -> None:
    a = BlockAllocator(10)
    for i in range(8):
        a.allocate(f"r{i}", 1)
    a.quarantine("r4", "cancelled")
    # out of order, a duplicate, an unknown owner and a quarantined one (which stays held)
    assert a.release_many(["r3", "r1", "nobody", "r2", "r2", "r4", "r5"]) == 4
    assert a.free_runs() == [(1, 3), (5, 1), (8, 2)]
    assert a.state_of("r4") is BlockState.QUARANTINED and a.state_of("r2") is None
    assert a.release_many([]) == 0
    assert a.counts()["free"] == 6


def test_quarantined_blocks_do_not_coalesce_until_released() -> None:
    a = BlockAllocator(6)
    a.allocate("a", 2)
    a.allocate("b", 2)
    a.allocate("c", 2)
    a.quarantine("b", "cancelled")
    a.release("a")
    a.release("c")
    assert a.free_runs() == [(0, 2), (4, 2)]
    with pytest.raises(NoFreeBlocksError):
        a.allocate("d", 5)
    assert sorted(a.allocate("d", 4).tolist()) == [0, 1, 4, 5]  # never 2, 3
    a.release("d")
    a.release_quarantined("b")
    assert a.free_runs() == [(0, 6)]


def test_churn_keeps_runs_long_where_the_free_list_shreds_them() -> None:
    """A seeded churn of mixed sizes: the extent allocator's allocations stay in few runs."""
    rng = np.random.default_rng(7)
    results = {}
    for name, cls in ALLOCATORS.items():
        a = cls(4096)
        live: list[str] = []
        runs = blocks = 0
        for i in range(4000):
            k = int(rng.choice([4, 16, 64, 256]))
            while a.counts()["free"] < k or (live and rng.random() < 0.45):
                a.release(live.pop(int(rng.integers(len(live)))))
            ids = a.allocate(f"o{i}", k)
            live.append(f"o{i}")
            runs += runs_in(ids)
            blocks += k
        results[name] = blocks / runs
        rng = np.random.default_rng(7)  # the same churn for the next allocator
    assert results["extent"] > 4 * results["freelist"], results


def test_fragmentation_reading_and_gauges() -> None:
    a = BlockAllocator(16)
    _fragment(a, "x.xx..xxx....xxx")  # free runs 1, 2, 4
    a.allocate("big", 3)  # takes 3 of the 4-run
    f = a.fragmentation()
    assert isinstance(f, Fragmentation)
    assert (f.total, f.free, f.free_runs, f.largest_free_run) == (16, 4, 3, 2)
    assert f.free_run_hist == (2, 1)  # two runs of length 1, one of length 2..3
    assert f.histogram() == [(1, 1, 2), (2, 3, 1)]
    assert f.alloc_blocks == 12
    assert f.alloc_runs == 10  # 9 single blocks still held (bit of the pattern) + big's one
    assert f.gauges() == {
        "pool_free_runs": 3.0,
        "pool_largest_free_run": 2.0,
        "alloc_mean_run_len": 12 / 10,
    }


def test_extent_is_the_pool_allocator() -> None:
    assert ExtentAllocator is BlockAllocator
    assert ALLOCATORS["extent"] is BlockAllocator
    from kvpush.memory.pool import KvPool

    assert isinstance(
        KvPool(PoolConfig(num_blocks=4, layers=1, block_bytes=64)).allocator, BlockAllocator
    )


def test_free_list_order_and_lifo() -> None:
    a = FreeListAllocator(6, order=[5, 3, 1, 0, 2, 4])
    assert a.allocate("a", 2).tolist() == [5, 3]
    b = a.allocate("b", 3)
    assert b.tolist() == [1, 0, 2]
    a.release("b")
    assert a.allocate("c", 3).tolist() == b.tolist()
    f = a.fragmentation()
    assert (f.free_runs, f.largest_free_run, f.free) == (1, 1, 1)
    with pytest.raises(ValueError, match="permutation"):
        FreeListAllocator(3, order=[0, 0, 1])


@pytest.mark.parametrize("cls", list(ALLOCATORS.values()))
def test_both_policies_share_the_state_rules(cls: type[BlockAllocator]) -> None:
    a = cls(4)
    a.allocate("r", 2)
    with pytest.raises(ValueError, match="already holds 2 blocks"):
        a.allocate("r", 1)
    with pytest.raises(ValueError):
        a.mark_allocated("r")
    a.mark_inflight("r")
    assert a.quarantine("r", "x") == 2
    assert a.release("r") == 0
    with pytest.raises(NoFreeBlocksError):
        a.allocate("s", 3)
    assert a.release_quarantined("r") == 2
    assert a.counts()["free"] == 4


@given(st.lists(st.integers(0, 40)))
def test_runs_in_counts_maximal_ascending_runs(xs: list[int]) -> None:
    assert runs_in(np.array(sorted(set(xs)), dtype=np.int64)) == len(runs_of_set(set(xs)))
    assert runs_in(np.array(xs, dtype=np.int64)) == ordered_runs(xs)


@given(st.sets(st.integers(0, 60)), st.integers(1, 61))
def test_best_fit_reference_uses_the_fewest_runs(free: set[int], n: int) -> None:
    """The reference choice itself: n ids, all free, in the fewest runs possible."""
    if n > len(free):
        return
    got = best_fit_choice(free, n)
    assert len(got) == n == len(set(got))
    assert set(got) <= free
    assert len(runs_of_set(set(got))) == min_runs_needed(free, n)
    a = BlockAllocator(61)
    for b in range(61):
        assert a.allocate(f"h{b}", 1).tolist() == [b]
    for b in free:
        a.release(f"h{b}")
    assert a.allocate("q", n).tolist() == got

"""Unit tests of the pure pieces behind ``kvpush bench model``: model shapes, churn, merged
descriptor counts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.commands.bench.churn import CHURN_PREFIX, ChurnSpec, alloc_cost, churn, make_room
from kvpush.config import PoolConfig
from kvpush.errors import ConfigError
from kvpush.memory.allocator import ALLOCATORS, BlockAllocator, FreeListAllocator
from kvpush.memory.descriptors import contiguous_runs, merged_descriptors
from kvpush.memory.shapes import SHAPES, Shape, get_shape

# -- shapes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "regions", "page", "tokens", "blocks", "request_bytes"),
    [
        ("llama-8b", 64, 32 << 10, 512, 32, 64 << 20),
        ("llama-8b", 64, 32 << 10, 8192, 512, 1 << 30),
        ("llama-70b-tp8", 160, 4 << 10, 2048, 128, 80 << 20),
        ("mla", 61, 72 << 10, 8192, 128, 128 * 61 * (72 << 10)),
        ("mla", 61, 72 << 10, 100, 2, 2 * 61 * (72 << 10)),  # a partial block counts
    ],
)
def test_shape_geometry(
    name: str, regions: int, page: int, tokens: int, blocks: int, request_bytes: int
) -> None:
    s = get_shape(name)
    assert s.regions == regions
    assert s.page_bytes == page
    assert s.blocks_for(tokens) == blocks
    assert s.request_bytes(tokens) == request_bytes
    assert s.descriptors_unmerged(tokens) == blocks * regions


def test_shape_pool_config_matches_the_model_trio() -> None:
    s = SHAPES["llama-8b"]
    cfg = s.pool_config(1024)
    assert cfg == PoolConfig.from_model(
        num_blocks=1024, layers=32, block_tokens=16, kv_heads=8, head_dim=128, dtype="bfloat16"
    )
    assert cfg.regions == s.regions and cfg.block_bytes == s.page_bytes
    mla = SHAPES["mla"].pool_config(64)
    assert mla.regions == mla.layers == 61 and mla.kv_layout == "MLA" and mla.replicated


def test_shape_validation_and_lookup() -> None:
    with pytest.raises(ConfigError) as info:
        get_shape("llama-405b")
    assert info.value.hint == "choose one of llama-8b, llama-70b-tp8, mla"
    with pytest.raises(ValueError, match="regions"):
        Shape("x", layers=2, regions=3, block_tokens=16, kv_heads=1, head_dim=8,
              dtype="bfloat16", layout="kv")  # fmt: skip
    small = SHAPES["mla"].with_layers(2)
    assert (small.layers, small.regions, small.page_bytes) == (2, 2, 72 << 10)
    assert "61 regions of 72 KiB pages" in SHAPES["mla"].describe()


# -- churn ------------------------------------------------------------------------------------


class _Log:
    """An allocator wrapper that logs every call, to compare the churn sequences."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.calls: list[tuple[str, str, int]] = []

    def allocate(self, owner: str, n: int) -> np.ndarray:
        self.calls.append(("allocate", owner, n))
        return self.inner.allocate(owner, n)

    def release(self, owner: str) -> int:
        self.calls.append(("release", owner, 0))
        return self.inner.release(owner)

    def counts(self) -> dict[str, int]:
        return self.inner.counts()


def test_churn_is_the_same_sequence_on_every_allocator() -> None:
    spec = ChurnSpec(seed=5, steps=800, occupancy=0.9, min_tokens=64, max_tokens=4096)
    logs = []
    for cls in ALLOCATORS.values():
        log = _Log(cls(2048))
        res = churn(log, spec, block_tokens=16)
        logs.append(log.calls)
        held = log.inner.counts()
        assert held["allocated"] == res.resident_blocks() > 0
        assert all(o.startswith(CHURN_PREFIX) for o in log.inner.owners())
        assert res.allocations == spec.steps
    assert logs[0] == logs[1]


def test_churn_occupancy_and_make_room() -> None:
    a = BlockAllocator(4096)
    res = churn(a, ChurnSpec(seed=2, steps=3000, occupancy=0.9), block_tokens=16)
    assert res.resident_blocks() > 0.5 * 4096
    before = dict(res.residents)
    done = make_room(a, res.residents, 1500, seed=9)
    assert a.counts()["free"] >= 1500
    assert done == len(before) - len(res.residents)
    assert a.counts()["allocated"] == res.resident_blocks()
    # seeded: the same residents are finished again
    b = BlockAllocator(4096)
    res_b = churn(b, ChurnSpec(seed=2, steps=3000, occupancy=0.9), block_tokens=16)
    make_room(b, res_b.residents, 1500, seed=9)
    assert res_b.residents == res.residents


def test_alloc_cost_reports_per_call_times() -> None:
    r = alloc_cost(BlockAllocator, 256, (1, 4), ops=300)
    assert r["allocations"] == 300
    assert r["allocate_ns"] > 0 and r["release_ns"] > 0
    assert r["max_free_runs"] >= 1
    one = alloc_cost(FreeListAllocator, 1, (1, 4), ops=50)  # sizes clipped to the pool
    assert one["allocations"] == 50


# -- merged descriptors -----------------------------------------------------------------------


@given(
    st.lists(st.integers(0, 63), min_size=1, max_size=40),
    st.integers(0, 1000),
    st.integers(1, 8),
)
def test_merged_descriptors_bounds(local: list[int], offset: int, regions: int) -> None:
    lo = np.asarray(local, dtype=np.int64)
    ro = lo + offset  # the same layout shifted: merges exactly where local does
    got = merged_descriptors(lo, ro, regions)
    assert regions <= got <= lo.size * regions
    assert got == contiguous_runs(lo, ro).shape[0] * regions
    assert merged_descriptors(lo, ro[::-1].copy(), regions) >= got  # merging needs both sides


def test_merged_descriptors_examples() -> None:
    ids = np.arange(10, 42, dtype=np.int64)
    assert merged_descriptors(ids, ids + 100, 160) == 160  # one run per region
    shuffled = np.random.default_rng(0).permutation(ids)
    assert merged_descriptors(ids, shuffled, 4) >= 4 * 20
    # a break on either side splits the run
    assert merged_descriptors(np.array([0, 1, 2, 3]), np.array([5, 6, 9, 10]), 2) == 4

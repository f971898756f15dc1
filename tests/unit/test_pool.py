"""Unit tests of kvpush.memory: allocator states, descriptor arithmetic, KvPool fill/verify."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvpush.memory.pool as pool_mod
from kvpush.config import PoolConfig
from kvpush.errors import ConfigError, DeviceError, NoFreeBlocksError
from kvpush.memory.allocator import BlockAllocator, BlockState
from kvpush.memory.descriptors import block_descs, contiguous_runs, xfer_index_list, xfer_indices
from kvpush.memory.pattern import write_expected
from kvpush.memory.pool import KvPool

# -- BlockAllocator ---------------------------------------------------------------------------


def _check_invariants(a: BlockAllocator) -> None:
    """Counters, owner states, held ids and the free runs all agree (public readings only)."""
    counts = a.counts()
    by_state = dict.fromkeys(BlockState, 0)
    held = []
    for o in a.owners():
        state = a.state_of(o)
        assert state is not None and state is not BlockState.FREE
        ids = a.blocks_of(o)
        by_state[state] += ids.size
        held.append(ids)
    assert counts == {
        "total": a.num_blocks,
        "free": a.num_blocks - sum(by_state.values()),
        "allocated": by_state[BlockState.ALLOCATED],
        "inflight": by_state[BlockState.INFLIGHT],
        "quarantined": by_state[BlockState.QUARANTINED],
    }
    assert set(a.quarantined()) == {
        o for o in a.owners() if a.state_of(o) is BlockState.QUARANTINED
    }
    all_held = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
    assert len(np.unique(all_held)) == all_held.size == a.num_blocks - counts["free"]
    # The free runs are exactly the blocks nobody holds, each once, neighbours coalesced.
    runs = a.free_runs()
    free = np.concatenate([np.arange(s, s + n) for s, n in runs]) if runs else np.empty(0)
    assert len(np.unique(free)) == free.size == counts["free"]
    assert np.array_equal(np.sort(free), np.setdiff1d(np.arange(a.num_blocks), all_held))
    assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in itertools.pairwise(runs))
    assert a.fragmentation().free_runs == len(runs)


def test_allocate_gives_ascending_ids_and_counts() -> None:
    a = BlockAllocator(10)
    ids = a.allocate("r1", 4)
    assert ids.dtype == np.int64
    assert ids.tolist() == [0, 1, 2, 3]
    assert a.allocate("r2", 3).tolist() == [4, 5, 6]
    assert a.counts() == {"total": 10, "free": 3, "allocated": 7, "inflight": 0, "quarantined": 0}
    assert sorted(a.owners()) == ["r1", "r2"]
    assert a.state_of("r1") is BlockState.ALLOCATED
    _check_invariants(a)


def test_allocate_all_or_nothing_with_exact_message() -> None:
    a = BlockAllocator(8)
    a.allocate("r1", 5)
    with pytest.raises(NoFreeBlocksError) as info:
        a.allocate("r2", 4)
    assert str(info.value) == "no_free_blocks: need 4, 3 free of 8"
    assert info.value.hint  # the default hint of the error class
    assert a.counts()["free"] == 3
    assert a.state_of("r2") is None
    assert a.blocks_of("r2").size == 0
    assert a.allocate("r2", 3).size == 3
    _check_invariants(a)


def test_allocate_rejects_bad_n_and_duplicate_owner() -> None:
    a = BlockAllocator(8)
    with pytest.raises(ValueError):
        a.allocate("r", 0)
    with pytest.raises(ValueError):
        a.allocate("r", -1)
    a.allocate("r", 2)
    with pytest.raises(ValueError, match="already holds 2 blocks"):
        a.allocate("r", 1)
    a.quarantine("r", "cancelled")
    with pytest.raises(ValueError):
        a.allocate("r", 1)  # still held, quarantined
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_state_transitions_and_release() -> None:
    a = BlockAllocator(6)
    a.allocate("r", 4)
    a.mark_inflight("r")
    assert a.state_of("r") is BlockState.INFLIGHT
    assert a.counts()["inflight"] == 4
    with pytest.raises(ValueError):
        a.mark_inflight("r")  # already in flight
    a.mark_allocated("r")
    assert a.state_of("r") is BlockState.ALLOCATED
    with pytest.raises(ValueError):
        a.mark_allocated("r")
    with pytest.raises(ValueError):
        a.mark_inflight("nobody")
    a.mark_inflight("r")
    assert a.release("r") == 4  # INFLIGHT -> FREE
    assert a.state_of("r") is None
    assert a.release("r") == 0
    assert a.release("unknown") == 0
    assert a.counts()["free"] == 6
    _check_invariants(a)


def test_release_returns_ids_for_reuse_in_same_order() -> None:
    a = BlockAllocator(8)
    a.allocate("a", 3)
    b = a.allocate("b", 3)
    a.release("b")
    assert a.allocate("c", 3).tolist() == b.tolist()  # LIFO keeps runs contiguous
    _check_invariants(a)


def test_quarantine_keeps_blocks_until_released() -> None:
    a = BlockAllocator(5)
    ids = a.allocate("r", 3)
    a.mark_inflight("r")
    assert a.quarantine("r", "cancelled mid-WRITE") == 3
    assert a.state_of("r") is BlockState.QUARANTINED
    assert a.blocks_of("r").tolist() == ids.tolist()
    assert a.quarantined() == {"r": "cancelled mid-WRITE"}
    assert a.counts()["quarantined"] == 3
    assert a.release("r") == 0  # a plain release does not free quarantined blocks
    assert a.quarantine("r", "again") == 0  # first reason kept
    assert a.quarantined() == {"r": "cancelled mid-WRITE"}
    with pytest.raises(NoFreeBlocksError):
        a.allocate("s", 3)
    with pytest.raises(ValueError):
        a.mark_allocated("r")
    assert a.release_quarantined("r") == 3
    assert a.quarantined() == {}
    assert a.release_quarantined("r") == 0
    assert a.quarantine("unknown", "x") == 0
    assert a.counts()["free"] == 5
    _check_invariants(a)


def test_blocks_of_is_a_copy() -> None:
    a = BlockAllocator(4)
    a.allocate("r", 2)
    got = a.blocks_of("r")
    got[:] = 99
    assert a.blocks_of("r").tolist() == [0, 1]


def test_allocator_thread_safety() -> None:
    a = BlockAllocator(64)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(300):
                owner = f"{k}-{i}"
                try:
                    a.allocate(owner, 1 + (i % 5))
                except NoFreeBlocksError:
                    continue
                a.mark_inflight(owner)
                if i % 7 == 0:
                    a.quarantine(owner, "test")
                    a.release_quarantined(owner)
                else:
                    a.release(owner)
        except BaseException as exc:  # surfaced to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert a.counts()["free"] == 64
    _check_invariants(a)


# -- descriptor arithmetic --------------------------------------------------------------------


def _slow_descs(bases: list[int], nb: int, bb: int, dev: int) -> list[tuple[int, int, int]]:
    return [(base + b * bb, bb, dev) for base in bases for b in range(nb)]


def test_block_descs_match_slow_reference_region_major() -> None:
    bases = [0x7F00_0000_0000, 0x7F00_1000_0000, 0x10_0000]
    got = block_descs(bases, 5, 4096, 3)
    assert got.dtype == np.int64
    assert got.shape == (15, 3)
    assert [tuple(row) for row in got.tolist()] == _slow_descs(bases, 5, 4096, 3)
    # row r*num_blocks + b is region r block b
    assert got[1 * 5 + 4].tolist() == [bases[1] + 4 * 4096, 4096, 3]
    assert np.array_equal(block_descs(np.array(bases), 5, 4096, 3), got)
    assert block_descs([], 5, 64, 0).shape == (0, 3)


def test_xfer_indices_match_reference() -> None:
    ids = np.array([7, 2, 3], dtype=np.int64)
    got = xfer_indices(ids, 10, 3)
    assert got.dtype == np.int32
    assert got.tolist() == [r * 10 + b for r in range(3) for b in ids.tolist()]
    assert xfer_indices(np.empty(0, dtype=np.int64), 10, 3).size == 0
    # indices select the same rows the descriptors of those blocks are in
    descs = block_descs([1000, 5000], 10, 8, 0)
    assert descs[xfer_indices(ids, 10, 2), 0].tolist() == [
        base + b * 8 for base in (1000, 5000) for b in ids.tolist()
    ]


@given(
    ids=st.lists(st.integers(0, 199), max_size=90),
    regions=st.integers(1, 4),
    as_array=st.booleans(),
)
def test_xfer_indices_small_and_large_paths_agree(
    ids: list[int], regions: int, as_array: bool
) -> None:
    """Short lists take a plain-Python path, long ones numpy's: the same indices either way."""
    arg = np.array(ids, dtype=np.int64) if as_array else ids
    want = [r * 200 + b for r in range(regions) for b in ids]
    got = xfer_indices(arg, 200, regions)
    assert got.dtype == np.int32
    assert got.tolist() == want
    short = xfer_index_list(arg, 200, regions)  # what a WRITE's plan hands NIXL
    assert isinstance(short, list) == (len(want) <= 64)
    assert list(short) == want


@pytest.mark.parametrize("as_array", [True, False])
@pytest.mark.parametrize("bad", [10, -1])
@pytest.mark.parametrize("n", [1, 5, 40])  # one block, the plain-Python path and numpy's
def test_xfer_indices_rejects_out_of_range_every_path(n: int, as_array: bool, bad: int) -> None:
    ids = [0] * (n - 1) + [bad]
    with pytest.raises(ValueError, match="out of range"):
        xfer_indices(np.array(ids) if as_array else ids, 10, 2)
    with pytest.raises(ValueError, match="out of range"):
        xfer_index_list(np.array(ids) if as_array else ids, 10, 2)


@pytest.mark.parametrize("ids", [[np.int64(3)], [np.int64(3), np.int64(4)], np.array([3])])
def test_short_index_lists_hold_python_ints(ids: list[int] | np.ndarray) -> None:
    """What NIXL gets for a short push is a list of plain ints, whatever the ids came as."""
    got = xfer_index_list(ids, 10, 2)
    assert isinstance(got, list)
    assert all(type(i) is int for i in got)


def test_xfer_indices_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        xfer_indices(np.array([10]), 10, 2)
    with pytest.raises(ValueError):
        xfer_indices(np.array([-1]), 10, 2)
    with pytest.raises(ValueError):
        xfer_indices(np.array([0]), 2**30, 4)  # beyond int32 indices


@pytest.mark.parametrize(
    ("local", "remote", "runs"),
    [
        ([], [], []),
        ([5], [9], [(5, 9, 1)]),
        ([0, 1, 2, 3], [10, 11, 12, 13], [(0, 10, 4)]),
        ([0, 1, 5, 6, 7], [0, 1, 2, 3, 4], [(0, 0, 2), (5, 2, 3)]),  # local gap
        ([0, 1, 2, 3], [4, 5, 9, 10], [(0, 4, 2), (2, 9, 2)]),  # remote discontinuity
        ([3, 2, 1], [1, 2, 3], [(3, 1, 1), (2, 2, 1), (1, 3, 1)]),  # descending never merges
        ([0, 1, 1, 2], [0, 1, 2, 3], [(0, 0, 2), (1, 2, 2)]),  # repeated local id
    ],
)
def test_contiguous_runs(
    local: list[int], remote: list[int], runs: list[tuple[int, int, int]]
) -> None:
    got = contiguous_runs(np.array(local, dtype=np.int64), np.array(remote, dtype=np.int64))
    assert got.dtype == np.int64
    assert got.shape == (len(runs), 3)
    assert [tuple(r) for r in got.tolist()] == runs


def test_contiguous_runs_cover_every_pair_and_reject_mismatch() -> None:
    rng = np.random.default_rng(1)
    local = np.cumsum(rng.integers(1, 3, size=200))
    remote = np.cumsum(rng.integers(1, 3, size=200))
    runs = contiguous_runs(local, remote)
    assert int(runs[:, 2].sum()) == 200
    rebuilt_l = np.concatenate([np.arange(s, s + n) for s, _, n in runs.tolist()])
    rebuilt_r = np.concatenate([np.arange(s, s + n) for _, s, n in runs.tolist()])
    assert np.array_equal(rebuilt_l, local)
    assert np.array_equal(rebuilt_r, remote)
    with pytest.raises(ValueError):
        contiguous_runs(np.arange(3), np.arange(4))


# -- KvPool -----------------------------------------------------------------------------------


@pytest.fixture
def pool() -> KvPool:
    return KvPool(PoolConfig(num_blocks=32, layers=2, block_bytes=256, dtype="uint8"))


def host(pool: KvPool) -> np.ndarray:
    assert pool.host is not None
    return pool.host


def test_kvpool_cpu_geometry(pool: KvPool) -> None:
    assert pool.device_kind == "DRAM"
    assert pool.device_id == 0
    mem = host(pool)
    assert mem.shape == (4, 32, 256)
    assert mem.dtype == np.uint8
    assert mem.flags.c_contiguous
    assert pool.base_addr == mem.ctypes.data
    assert pool.nbytes == 4 * 32 * 256
    assert pool.region_stride == 32 * 256
    bases = pool.region_base_addrs()
    assert bases == [mem[r].ctypes.data for r in range(4)]
    descs = pool.all_block_descs()
    assert descs.shape == (4 * 32, 3)
    assert descs[2 * 32 + 5].tolist() == [mem[2, 5].ctypes.data, 256, 0]
    assert pool.allocator.counts()["total"] == 32
    assert int(mem.sum()) == 0


@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [9, 2, 17, 0, 31], [7]])
def test_fill_verify_roundtrip(pool: KvPool, ids: list[int]) -> None:
    block_ids = np.array(ids, dtype=np.int64)
    pool.fill("req-A", block_ids)
    assert pool.verify("req-A", block_ids)
    assert pool.verify("req-A", block_ids[:0])  # nothing to check
    # the bytes are the pattern, block j of the request at position ids[j]
    want = write_expected(np.empty((4, len(ids), 256), dtype=np.uint8), "req-A")
    assert np.array_equal(host(pool)[:, block_ids], want)
    others = np.setdiff1d(np.arange(32), block_ids)
    assert int(host(pool)[:, others].sum()) == 0  # nothing else written


def test_verify_fails_on_one_changed_byte(pool: KvPool) -> None:
    ids = np.array([4, 11, 12], dtype=np.int64)
    pool.fill("t", ids)
    host(pool)[3, 12, 200] ^= 1
    assert not pool.verify("t", ids)
    host(pool)[3, 12, 200] ^= 1
    assert pool.verify("t", ids)


def test_verify_fails_on_swapped_blocks(pool: KvPool) -> None:
    ids = np.array([1, 2, 3], dtype=np.int64)
    pool.fill("t", ids)
    assert not pool.verify("t", ids[[0, 2, 1]])
    assert not pool.verify("t", ids[::-1])


def test_verify_fails_on_other_transfer_or_shifted_j(pool: KvPool) -> None:
    ids = np.arange(5, 13, dtype=np.int64)
    pool.fill("t1", ids)
    assert not pool.verify("t2", ids)
    assert not pool.verify("t1", ids[1:])  # prefix trimmed: every j shifted by one
    assert not pool.verify("t1", ids + 1)
    assert pool.verify("t1", ids[:4])  # a prefix keeps its positions


def test_verify_fails_on_wrong_region(pool: KvPool) -> None:
    ids = np.array([0, 1], dtype=np.int64)
    pool.fill("t", ids)
    host(pool)[0, 0] = host(pool)[1, 0].copy()
    assert not pool.verify("t", ids)


def test_odd_block_size_without_tag() -> None:
    p = KvPool(PoolConfig(num_blocks=16, layers=1, block_bytes=12, dtype="uint8"))
    ids = np.array([5, 1, 9], dtype=np.int64)
    p.fill("x", ids)
    assert p.verify("x", ids)


def test_chunking_matches_single_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_mod, "_CHUNK_BYTES", 3 * 2 * 64)  # 3 blocks per chunk
    p = KvPool(PoolConfig(num_blocks=40, layers=1, block_bytes=64, dtype="uint8"))
    assert p._chunk_blocks == 3
    for ids in (np.arange(3, 20), np.random.default_rng(0).permutation(40)[:17]):
        p.fill("c", ids)
        assert p.verify("c", ids)
        want = write_expected(np.empty((2, 17, 64), dtype=np.uint8), "c")
        assert np.array_equal(host(p)[:, ids], want)
        assert not p.verify("d", ids)


def test_fill_rejects_out_of_range_ids(pool: KvPool) -> None:
    with pytest.raises(ValueError):
        pool.fill("t", np.array([32]))
    with pytest.raises(ValueError):
        pool.verify("t", np.array([-1]))


def test_cuda_without_cuda_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError) as info:
        KvPool(PoolConfig(num_blocks=4, layers=1, block_bytes=64, device="cuda:0"))
    assert info.value.message == (
        "CUDA requested (--device cuda:0) but this host has no usable CUDA device"
    )
    assert info.value.hint == "use --device cpu"


def test_cuda_bad_index_names_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceError) as info:
        KvPool(PoolConfig(num_blocks=4, layers=1, block_bytes=64, device="cuda:5"))
    assert info.value.message == (
        "CUDA device 5 requested (--device cuda:5) but this host has 2 CUDA devices (0..1)"
    )


def test_this_host_has_no_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(DeviceError, match="no usable CUDA device"):
        KvPool(PoolConfig(num_blocks=4, layers=1, block_bytes=64, device="cuda"))


def test_allocation_failure_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args: object, **kwargs: object) -> np.ndarray:
        raise MemoryError("Unable to allocate 512. B for an array")

    monkeypatch.setattr(np, "zeros", no_memory)
    cfg = PoolConfig(num_blocks=4, layers=1, block_bytes=64, dtype="uint8")
    with pytest.raises(ConfigError) as info:
        KvPool(cfg)
    assert "512 bytes" in info.value.message
    assert "--num-blocks" in info.value.hint


def test_an_endpoint_on_host_memory_never_imports_torch() -> None:
    """NIXL's meta package and the pool used to import torch on every endpoint (1-6 s of each
    start here): a fresh interpreter that makes a pool and a NIXL agent has no torch."""
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from kvpush.config import AgentConfig, PoolConfig\n"
        "from kvpush.memory.pool import KvPool\n"
        "from kvpush.transport.nixl import NixlAgent\n"
        "p = KvPool(PoolConfig(num_blocks=4, layers=1, block_bytes=64))\n"
        "a = NixlAgent('no-torch', AgentConfig())\n"
        "a.register_region(p.base_addr, p.nbytes, p.device_kind, p.device_id)\n"
        "p.fill('t', np.arange(4))\n"
        "assert p.verify('t', np.arange(4))\n"
        "a.close()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


class _StagedPool(KvPool):
    """The GPU path (``kvpush.memory.vram``: blocks staged through host buffers) run on a
    CPU torch tensor, so that its logic is tested on a host without a GPU."""

    def __init__(self, cfg: PoolConfig) -> None:
        from kvpush.memory import vram

        super().__init__(cfg)
        self.memory = vram.DeviceMemory((cfg.regions, cfg.num_blocks, cfg.block_bytes), "cpu", "x")
        self.host = None


@pytest.mark.parametrize("block_bytes", [256, 12])
def test_the_gpu_path_fills_verifies_and_digests_like_host_memory(block_bytes: int) -> None:
    pytest.importorskip("torch")
    cfg = PoolConfig(num_blocks=16, layers=2, block_bytes=block_bytes, dtype="uint8")
    staged, plain = _StagedPool(cfg), KvPool(cfg)
    for ids in (np.arange(2, 7), np.array([9, 1, 14, 3])):
        for p in (staged, plain):
            p.fill("g", ids)
            assert p.verify("g", ids)
            assert not p.verify("h", ids)
        assert staged.digest(ids) == plain.digest(ids)
        assert np.array_equal(staged.region_rows(1, ids), plain.region_rows(1, ids))
        assert np.array_equal(staged.page(3, int(ids[1])), plain.page(3, int(ids[1])))
    tensor = staged.as_tensor().numpy()
    assert np.array_equal(tensor, host(plain))
    staged.fill("other", np.array([3]))  # another transfer's bytes in one of g's blocks
    assert not staged.verify("g", np.array([9, 1, 14, 3]))
    if block_bytes >= 16:
        assert "position 3" in staged.explain("g", np.array([9, 1, 14, 3]))

"""Head-by-head verification of tensor-parallel pages (pure, no processes): ``KvPool``'s
pattern and ``explain`` at every rank, and ``kvpush.peers.tp``'s write slices composing every
page of D from P's ranks for every (P_tp, D_tp) in {1, 2, 4}^2 (moved from
``tests/integration/test_tp.py``, which runs the same matrix through real endpoints)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvpush.config import PoolConfig
from kvpush.errors import IncompatiblePeerError
from kvpush.memory.pool import KvPool
from kvpush.peers import tp
from kvpush.peers.tp import check_ratio, sources, targets, write_slice

HEAD = 256  # bytes of one head slice of one region's page
HEADS = 4  # the sharded model's KV heads: every TP in {1, 2, 4} divides it
TPS = (1, 2, 4)
PAIRS = [(p, d) for p in TPS for d in TPS]


def _pairs(pairs: list[tuple[int, int]]) -> list[Any]:
    return [pytest.param(p, d, id=f"P{p}-D{d}") for p, d in pairs]


def mem(pool: KvPool) -> np.ndarray:
    """The pool's bytes (host memory)."""
    assert pool.host is not None
    return pool.host


def _pool(kv_heads: int, tp: int) -> dict[str, Any]:
    page = HEAD * (1 if kv_heads == 1 else kv_heads // tp)
    layout = "MLA" if kv_heads == 1 else "NHD"
    return {"num_blocks": 8, "layers": 1, "block_bytes": page, "kv_heads": kv_heads,
            "tp_size": tp, "kv_layout": layout}  # fmt: skip


# ------------------------------------------------------------------ head-by-head verification

SHARDED = PoolConfig(num_blocks=8, layers=1, block_bytes=2 * HEAD, kv_heads=4, tp_size=2)


def test_wrong_ranks_share_fails_and_explain_names_rank_region_head() -> None:
    r0, r1 = KvPool(SHARDED, rank=0), KvPool(SHARDED, rank=1)
    ids = [5, 2, 7]
    r0.fill("t", np.array(ids))
    mem(r1)[:, ids] = mem(r0)[:, ids]  # rank 0's heads (0, 1) land on D rank 1
    assert r0.verify("t", np.array(ids))
    assert not r1.verify("t", np.array(ids))
    assert r1.explain("t", np.array(ids)) == (
        "rank 1, region 0, block 5 (position 0), head 2: holds region 0, head 0, position 0 instead"
    )


def test_head_swapped_inside_a_block_is_named() -> None:
    pool = KvPool(SHARDED, rank=1)
    ids = np.array([3, 6, 1])
    pool.fill("t", ids)
    page = mem(pool)[1, 6].reshape(2, HEAD)  # region 1, position 1: heads 2 and 3
    page[[0, 1]] = page[[1, 0]].copy()
    assert not pool.verify("t", ids)
    assert pool.verify("t", ids[:1])
    assert pool.explain("t", ids) == (
        "rank 1, region 1, block 6 (position 1), head 2: holds region 1, head 3, position 1 instead"
    )


def test_replicated_latent_is_the_same_page_on_every_rank() -> None:
    cfg = PoolConfig(num_blocks=4, layers=1, block_bytes=HEAD, kv_layout="MLA", tp_size=4)
    r0, r3 = KvPool(cfg, rank=0), KvPool(cfg, rank=3)
    r0.fill("t", np.array([0, 1]))
    mem(r3)[:, [2, 3]] = mem(r0)[:, [0, 1]]
    assert r3.verify("t", np.array([2, 3]))
    assert r3.explain("t", np.array([3, 2])) == (
        "rank 3, region 0, block 3 (position 0), head 0: holds region 0, head 0, position 1 instead"
    )


def _compose(p_tp: int, d_tp: int, kv_heads: int, swap: bool = False) -> list[KvPool]:
    """Fill every P rank's share, copy it into D's ranks as ``write_slice`` says (P ranks 0 and 1
    exchanged when ``swap``); return D's pools. Checks the copies per D rank against
    ``sources``: what D counts as completions."""
    p_cfg = PoolConfig(**{**_pool(kv_heads, p_tp), "num_blocks": 8, "layers": 1})
    d_cfg = PoolConfig(**{**_pool(kv_heads, d_tp), "num_blocks": 8, "layers": 1})
    p_ids, d_ids = [1, 3, 4], [6, 0, 2]
    ps = [KvPool(p_cfg, r) for r in range(p_tp)]
    ds = [KvPool(d_cfg, r) for r in range(d_tp)]
    for p in ps:
        p.fill("t", np.array(p_ids))
    writes = [0] * d_tp
    for pr in range(p_tp):
        src = ps[(1 - pr) if swap and pr < 2 else pr]
        for dr in targets(pr, p_tp, d_tp):
            sl = write_slice(
                pr, dr, p_tp, d_tp, p_cfg.block_bytes, d_cfg.block_bytes, p_cfg.replicated
            )
            chunk = mem(src)[:, p_ids, sl.local_offset : sl.local_offset + sl.length]
            mem(ds[dr])[:, d_ids, sl.remote_offset : sl.remote_offset + sl.length] = chunk
            writes[dr] += 1
    assert writes == [len(sources(dr, d_tp, p_tp)) for dr in range(d_tp)]
    return ds


@pytest.mark.parametrize(("p_tp", "d_tp"), _pairs(PAIRS))
@pytest.mark.parametrize("kv_heads", [HEADS, 1], ids=["sharded", "latent"])
def test_write_slices_compose_every_page(p_tp: int, d_tp: int, kv_heads: int) -> None:
    """The mapping of ``kvpush.peers.tp`` lands every head where D's pattern expects it (D's
    pools start zeroed, so a byte no slice covers fails too)."""
    for d in _compose(p_tp, d_tp, kv_heads):
        assert d.verify("t", np.array([6, 0, 2])), d.explain("t", np.array([6, 0, 2]))


@pytest.mark.parametrize(("p_tp", "d_tp"), _pairs([(2, 1), (2, 2), (2, 4), (4, 2)]))
def test_two_p_ranks_exchanged_is_caught_head_by_head(p_tp: int, d_tp: int) -> None:
    """P ranks 0 and 1 writing each other's share: D rank 0's first head slice holds P rank 1's
    first head (model head ``HEADS // p_tp``)."""
    ds = _compose(p_tp, d_tp, HEADS, swap=True)
    assert not ds[0].verify("t", np.array([6, 0, 2]))
    assert ds[0].explain("t", np.array([6, 0, 2])) == (
        f"rank 0, region 0, block 6 (position 0), head 0: "
        f"holds region 0, head {HEADS // p_tp}, position 0 instead"
    )


# ------------------------------------------------------------------ sizes that do not fit
@pytest.mark.parametrize("peer", ["10.0.0.7:5600", ("10.0.0.7", 5600)])
def test_sizes_that_do_not_divide_are_refused_naming_the_peer(peer: str | tuple[str, int]) -> None:
    """D checks each request's P with its address as a tuple, formatted only for the refusal."""
    for p_tp, d_tp in PAIRS:
        check_ratio(p_tp, d_tp, peer)  # 1, 2, 4: each divides the other
    with pytest.raises(IncompatiblePeerError, match=r"^10\.0\.0\.7:5600: tensor-parallel sizes"):
        check_ratio(3, 2, peer)


def test_rank_maps_of_huge_sizes_are_right_and_never_cached() -> None:
    """A hostile peer's TP size (up to 65,536 on the wire) is mapped like any other, and the
    cache of rank maps -- one lookup per request or PUSH_REG -- keeps only plausible sizes."""
    before = tp._facing_cached.cache_info().currsize
    for big in (tp.CACHED_TP + 1, 1 << 16):
        assert targets(0, 1, big) == tuple(range(big)) and sources(3, big, 1) == (0,)
        assert sources(0, 1, big) == tuple(range(big)) and targets(3, big, 1) == (0,)
    assert tp._facing_cached.cache_info().currsize == before
    assert sources(1, 2, 4) == (2, 3) and targets(1, 4, 2) == (0,)  # cached: the same maps

"""Unit tests of a push's write plan (``kvpush.prefill.plan``): what a peer's registration may
ask is checked before anything is written, and the descriptor pairs line up block by block."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.config import Role
from kvpush.prefill.plan import LocalGeometry, PlanError, WritePlan, plan_write
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol
from tests.support.fakes import make_metadata, stub_pool

D_POOL = stub_pool(num_blocks=32, layers=2)  # 4 regions (K and V of 2 layers), 32 blocks
P_GEOM = LocalGeometry(num_blocks=64, regions=4, block_bytes=64)


def _reg(groups: list[list[int]]) -> protocol.PushReg:
    return protocol.PushReg(
        request_id="r",
        transfer_id="t",
        decode_engine_id="d",
        decode_host="127.0.0.1",
        decode_port=7000,
        local_block_ids=groups,
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=7001,
    )


def _plan(local: list[int], remote: list[list[int]]) -> WritePlan:
    md = make_metadata(Role.DECODE, D_POOL, engine_id="d", incarnation="i" * 16)
    return plan_write(np.array(local, dtype=np.int64), _reg(remote), md, P_GEOM)


@pytest.mark.parametrize("n", [1, 3, 20])  # one block, a short list, numpy's path
def test_every_region_of_every_block_is_paired_in_order(n: int) -> None:
    local = list(range(40, 40 + n))
    remote = [31 - b for b in range(n)]
    plan = _plan(local, [remote])
    assert list(plan.local_idx) == [r * 64 + b for r in range(4) for b in local]
    assert list(plan.remote_idx) == [r * 32 + b for r in range(4) for b in remote]
    assert plan.nbytes == n * 4 * 64


@pytest.mark.parametrize("remote", [[32], [-1], [0, 32], [5] * 19 + [99]])
def test_a_block_id_outside_ds_pool_is_refused_as_a_bad_registration(remote: list[int]) -> None:
    with pytest.raises(PlanError) as e:
        _plan(list(range(len(remote))), [remote])
    assert e.value.reason == Failure.BAD_REGISTRATION
    assert "do not fit D's pool" in e.value.detail


def test_a_count_that_does_not_match_ps_blocks_is_refused() -> None:
    with pytest.raises(PlanError) as e:
        _plan([1, 2], [[3]])
    assert e.value.reason == Failure.BLOCK_COUNT_MISMATCH


def test_more_than_one_block_group_is_refused() -> None:
    with pytest.raises(PlanError) as e:
        _plan([1], [[3], [4]])
    assert e.value.reason == Failure.BAD_REGISTRATION

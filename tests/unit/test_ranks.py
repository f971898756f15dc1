"""P's rank routing of PUSH_REGs (``kvpush.prefill.ranks``): pure, no endpoint."""

from __future__ import annotations

import pytest

from kvpush.config import VllmWireConfig
from kvpush.peers.dialect import Dialect, KvpushDialect, VllmDialect
from kvpush.prefill.ranks import RankRouter, Refused, Routed
from kvpush.prefill.table import Registration
from kvpush.wire import protocol
from kvpush.wire.auth import Authenticator

KVPUSH: Dialect = KvpushDialect(Authenticator(None))
VLLM: Dialect = VllmDialect(VllmWireConfig(compat_hash="0" * 64))


def _reg(d_rank: int, d_tp: int, rid: str = "r1", sender: str = "d#0") -> Registration:
    reg = protocol.PushReg(
        request_id=rid,
        transfer_id=rid,
        decode_engine_id="d",
        decode_host="127.0.0.1",
        decode_port=5601,
        decode_tp_size=d_tp,
        decode_tp_rank=d_rank,
        local_block_ids=[[3, 4]],
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=5600,
    )
    return Registration(rid, reg, sender, 0.0)


@pytest.mark.parametrize(
    ("p_rank", "p_tp", "d_rank", "d_tp", "expected"),
    [
        (0, 1, 0, 1, 1),
        (1, 2, 0, 1, 1),  # P_tp = 2 D_tp: both P ranks write D rank 0
        (0, 1, 1, 2, 2),  # D_tp = 2 P_tp: P rank 0 writes D ranks 0 and 1
        (1, 2, 3, 4, 2),
    ],
)
def test_kvpush_wire_routes_the_named_rank(
    p_rank: int, p_tp: int, d_rank: int, d_tp: int, expected: int
) -> None:
    got = RankRouter(p_rank, p_tp, KVPUSH, ttl_s=60).route(_reg(d_rank, d_tp), 0.0)
    assert isinstance(got, Routed) and got.expected == expected
    assert [r.reg.decode_tp_rank for r in got.registrations] == [d_rank]
    assert not got.registrations[0].any_rank


@pytest.mark.parametrize(
    ("p_rank", "p_tp", "d_rank", "d_tp"),
    [
        (0, 2, 2, 4),  # P rank 0 of 2 writes D ranks 0 and 1 only
        (1, 2, 0, 4),
        (0, 1, 2, 2),  # no such D rank
        (0, 3, 0, 2),  # 3 and 2: neither divides the other
        (0, 2, 0, 3),
    ],
)
def test_other_ranks_are_refused(p_rank: int, p_tp: int, d_rank: int, d_tp: int) -> None:
    for vllm in (False, True):
        dialect = VLLM if vllm else KVPUSH
        got = RankRouter(p_rank, p_tp, dialect, ttl_s=60).route(_reg(d_rank, d_tp), 0.0)
        if vllm and not (p_tp % d_tp and d_tp % p_tp):
            continue  # vLLM's PUSH_REG names no rank: it is never "the wrong one"
        assert got == Refused(d_rank, d_tp)


def test_vllm_wire_one_target_takes_that_rank() -> None:
    """P_tp = 2 D_tp: vLLM's PUSH_REG says rank 0 (it has no field); P rank 3 of 4 writes D
    rank 1 of 2 and routes it there."""
    got = RankRouter(3, 4, VLLM, ttl_s=60).route(_reg(0, 2), 0.0)
    assert isinstance(got, Routed) and got.expected == 1
    assert [r.reg.decode_tp_rank for r in got.registrations] == [1]


def test_vllm_wire_fan_out_stands_for_every_rank_once() -> None:
    router = RankRouter(1, 2, VLLM, ttl_s=10)  # P rank 1 of 2, D at 4: D ranks 2 and 3
    first = router.route(_reg(0, 4, sender="d#2"), 0.0)
    assert isinstance(first, Routed) and first.expected == 2
    assert [r.reg.decode_tp_rank for r in first.registrations] == [2, 3]
    assert all(r.any_rank and r.sender == "d#2" for r in first.registrations)
    again = router.route(_reg(0, 4, sender="d#3"), 1.0)  # the other rank's PUSH_REG
    assert again == Routed((), 2)
    other = router.route(_reg(0, 4, rid="r2"), 1.0)  # another request fans out on its own
    assert isinstance(other, Routed) and len(other.registrations) == 2
    late = router.route(_reg(0, 4), 11.5)  # remembered for ttl_s only
    assert isinstance(late, Routed) and len(late.registrations) == 2

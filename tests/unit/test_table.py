"""The pure push table's matching: both arrival orders, duplicates, leases (expiry, renewal by
2/3), stale registrations, cancel. No threads, no clocks: every call gets its ``now``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.prefill.table import (
    CancelledEarly,
    DuplicateError,
    Finished,
    Push,
    PushTable,
    Registered,
    Registration,
    Waiting,
    reg_key,
)
from kvpush.wire import protocol

LEASE, REG_TTL = 30.0, 10.0


def fin(key: str, t: float = 0.0) -> Finished:
    return Finished(key, key, key, np.arange(2, dtype=np.int64), t)


def push_reg(transfer_id: str, request_id: str = "") -> protocol.PushReg:
    return protocol.PushReg(
        request_id=request_id or f"req-{transfer_id}",
        transfer_id=transfer_id,
        decode_engine_id="d",
        decode_host="127.0.0.1",
        decode_port=1,
        local_block_ids=[[0, 1]],
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=2,
    )


def reg(key: str, t: float = 0.0) -> Registration:
    r = push_reg(key)
    return Registration(reg_key(r), r, "d-agent", t)


@pytest.fixture
def m() -> PushTable:
    return PushTable(lease_s=LEASE, reg_ttl_s=REG_TTL)


def test_reg_key_is_transfer_id_with_request_id_fallback() -> None:
    assert reg_key(push_reg("t1", "r1")) == "t1"
    assert reg_key(push_reg("", "r1")) == "r1"


def test_blocks_first(m: PushTable) -> None:
    f = fin("a")
    assert m.add_finished(f, now=0.0) is None
    assert (m.count(Waiting), m.count(Registered)) == (1, 0)
    r = reg("a", 1.0)
    p = m.add_registration(r)
    assert isinstance(p, Push) and p.finished is f and p.registration is r and p.key == "a"
    assert p.attempt == 0
    assert (m.count(Waiting), m.count(Registered)) == (0, 0)
    assert m.expire(now=1e9) == ([], [])  # a matched request holds no lease


def test_registration_first(m: PushTable) -> None:
    r = reg("a")
    assert m.add_registration(r) is None
    assert (m.count(Waiting), m.count(Registered)) == (0, 1)
    f = fin("a")
    p = m.add_finished(f, now=0.0)
    assert isinstance(p, Push) and p.finished is f and p.registration is r
    assert (m.count(Waiting), m.count(Registered)) == (0, 0)
    assert m.expire(now=1e9) == ([], [])


def test_different_keys_do_not_match(m: PushTable) -> None:
    assert m.add_finished(fin("a"), 0.0) is None
    assert m.add_registration(reg("b")) is None
    assert isinstance(m.get("a"), Waiting) and m.count(Waiting) == 1


def test_duplicates_refused(m: PushTable) -> None:
    m.add_finished(fin("a"), 0.0)
    with pytest.raises(DuplicateError, match="transfer a already finished and waiting"):
        m.add_finished(fin("a"), 0.0)
    m.add_registration(reg("b"))
    with pytest.raises(DuplicateError, match="transfer b already registered"):
        m.add_registration(reg("b"))
    # The originals still match.
    assert m.add_registration(reg("a")) is not None
    assert m.add_finished(fin("b"), 0.0) is not None


def test_key_can_be_reused_after_a_match(m: PushTable) -> None:
    m.add_finished(fin("a"), 0.0)
    assert m.add_registration(reg("a")) is not None
    assert m.add_finished(fin("a"), 1.0) is None  # a new request with the same id


def test_lease_expires_at_its_length(m: PushTable) -> None:
    f = fin("a")
    m.add_finished(f, now=100.0)
    assert m.expire(now=100.0 + LEASE - 0.001) == ([], [])
    assert m.expire(now=100.0 + LEASE) == ([f], [])
    assert m.count(Waiting) == 0
    assert m.add_registration(reg("a")) is None  # gone: nothing to match any more


def test_heartbeat_extends_a_lease_to_two_thirds_of_its_length(m: PushTable) -> None:
    f = fin("a")
    m.add_finished(f, now=0.0)
    assert m.renew(["a", "unknown"], now=20.0) == 1  # 20 + 2/3*30 = 40 > 30
    assert m.expire(now=39.999) == ([], [])
    assert m.expire(now=40.0) == ([f], [])


def test_renew_never_shortens_a_lease(m: PushTable) -> None:
    f = fin("a")
    m.add_finished(f, now=0.0)
    assert m.renew(["a"], now=1.0) == 1  # 1 + 20 = 21 < 30: the lease stays at 30
    assert m.expire(now=29.9) == ([], [])
    assert m.expire(now=30.0) == ([f], [])


def test_renewals_keep_a_lease_alive_indefinitely(m: PushTable) -> None:
    f = fin("a")
    m.add_finished(f, now=0.0)
    t = 0.0
    for _ in range(50):
        t += 15.0  # heartbeats every half lease
        m.renew(["a"], now=t)
        assert m.expire(now=t) == ([], [])
    assert m.expire(now=t + LEASE * 2 / 3) == ([f], [])


def test_renew_ignores_matched_and_registered_keys(m: PushTable) -> None:
    m.add_registration(reg("r"))
    assert m.renew(["r"], now=0.0) == 0


def test_stale_registrations_dropped_after_ttl(m: PushTable) -> None:
    r = reg("a", t=5.0)
    m.add_registration(r)
    assert m.expire(now=5.0 + REG_TTL) == ([], [])
    assert m.expire(now=5.0 + REG_TTL + 0.001) == ([], [r])
    assert m.count(Registered) == 0
    assert m.add_finished(fin("a"), 20.0) is None


def test_expire_returns_both_kinds_and_keeps_the_rest(m: PushTable) -> None:
    fa, fb = fin("fa"), fin("fb")
    m.add_finished(fa, now=0.0)
    m.add_finished(fb, now=10.0)
    ra, rb = reg("ra", t=0.0), reg("rb", t=25.0)
    m.add_registration(ra)
    m.add_registration(rb)
    fins, regs = m.expire(now=30.0)
    assert fins == [fa] and regs == [ra]
    assert isinstance(m.get("fb"), Waiting) and m.count(Waiting) == 1
    assert m.count(Registered) == 1


def test_cancel(m: PushTable) -> None:
    f = fin("a")
    m.add_finished(f, 0.0)
    r = reg("b")
    m.add_registration(r)
    a, b = m.pop("a"), m.pop("b")
    assert isinstance(a, Waiting) and a.finished is f
    assert isinstance(b, Registered) and b.registration is r
    assert m.pop("c") is None
    assert m.expire(now=1e9) == ([], [])  # the cancelled lease is gone too
    assert (m.count(Waiting), m.count(Registered)) == (0, 0)


def test_drain_all(m: PushTable) -> None:
    f, r = fin("a"), reg("b")
    m.add_finished(f, 0.0)
    m.add_registration(r)
    assert m.drain_waiting() == ([f], [r])
    assert m.drain_waiting() == ([], [])
    assert m.expire(now=1e9) == ([], [])


@settings(max_examples=200, deadline=None, database=None)
@given(st.permutations([(k, side) for k in range(8) for side in ("fin", "reg")]))
def test_any_interleaving_matches_every_key_exactly_once(
    events: list[tuple[int, str]],
) -> None:
    m = PushTable(lease_s=LEASE, reg_ttl_s=REG_TTL)
    matched: list[str] = []
    for k, side in events:
        key = f"k{k}"
        p = m.add_finished(fin(key), 0.0) if side == "fin" else m.add_registration(reg(key))
        if p is not None:
            assert not isinstance(p, CancelledEarly)
            assert p.finished.key == p.registration.key == key
            matched.append(key)
    assert sorted(matched) == sorted(f"k{k}" for k in range(8))
    assert (m.count(Waiting), m.count(Registered)) == (0, 0)

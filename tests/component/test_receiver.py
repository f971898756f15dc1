"""Component tests of D's receiver, the layer P's writer has: real pool, telemetry, codec,
request table, owner loop, completer and HandshakeManager (talking over real ZMQ to stub P
peers); only the NIXL agent is faked (``tests.support.fakes``).

Tests call ``DecodeRole.decode`` as the side channel would, run one owner pass at a time
(``rig.step()``) and deliver P's notifications to the fake agent, so each step is observable:
allocation, the notif-only handshake, PUSH_REG, completion counting, deadlines, cancel,
quarantine until a fence, heartbeats and P's death.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Unpack

import numpy as np
import pytest

from kvpush.config import EndpointConfig, HandshakeMode, Role, Timeouts
from kvpush.decode.group import DecodeGroup
from kvpush.decode.limits import QUARANTINE_REPORT_S
from kvpush.decode.order import DecodeOrder
from kvpush.decode.role import DecodeRole
from kvpush.memory.allocator import BlockState
from kvpush.memory.pool import KvPool
from kvpush.peers.handshakes import HandshakeManager
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import TransferError, TransferKind
from kvpush.wire import protocol
from kvpush.wire.notifs import Codec
from tests.support.fakes import (
    FakeAgent,
    StubOptions,
    StubPeer,
    closed_port,
    decode_notif,
    fake_context,
    stub_pool,
    wait_until,
)

D_POOL = stub_pool(num_blocks=16, layers=2, block_bytes=64)


@dataclass
class Rig:
    agent: FakeAgent
    pool: KvPool
    tm: Telemetry
    hs: HandshakeManager
    role: DecodeRole
    codec: Codec
    control: ThreadPoolExecutor
    stubs: list[StubPeer] = field(default_factory=list)

    def stub(self, **kw: Unpack[StubOptions]) -> StubPeer:
        s = StubPeer(Role.PREFILL, stub_pool(num_blocks=32), **kw)
        self.stubs.append(s)
        return s

    def step(self) -> bool:
        return self.role.owner.run_once()

    def steps_until(self, pred: Callable[[], object], what: str, timeout_s: float = 5.0) -> None:
        def go() -> bool:
            self.step()
            return bool(pred())

        wait_until(go, timeout_s, what=what)

    def decode(
        self, p: StubPeer, tid: str, n: int = 2, deadline_s: float = 0.0
    ) -> Future[protocol.DecodeRep]:
        return self.role.decode(DecodeOrder(tid, p.address, n, deadline_s))

    def registered(self, p: StubPeer, tid: str) -> protocol.PushReg:
        """Run passes until D sent P the PUSH_REG of ``tid``; return it."""

        def find() -> protocol.PushReg | None:
            for m in self.sent_to(p):
                if isinstance(m, protocol.PushReg) and m.transfer_id == tid:
                    return m
            return None

        self.steps_until(find, f"the PUSH_REG of {tid}")
        reg = find()
        assert reg is not None
        return reg

    def from_p(self, p: StubPeer, msg: protocol.Notif, sender: str = "") -> None:
        self.agent.deliver(sender or p.agent_name, self.codec.encode(msg))

    def land(self, tid: str) -> None:
        """What P's WRITE does: the transfer's bytes into D's blocks."""
        self.pool.fill(tid, self.pool.allocator.blocks_of(tid))

    def result(self, fut: Future[protocol.DecodeRep], timeout_s: float = 5.0) -> protocol.DecodeRep:
        self.steps_until(fut.done, "the request's answer", timeout_s)
        return fut.result()

    def sent_to(self, p: StubPeer) -> list[protocol.Notif]:
        return [decode_notif(m) for m in self.agent.sent_to(p.agent_name)]

    def failures(self) -> dict[str, int]:
        return self.tm.snapshot().failures

    def counters(self) -> dict[str, int]:
        return self.tm.snapshot().counters

    def free(self) -> int:
        return self.pool.allocator.counts()["free"]

    def housekeeping_at(self, t: float) -> None:
        self.role.receiver.housekeeping(t)


def _make_rig(
    handshake: HandshakeMode = HandshakeMode.NOTIF, tp_size: int = 1, coalesce: bool = True
) -> Rig:
    cfg = EndpointConfig(
        role=Role.DECODE,
        engine_id="d-test",
        pool=D_POOL,
        timeouts=Timeouts(side_channel_s=5, handshake_s=5, heartbeat_s=5),
        handshake_mode=handshake,
        tp_size=tp_size,
        coalesce=coalesce,
    )
    agent = FakeAgent(name="d-test#fake")
    ctx = fake_context(cfg, agent)
    role = DecodeRole(ctx)
    role.owner.export_gauges(ctx.telemetry)
    return Rig(agent, ctx.pool, ctx.telemetry, ctx.handshakes, role, ctx.codec, ctx.control)


def _settled(hs: HandshakeManager) -> bool:
    return hs.counts()["connecting"] == 0


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(handshake: HandshakeMode = HandshakeMode.NOTIF, tp_size: int = 1) -> Rig:
        r = _make_rig(handshake, tp_size)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        close_rig(r)


def close_rig(r: Rig) -> None:
    """Stop a rig's completer, its stub peers and its handshakes (a fixture's teardown)."""
    r.role.completer.close()
    r.control.shutdown()
    for s in r.stubs:
        s.let_go()
    wait_until(functools.partial(_settled, r.hs), 10, "handshakes to settle")
    for s in r.stubs:
        s.stop()
    r.hs.close()


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:
    return make_rig()


# ------------------------------------------------------------------ allocation


def test_no_free_blocks_refused_at_once(rig: Rig) -> None:
    p = rig.stub()
    fut = rig.decode(p, "big", n=D_POOL.num_blocks + 1)
    assert fut.done()  # refused before anything reached the receiver
    rep = fut.result()
    assert rep.outcome == "failed" and rep.reason == "no_free_blocks"
    assert rig.free() == D_POOL.num_blocks
    assert rig.failures()["no_free_blocks"] == 1
    assert p.requests == []  # no handshake for a refused request


def test_only_a_failed_answer_is_told_to_on_failed_before_it_is_out(rig: Rig) -> None:
    """The rank group's decline to P rides the failure path: ``on_failed`` hears each failed
    answer once, before its future is done (refused at once, failed on the receiver or by its
    verification), and never an ok one."""
    told: list[tuple[str, str, bool]] = []
    futs: dict[str, Future[protocol.DecodeRep]] = {}

    def on_failed(rep: protocol.DecodeRep) -> None:
        told.append((rep.transfer_id, rep.reason, futs[rep.transfer_id].done()))

    def decode(tid: str, n: int, deadline_s: float = 0.0) -> Future[protocol.DecodeRep]:
        fut = futs[tid] = Future()  # (the role's own future, answered alike)
        got = rig.role.decode(DecodeOrder(tid, p.address, n, deadline_s), on_failed=on_failed)
        got.add_done_callback(lambda f: fut.set_result(f.result()))
        return got

    p = rig.stub()
    decode("big", D_POOL.num_blocks + 1)  # refused at once
    late = decode("late", 2, deadline_s=0.2)  # fails on the receiver at its deadline
    ok, wrong = decode("t1", 2), decode("t2", 2)
    for tid in ("t1", "t2"):
        rig.registered(p, tid)
    rig.land("t1")
    rig.pool.fill("another-transfer", rig.pool.allocator.blocks_of("t2"))  # fails verification
    for tid in ("t1", "t2"):
        rig.from_p(p, protocol.Completion(request_id=tid, transfer_id=tid))
    assert rig.result(ok).outcome == "ok"
    assert rig.result(wrong).reason == "verify_failed"
    assert rig.result(late, timeout_s=10).reason == "deadline"
    assert sorted(told) == [  # (in any order: the deadline and the verification race)
        ("big", "no_free_blocks", False),
        ("late", "deadline", False),
        ("t2", "verify_failed", False),
    ]


def test_duplicate_request_id_refused(rig: Rig) -> None:
    p = rig.stub(hold=True)
    rig.decode(p, "t1")
    rep = rig.decode(p, "t1").result(1)
    assert rep.outcome == "failed" and rep.reason == "duplicate_request"
    assert rig.free() == D_POOL.num_blocks - 2  # the first request keeps its blocks


def test_group_refusing_a_duplicate_id_cancels_no_rank(make_rig: Callable[..., Rig]) -> None:
    """Two D ranks under one ``DecodeGroup``: a second request under an id both ranks hold is
    refused at once on each, and the join cancels no rank -- the request that holds the id
    keeps waiting on every rank (no Cancel reaches P)."""
    ranks = [make_rig(), make_rig()]
    p = ranks[0].stub()
    group = DecodeGroup([r.role for r in ranks])
    first = group.decode("t1", p.address, 2, request_id="r1")
    for r in ranks:
        r.registered(p, "t1")
    dup = group.decode("t2", p.address, 2, request_id="r1")
    rep = dup.result(1)
    assert rep.outcome == "failed" and rep.reason == "duplicate_request"
    assert rep.detail == "D rank 0: request id in use"
    for _ in range(5):
        for r in ranks:
            r.step()
    for r in ranks:
        assert not any(isinstance(m, protocol.Cancel) for m in r.sent_to(p))
        assert r.role.receiver.table.waiting("r1") is not None
    assert not first.done()


# ------------------------------------------------------------------ handshake and PUSH_REG


def test_notif_only_handshake_then_push_reg(rig: Rig) -> None:
    p = rig.stub()
    rig.decode(p, "t1", n=3)
    reg = rig.registered(p, "t1")
    assert p.requests[0].mode == "notif"  # D only ever notifies P
    assert rig.agent.loaded[p.agent_name] == "conn"  # connection-only metadata loaded
    ids = rig.pool.allocator.blocks_of("t1")
    assert reg.local_block_ids == [ids.tolist()] and len(ids) == 3
    assert reg.request_id == "t1" and reg.decode_engine_id == "d-test"
    assert (reg.remote_host, reg.remote_port) == p.key[:2]
    assert rig.counters()["push_regs_sent"] == 1
    assert rig.pool.allocator.state_of("t1") == BlockState.ALLOCATED


def test_handshake_pending_never_blocks_the_receiver(rig: Rig) -> None:
    slow = rig.stub(hold=True)
    fast = rig.stub()
    rig.decode(slow, "slow")
    rig.step()  # the receiver takes the request and starts its handshake
    wait_until(slow.got_request.is_set, what="the held handshake")
    rig.decode(fast, "fast")
    rig.registered(fast, "fast")  # while slow's handshake is still held
    assert rig.sent_to(slow) == []
    slow.release()
    rig.registered(slow, "slow")


def test_unreachable_prefill_fails_with_its_reason(rig: Rig) -> None:
    port = closed_port()
    fut = rig.role.decode(DecodeOrder("t1", f"127.0.0.1:{port}", 2))
    rep = rig.result(fut, timeout_s=20)  # nothing accepts: the side-channel deadline (5 s)
    assert rep.outcome == "failed" and rep.reason == "prefill_unreachable"
    assert rig.free() == D_POOL.num_blocks


# ------------------------------------------------------------------ completions


def test_one_completion_completes_and_verifies(rig: Rig) -> None:
    p = rig.stub()
    fut = rig.decode(p, "t1", n=2)
    reg = rig.registered(p, "t1")
    rig.land("t1")
    rig.from_p(p, protocol.Completion(request_id=reg.request_id, transfer_id="t1"))
    rep = rig.result(fut)
    assert rep.outcome == "ok" and rep.verified is True
    assert rep.nbytes == 2 * D_POOL.regions * D_POOL.block_bytes
    assert rig.free() == D_POOL.num_blocks
    assert rig.counters()["requests_ok"] == 1


def test_completions_counted_per_p_rank(rig: Rig) -> None:
    p = rig.stub(tp_size=2)  # P at TP 2, D at TP 1: one completion from each P rank
    fut = rig.decode(p, "t1")
    rig.registered(p, "t1")
    rig.steps_until(lambda: rig.agent.sent_to(p.agent_of(1)), "the PUSH_REG to P rank 1")
    rig.land("t1")
    done = protocol.Completion(request_id="t1", transfer_id="t1", p_tp_size=2)
    rig.from_p(p, done)
    rig.step()
    rig.step()
    assert not fut.done()
    rig.from_p(p, done)  # rank 0 again: refused, counted
    rig.step()
    rig.step()
    assert not fut.done() and rig.failures()["duplicate_completion"] == 1
    rig.from_p(p, done, sender=p.agent_of(1))
    assert rig.result(fut).outcome == "ok"


def test_p_at_tp_that_does_not_fit_is_refused_naming_both_sizes(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig(tp_size=2)
    p = rig.stub(tp_size=3)
    rep = rig.result(rig.decode(p, "t1"))
    assert rep.outcome == "failed" and rep.reason == "incompatible"
    assert "P has 3 ranks, D has 2" in rep.detail
    assert rig.free() == D_POOL.num_blocks


def test_wrong_bytes_fail_verification(rig: Rig) -> None:
    p = rig.stub()
    fut = rig.decode(p, "t1")
    rig.registered(p, "t1")
    rig.pool.fill("another-transfer", rig.pool.allocator.blocks_of("t1"))
    rig.from_p(p, protocol.Completion(request_id="t1", transfer_id="t1"))
    rep = rig.result(fut)
    assert rep.outcome == "failed" and rep.reason == "verify_failed" and rep.verified is False
    assert rig.free() == D_POOL.num_blocks


def test_completion_from_another_agent_is_forged(rig: Rig) -> None:
    p = rig.stub()
    fut = rig.decode(p, "t1")
    rig.registered(p, "t1")
    rig.from_p(p, protocol.Completion(request_id="t1", transfer_id="t1"), sender="mallory")
    rig.step()
    assert rig.failures()["forged_notif"] == 1
    assert not fut.done()
    rig.land("t1")
    rig.from_p(p, protocol.Completion(request_id="t1", transfer_id="t1"))
    assert rig.result(fut).outcome == "ok"


def test_unknown_completion_counted(rig: Rig) -> None:
    p = rig.stub()
    rig.from_p(p, protocol.Completion(request_id="nobody", transfer_id="nobody"))
    rig.step()
    assert rig.failures()["unknown_completion"] == 1


# ------------------------------------------------------------------ deadlines, cancel, quarantine


def test_deadline_after_push_reg_cancels_and_quarantines_until_fenced(rig: Rig) -> None:
    p = rig.stub()
    fut = rig.decode(p, "t1", deadline_s=30)
    reg = rig.registered(p, "t1")
    rig.housekeeping_at(time.monotonic() + 31)
    rep = fut.result(1)
    assert rep.outcome == "failed" and rep.reason == "deadline"
    (cancel,) = [m for m in rig.sent_to(p) if isinstance(m, protocol.Cancel)]
    assert cancel.request_id == reg.request_id and cancel.transfer_id == "t1"
    # P's WRITE may still be moving: the blocks are nobody else's until P's fence.
    assert rig.pool.allocator.state_of("t1") == BlockState.QUARANTINED
    rig.role.owner.force_housekeeping()
    rig.step()  # the owner publishes its gauges
    assert rig.tm.snapshot().gauges["d_quarantined_requests"] == 1
    rig.from_p(p, protocol.Fence(fence_id="f1", request_ids=[reg.request_id]), sender="mallory")
    rig.step()
    assert rig.pool.allocator.state_of("t1") == BlockState.QUARANTINED  # not from its P
    rig.from_p(p, protocol.Fence(fence_id="f1", request_ids=[reg.request_id]))
    rig.steps_until(lambda: rig.free() == D_POOL.num_blocks, "the fence to free the blocks")
    assert rig.counters()["quarantine_released"] == 1


def test_a_long_quarantine_is_reported_once_with_what_it_waits_on(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    p = rig.stub()
    fut = rig.decode(p, "t1", deadline_s=0.05)
    rig.registered(p, "t1")
    time.sleep(0.1)
    t = time.monotonic()
    rig.housekeeping_at(t)
    assert fut.result(1).reason == "deadline"
    rig.housekeeping_at(t + 2)  # not long yet
    assert rig.counters().get("quarantines_long", 0) == 0
    with caplog.at_level("WARNING"):
        rig.housekeeping_at(t + 2 + QUARANTINE_REPORT_S)
        rig.housekeeping_at(t + 4 + QUARANTINE_REPORT_S)  # once per request
    assert rig.counters()["quarantines_long"] == 1
    (msg,) = [r.getMessage() for r in caplog.records if "quarantined for" in r.getMessage()]
    assert "t1" in msg and "rank 0 (agent " in msg, msg
    assert rig.pool.allocator.state_of("t1") == BlockState.QUARANTINED  # reported, not freed


def test_late_completion_of_an_abandoned_request_frees_its_blocks(rig: Rig) -> None:
    p = rig.stub()
    fut = rig.decode(p, "t1", deadline_s=30)
    rig.registered(p, "t1")
    rig.housekeeping_at(time.monotonic() + 31)
    assert fut.result(1).reason == "deadline"
    rig.from_p(p, protocol.Completion(request_id="t1", transfer_id="t1"))
    rig.steps_until(lambda: rig.free() == D_POOL.num_blocks, "the late completion")


def test_cancel_before_registration_frees_at_once(rig: Rig) -> None:
    p = rig.stub(hold=True)
    fut = rig.decode(p, "t1")
    rig.step()
    wait_until(p.got_request.is_set, what="the held handshake")
    rig.role.cancel("t1")
    rep = rig.result(fut)
    assert rep.outcome == "failed" and rep.reason == "cancelled"
    assert rig.free() == D_POOL.num_blocks  # nothing was registered: nothing can land
    p.release()
    rig.step()
    assert rig.sent_to(p) == []  # neither PUSH_REG nor Cancel for it


def test_cancel_after_registration_tells_p_and_quarantines(rig: Rig) -> None:
    p = rig.stub()
    fut = rig.decode(p, "t1")
    rig.registered(p, "t1")
    rig.role.cancel("t1")
    assert rig.result(fut).reason == "cancelled"
    assert any(isinstance(m, protocol.Cancel) for m in rig.sent_to(p))
    assert rig.pool.allocator.state_of("t1") == BlockState.QUARANTINED
    # P acknowledges: nothing was written (may_have_written=False) -> free.
    ack = protocol.Failure(request_id="t1", transfer_id="t1", reason="cancelled")
    rig.from_p(p, ack)
    rig.steps_until(lambda: rig.free() == D_POOL.num_blocks, "the acknowledgement")


def test_failure_from_p_with_may_have_written_quarantines(rig: Rig) -> None:
    p = rig.stub()
    fut = rig.decode(p, "t1")
    rig.registered(p, "t1")
    rig.from_p(
        p,
        protocol.Failure(
            request_id="t1", transfer_id="t1", reason="write_timeout", may_have_written=True
        ),
    )
    rep = rig.result(fut)
    assert rep.outcome == "failed" and rep.reason == "write_timeout"
    assert rig.pool.allocator.state_of("t1") == BlockState.QUARANTINED
    assert not any(isinstance(m, protocol.Cancel) for m in rig.sent_to(p))  # P knows already


def test_failure_from_p_names_its_reason(rig: Rig) -> None:
    p = rig.stub()
    fut = rig.decode(p, "t1")
    rig.registered(p, "t1")
    rig.from_p(p, protocol.Failure(request_id="t1", transfer_id="t1", reason="no_blocks"))
    rep = rig.result(fut)
    assert rep.reason == "no_blocks" and rig.free() == D_POOL.num_blocks


# ------------------------------------------------------------------ heartbeats, P's death


def test_heartbeats_name_the_registered_transfers(rig: Rig) -> None:
    p = rig.stub()
    rig.decode(p, "t1")
    rig.decode(p, "t2")
    rig.registered(p, "t1")
    rig.registered(p, "t2")
    rig.housekeeping_at(time.monotonic() + 6)  # past the 5 s heartbeat interval
    hbs = [m for m in rig.sent_to(p) if isinstance(m, protocol.Heartbeat)]
    assert hbs and sorted(hbs[-1].transfer_ids) == ["t1", "t2"]
    assert rig.counters()["heartbeats_sent"] >= 1


def test_dead_prefill_fails_its_requests_and_frees_blocks(rig: Rig) -> None:
    p = rig.stub()
    fut = rig.decode(p, "t1")
    rig.registered(p, "t1")
    rig.agent.raise_on("send_notif", TransferError(TransferKind.PEER_DEAD, "gone"))
    rig.housekeeping_at(time.monotonic() + 6)  # the heartbeat finds P dead
    rep = fut.result(1)
    assert rep.outcome == "failed" and rep.reason == "prefill_dead"
    assert rig.free() == D_POOL.num_blocks  # P is gone: nothing can land, nothing quarantined
    assert p.agent_name in rig.agent.removed


def test_gauges_published_by_the_owner(rig: Rig) -> None:
    p = rig.stub(hold=True)
    rig.decode(p, "t1")
    rig.decode(p, "t2")
    rig.step()
    assert rig.tm.snapshot().gauges["d_waiting"] == 2


def test_full_mode_handshake_when_configured(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(HandshakeMode.FULL)
    p = rig.stub()
    rig.decode(p, "t1")
    rig.registered(p, "t1")
    assert p.requests[0].mode == "full"
    assert np.asarray(rig.agent.prepped_remote[0].descs).shape[0] == 32 * 4

"""Component tests of P's PushWriter: real pool, telemetry, codec, push table, owner loop and
HandshakeManager (talking over real ZMQ to stub D peers); only the NIXL agent is faked
(``tests.support.fakes``).

Most tests drive the writer without its thread: they put items on its inboxes (or deliver NIXL
notifications to the fake agent) and run one owner pass at a time (``rig.step()``), so each step
is observable.
Handshake completion happens on the real handshake thread when the test releases a stub's reply;
tests wait for its effects with bounded waits, never on timing.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Unpack

import numpy as np
import pytest

from kvpush.config import EndpointConfig, HandshakeMode, Role, Timeouts
from kvpush.errors import ShuttingDownError
from kvpush.instruments import Instruments, WriterMode
from kvpush.memory.allocator import BlockState
from kvpush.memory.descriptors import xfer_indices
from kvpush.memory.pool import KvPool
from kvpush.peers.handshakes import HandshakeManager
from kvpush.prefill.acks import MAX_ATTEMPTS
from kvpush.prefill.table import Finished, PushOutcome, Registered, Registration, reg_key
from kvpush.prefill.writer import PushWriter
from kvpush.runtime.owner import OwnerThread, RankCrash
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import TransferError, TransferKind, XferState
from kvpush.wire import protocol
from kvpush.wire.notifs import Codec
from tests.support.fakes import (
    FakeAgent,
    StubOptions,
    StubPeer,
    decode_notif,
    fake_context,
    stub_pool,
    wait_until,
)

P_POOL = stub_pool(num_blocks=32, layers=2, block_bytes=64)


@dataclass
class Rig:
    agent: FakeAgent
    pool: KvPool
    tm: Telemetry
    hs: HandshakeManager
    writer: PushWriter
    owner: OwnerThread
    codec: Codec
    control: ThreadPoolExecutor
    stubs: list[StubPeer] = field(default_factory=list)

    # -- peers ------------------------------------------------------------------------------
    def stub(self, **kw: Unpack[StubOptions]) -> StubPeer:
        s = StubPeer(Role.DECODE, stub_pool(num_blocks=48), **kw)
        self.stubs.append(s)
        return s

    def connect(self, stub: StubPeer) -> None:
        """Full P->D handshake done before the test's push (a warm peer)."""
        self.hs.handshake_sync(stub.key, HandshakeMode.FULL, 5)

    # -- requests ---------------------------------------------------------------------------
    def finished(self, tid: str, n: int) -> Finished:
        ids = self.pool.allocator.allocate(tid, n)
        return Finished(tid, tid, tid, ids, time.monotonic())

    def reg(
        self,
        stub: StubPeer,
        tid: str,
        block_ids: list[int],
        *,
        request_id: str = "",
        groups: list[list[int]] | None = None,
    ) -> protocol.PushReg:
        return protocol.PushReg(
            request_id=request_id or tid,
            transfer_id=tid,
            decode_engine_id=stub.engine_id,
            decode_host=stub.key[0],
            decode_port=stub.key[1],
            local_block_ids=groups if groups is not None else [block_ids],
            remote_engine_id="p-test",
            remote_host="127.0.0.1",
            remote_port=1,
            decode_incarnation=stub.incarnation,
        )

    def registration(self, stub: StubPeer, reg: protocol.PushReg) -> Registration:
        return Registration(reg_key(reg), reg, stub.agent_name, time.monotonic())

    def register(self, r: Registration) -> None:
        """D's PUSH_REG arrives (a NIXL notification from its agent), for the next pass."""
        self.agent.deliver(r.sender, self.codec.encode(r.reg))

    def step(self) -> bool:
        """One pass of the writer's owner loop."""
        return self.owner.run_once()

    def notify_from(self, stub: StubPeer, msg: protocol.Notif) -> None:
        """A NIXL notification from D's agent, picked up by the writer's next pass."""
        self.agent.deliver(stub.agent_name, self.codec.encode(msg))

    def sent_to(self, stub: StubPeer) -> list[protocol.Notif]:
        return [decode_notif(m) for m in self.agent.sent_to(stub.agent_name)]

    def failures(self) -> dict[str, int]:
        return self.tm.snapshot().failures

    def counters(self) -> dict[str, int]:
        return self.tm.snapshot().counters

    def free(self) -> int:
        return self.pool.allocator.counts()["free"]


def _make_rig(
    mode: WriterMode = WriterMode.DEFERRED,
    coalesce: bool = True,
    on_outcome: Callable[[PushOutcome], None] | None = None,
) -> Rig:
    cfg = EndpointConfig(
        role=Role.PREFILL,
        engine_id="p-test",
        pool=P_POOL,
        timeouts=Timeouts(side_channel_s=5, handshake_s=5),
        coalesce=coalesce,
    )
    agent = FakeAgent(name="p-test#fake")
    ctx = fake_context(cfg, agent, Instruments(writer=mode))
    owner = OwnerThread("push-writer", cfg.agent)
    w = PushWriter(ctx, owner, on_outcome)
    owner.export_gauges(ctx.telemetry)
    # What the owner thread does before its first pass: tests run passes themselves.
    w.on_start()
    return Rig(agent, ctx.pool, ctx.telemetry, ctx.handshakes, w, owner, ctx.codec, ctx.control)


def _settled(hs: HandshakeManager) -> bool:
    return hs.counts()["connecting"] == 0


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(mode: WriterMode = WriterMode.DEFERRED) -> Rig:
        r = _make_rig(mode)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        close_rig(r)


def close_rig(r: Rig) -> None:
    """Stop a rig's writer, its stub peers and its handshakes (a fixture's teardown)."""
    if r.owner.alive:
        r.owner.stop(2)
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


def _passes_until(rig: Rig, pred: Callable[[], bool], what: str) -> None:
    """Run writer passes until ``pred`` holds (bounded). For handshakes that are not held: they
    may finish before or during the pass that started them, so no single step is guaranteed."""

    def step() -> bool:
        rig.step()
        return pred()

    wait_until(step, what=what)


def _pending_push(rig: Rig, tid: str = "t1", n: int = 3) -> tuple[StubPeer, Finished]:
    """A matched push whose P->D handshake is held by the stub; one _pass() done."""
    d = rig.stub(hold=True)
    f = rig.finished(tid, n)
    rig.writer.finished.put(f)
    rig.register(rig.registration(d, rig.reg(d, tid, [5, 6, 7][:n])))
    rig.owner.wake.clear()  # the puts woke it; the pass below is that wake-up
    rig.step()
    wait_until(d.got_request.is_set, what="the handshake request to reach D")
    return d, f


# ------------------------------------------------------------------ deferral (issue 2 tests)


def test_push_deferred_while_handshake_pending(rig: Rig) -> None:
    d, _ = _pending_push(rig)
    w = rig.writer
    assert rig.agent.count("post_write") == 0  # no WRITE
    assert len(w.deferred) == 0  # nothing queued yet
    assert not rig.owner.wake.is_set()  # and nobody woke the writer
    assert d.requests[0].mode == "full"  # P->D is a full handshake
    assert rig.tm.snapshot().gauges["deferred"] == 1
    # The writer is free: another pass returns at once and still writes nothing.
    rig.step()
    assert rig.agent.count("post_write") == 0
    assert rig.pool.allocator.state_of("t1") == BlockState.ALLOCATED


def test_handshake_completion_queues_wakes_and_writes_on_next_pass(rig: Rig) -> None:
    rig.agent.default_state = XferState.PROC
    d, f = _pending_push(rig)
    w = rig.writer
    d.release()
    wait_until(lambda: len(w.deferred) == 1, what="the deferred push")
    assert rig.owner.wake.is_set()
    assert rig.agent.count("post_write") == 0  # the callback only queues; the writer WRITEs

    rig.step()
    assert len(rig.agent.writes) == 1
    wr = rig.agent.writes[0]
    conn = rig.hs.get(d.key)
    assert conn is not None and wr.remote is conn.remote_dlist
    assert wr.local is w._legs.local_dlist
    np.testing.assert_array_equal(wr.local_idx, xfer_indices(f.block_ids, 32, P_POOL.regions))
    np.testing.assert_array_equal(
        wr.remote_idx, xfer_indices(np.array([5, 6, 7]), 48, P_POOL.regions)
    )
    done = decode_notif(wr.notif)
    assert isinstance(done, protocol.Completion)
    assert (done.request_id, done.transfer_id) == ("t1", "t1")
    assert done.nbytes == 3 * P_POOL.regions * P_POOL.block_bytes
    assert rig.pool.allocator.state_of("t1") == BlockState.INFLIGHT

    rig.agent.default_state = XferState.DONE
    rig.step()
    assert rig.free() == 32
    c = rig.counters()
    assert c["pushes_ok"] == 1 and c["bytes_pushed"] == done.nbytes
    assert rig.tm.snapshot().gauges["deferred"] == 0


def test_handshake_failure_drops_push_counted_blocks_released(rig: Rig) -> None:
    d = rig.stub(hold=True)
    for tid in ("a", "b"):  # two pushes wait on the same handshake
        rig.writer.finished.put(rig.finished(tid, 2))
        rig.register(rig.registration(d, rig.reg(d, tid, [1, 2])))
    rig.step()
    wait_until(d.got_request.is_set)
    assert len(d.requests) == 1  # joined, not started twice
    d.release(error="not_ready")
    wait_until(lambda: len(rig.writer.deferred) == 2)
    rig.step()
    assert rig.agent.count("post_write") == 0
    assert rig.free() == 32
    assert rig.failures()["handshake_failed"] == 2  # one per dropped push
    assert rig.counters()["handshakes_failed"] == 1  # one failed handshake
    assert rig.counters()["pushes_failed"] == 2
    assert rig.tm.snapshot().gauges["deferred"] == 0

    # A later push to the same peer starts a fresh handshake (failure is not sticky).
    d.hold = False
    rig.writer.finished.put(rig.finished("c", 1))
    rig.register(rig.registration(d, rig.reg(d, "c", [9])))
    _passes_until(rig, lambda: rig.agent.count("post_write") == 1, "the WRITE")
    assert len(d.requests) == 2


def test_writer_thread_drains_deferred_inbox(rig: Rig) -> None:
    d = rig.stub(hold=True)
    w = rig.writer
    w._legs.local_dlist = None
    rig.owner.start()  # the real thread from here on
    w.finished.put(rig.finished("t1", 2))
    rig.register(rig.registration(d, rig.reg(d, "t1", [3, 4])))
    wait_until(d.got_request.is_set)
    assert rig.agent.count("post_write") == 0
    d.release()
    wait_until(lambda: rig.counters().get("pushes_ok") == 1, what="the push to complete")
    assert rig.agent.count("post_write") == 1
    assert len(w.deferred) == 0
    rig.owner.stop(2)
    assert not rig.owner.alive and rig.owner.failure is None
    assert rig.free() == 32


def test_a_push_reg_that_came_since_the_last_pass_is_refused_by_ps_drain(rig: Rig) -> None:
    """P stops with a PUSH_REG in its notification queue that no pass has read yet: its drain
    reads it and refuses it by name with the stop's reason, before the request-less word it
    sends every connected D at its end (which a D that P never connected to does not get)."""
    d = rig.stub()
    rig.connect(d)
    rig.register(rig.registration(d, rig.reg(d, "late", [3])))
    rig.owner.stop(0)  # stopping (the rig's loop is stepped by hand: no thread to join)
    rig.writer.drain(time.monotonic() + 1)
    fails = [m for m in rig.sent_to(d) if isinstance(m, protocol.Failure)]
    assert [(m.request_id, m.reason) for m in fails] == [
        ("late", "shutting_down"),
        ("", "shutting_down"),
    ], fails
    assert rig.counters().get("push_regs_received") == 1


def test_a_failed_rank_ends_its_deferred_pushes_and_unread_push_regs_with_its_failure(
    rig: Rig,
) -> None:
    """The rank's loop died (``abort``): a push whose handshake answered just then and a
    PUSH_REG that no pass has read yet end with the rank's failure, as everything else it held
    does -- not with "shutting down", which would send an operator after whoever stopped P."""
    d, _ = _pending_push(rig)
    d.release()
    wait_until(lambda: len(rig.writer.deferred) == 1, what="the handshake's answer")
    rig.register(rig.registration(d, rig.reg(d, "late", [3])))
    rig.owner.stop(0)  # as the owner thread does when its loop raised, before it aborts
    rig.writer.abort(RankCrash("fault injection"))
    fails = [m for m in rig.sent_to(d) if isinstance(m, protocol.Failure)]
    assert [(m.request_id, m.reason) for m in fails] == [
        ("t1", "rank_failed"),
        ("late", "rank_failed"),
        ("", "rank_failed"),
    ], fails
    assert all("P rank 0 failed: RankCrash: fault injection" in m.detail for m in fails), fails


@pytest.mark.parametrize("broken", ["raises", "closed"])
def test_exception_in_callback_path_loses_nothing(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    d, _ = _pending_push(rig)
    w = rig.writer
    if broken == "raises":

        def put(item: object) -> None:
            raise RuntimeError("inbox exploded")

        monkeypatch.setattr(w.deferred, "put", put)
    else:
        w.deferred.close()  # e.g. the writer is stopping: put raises ShuttingDownError
        rig.owner.wake.clear()
    d.release()
    wait_until(rig.owner.wake.is_set, what="the callback's wake-up")
    rig.step()
    assert rig.agent.count("post_write") == 0
    assert rig.failures()["callback_error"] == 1
    assert rig.counters()["pushes_failed"] == 1
    assert rig.free() == 32
    # The handshake itself succeeded, so D is told at once instead of waiting for its deadline.
    (fail,) = rig.sent_to(d)
    assert isinstance(fail, protocol.Failure)
    assert fail.reason == "callback_error" and not fail.may_have_written
    exc_name = "RuntimeError" if broken == "raises" else ShuttingDownError.__name__
    assert exc_name in fail.detail


# ------------------------------------------------------------------ matching


@pytest.mark.parametrize("first", ["push_reg", "blocks"])
@pytest.mark.parametrize("warm", [True, False], ids=["connected", "handshaking"])
def test_both_arrival_orders_match_and_write_once(rig: Rig, first: str, warm: bool) -> None:
    d = rig.stub()
    if warm:
        rig.connect(d)
    reg = rig.reg(d, "t1", [10, 11])
    steps = [
        lambda: rig.notify_from(d, reg),  # PUSH_REG over NIXL, as D sends it
        lambda: rig.writer.finished.put(rig.finished("t1", 2)),
    ]
    if first == "blocks":
        steps.reverse()
    steps[0]()
    rig.step()
    assert rig.agent.count("post_write") == 0
    steps[1]()
    _passes_until(rig, lambda: rig.agent.count("post_write") == 1, "the WRITE")
    for _ in range(3):
        rig.step()
    assert rig.agent.count("post_write") == 1
    assert rig.counters()["pushes_ok"] == 1
    assert rig.counters()["push_regs_received"] == 1
    assert rig.free() == 32


def test_duplicate_registration_counted_and_written_once(rig: Rig) -> None:
    d = rig.stub()
    rig.connect(d)
    reg = rig.reg(d, "t1", [1])
    rig.notify_from(d, reg)
    rig.notify_from(d, reg)
    rig.step()
    rig.writer.finished.put(rig.finished("t1", 1))
    rig.step()
    assert rig.agent.count("post_write") == 1
    assert rig.failures()["duplicate_registration"] == 1


def test_block_count_mismatch_refused(rig: Rig) -> None:
    d = rig.stub()
    rig.connect(d)
    rig.writer.finished.put(rig.finished("t1", 3))
    rig.register(rig.registration(d, rig.reg(d, "t1", [1, 2])))
    rig.step()
    assert rig.agent.count("post_write") == 0  # never a misaligned (prefix) WRITE
    assert rig.failures()["block_count_mismatch"] == 1
    assert rig.free() == 32
    (fail,) = rig.sent_to(d)
    assert isinstance(fail, protocol.Failure)
    assert fail.reason == "block_count_mismatch" and not fail.may_have_written
    assert "P finished 3 blocks, D registered 2" in fail.detail


@pytest.mark.parametrize(
    "groups",
    [[[1], [2]], [[47, 48]]],
    ids=["two_groups", "outside_d_pool"],
)
def test_bad_registration_refused(rig: Rig, groups: list[list[int]]) -> None:
    d = rig.stub()
    rig.connect(d)
    n = len(groups[0])
    rig.writer.finished.put(rig.finished("t1", n))
    rig.register(rig.registration(d, rig.reg(d, "t1", [], groups=groups)))
    rig.step()
    assert rig.agent.count("post_write") == 0
    assert rig.failures()["bad_registration"] == 1
    assert rig.free() == 32


# ------------------------------------------------------------------ WRITE failures


def _post_one(rig: Rig, d: StubPeer, tid: str = "t1", request_id: str = "") -> None:
    rig.connect(d)
    rig.writer.finished.put(rig.finished(tid, 2))
    reg = rig.reg(d, tid, [20, 21], request_id=request_id)
    rig.register(rig.registration(d, reg))


def test_write_post_peer_dead_fails_push_and_evicts_peer(rig: Rig) -> None:
    d = rig.stub()
    rig.agent.raise_on(
        "post_write", TransferError(TransferKind.PEER_DEAD, "transfer: disconnected")
    )
    _post_one(rig, d)
    rig.step()
    assert rig.failures()["write_post_failed"] == 1
    assert rig.free() == 32  # nothing was posted: the blocks are free at once
    (fail,) = rig.sent_to(d)
    assert isinstance(fail, protocol.Failure) and fail.reason == "write_post_failed"
    assert not fail.may_have_written
    assert rig.hs.get(d.key) is None  # evicted
    assert d.agent_name in rig.agent.removed  # and its agent removed
    assert rig.counters()["peers_evicted"] == 1


@pytest.mark.parametrize("kind", [TransferKind.PEER_DEAD, TransferKind.BACKEND])
def test_write_error_while_polling(rig: Rig, kind: TransferKind) -> None:
    d = rig.stub()
    rig.agent.default_state = XferState.PROC
    _post_one(rig, d)
    rig.step()
    (wr,) = rig.agent.writes
    rig.agent.script_states(wr.xfer, TransferError(kind, "check_xfer_state: boom"))
    rig.step()
    assert wr.xfer.released
    if kind is TransferKind.PEER_DEAD:
        # Nothing can land any more: P's blocks are free, the peer is evicted.
        assert rig.failures()["peer_dead"] == 1
        assert rig.free() == 32
        assert rig.hs.get(d.key) is None
    else:
        # Bytes may still be moving: P's blocks wait for a fence; D is told so.
        assert rig.failures()["write_error"] == 1
        assert rig.pool.allocator.state_of("t1") == BlockState.QUARANTINED
        (fail,) = rig.sent_to(d)
        assert isinstance(fail, protocol.Failure) and fail.may_have_written


@pytest.mark.parametrize("how", ["timeout", "err_state"])
def test_abandoned_write_quarantines_then_fence_frees(rig: Rig, how: str) -> None:
    d = rig.stub()
    rig.agent.default_state = XferState.PROC
    _post_one(rig, d, tid="t1", request_id="req-1")
    rig.step()
    (wr,) = rig.agent.writes
    if how == "timeout":
        for infl in rig.writer.table.inflight():
            infl.deadline = 0.0  # its size-aware deadline has passed
    else:
        rig.agent.script_states(wr.xfer, XferState.ERR)
    rig.step()
    reason = "write_timeout" if how == "timeout" else "write_error"
    assert rig.failures()[reason] == 1
    assert rig.pool.allocator.state_of("t1") == BlockState.QUARANTINED
    assert wr.xfer.released
    (fail,) = rig.sent_to(d)
    assert isinstance(fail, protocol.Failure)
    assert fail.request_id == "req-1" and fail.may_have_written

    # Housekeeping posts the fence: a one-block WRITE to the same peer with a Fence notif.
    rig.agent.default_state = XferState.DONE
    rig.owner.force_housekeeping()
    rig.step()
    assert rig.counters()["fences_sent"] == 1
    fence_wr = rig.agent.writes[1]
    fence = decode_notif(fence_wr.notif)
    assert isinstance(fence, protocol.Fence)
    # D keys its quarantined requests by request id, not transfer id.
    assert fence.request_ids == ["req-1"]
    assert fence_wr.remote is wr.remote and len(fence_wr.remote_idx) == 1
    # One of D's blocks of the abandoned request, never a block another request may own.
    assert int(fence_wr.remote_idx[0]) in set(wr.remote_idx.tolist())
    rig.step()
    assert rig.counters()["fences_ok"] == 1
    assert rig.free() == 32


def test_write_timeouts_degrade_but_never_evict_so_the_fence_shares_their_connection(
    rig: Rig,
) -> None:
    """Timed-out WRITEs (a partitioned or frozen D) past the error limit: the peer is degraded,
    not evicted -- its agent stays, so the fence goes through the same connection as the bytes
    it must follow (an eviction would send it through a fresh one that can overtake them)."""
    d = rig.stub()
    rig.agent.default_state = XferState.PROC
    rig.connect(d)
    n = 4  # past the default limit of 3
    for i in range(n):
        rig.writer.finished.put(rig.finished(f"t{i}", 1))
        rig.register(rig.registration(d, rig.reg(d, f"t{i}", [20 + i], request_id=f"r{i}")))
    rig.step()
    assert len(rig.agent.writes) == n
    for infl in rig.writer.table.inflight():
        infl.deadline = 0.0
    rig.step()
    assert rig.failures()["write_timeout"] == n
    assert rig.counters()["transport_errors_write_timeout"] == n
    assert rig.counters()["peers_degraded"] == 1
    assert rig.counters().get("peers_evicted_transport", 0) == 0
    conn = rig.hs.get(d.key)
    assert conn is not None and not conn.evicted
    assert d.agent_name not in rig.agent.removed
    rig.agent.default_state = XferState.DONE
    rig.owner.force_housekeeping()
    rig.step()
    fence_wr = rig.agent.writes[n]
    assert isinstance(decode_notif(fence_wr.notif), protocol.Fence)
    assert fence_wr.remote is rig.agent.writes[0].remote  # the same loaded agent
    rig.step()
    assert rig.free() == 32


def test_a_fence_owed_to_a_replaced_d_incarnation_is_never_written_to_the_new_one(
    rig: Rig,
) -> None:
    """WRITEs that failed (bytes may still land) until P evicted the peer for transport errors,
    fences still owed; then D restarted at the same address. P's reconnection finds the new
    incarnation: the fences are dropped and P's blocks freed (nothing can land in a process
    that is gone), and no fence WRITE goes to the new D -- it would land on a block the new
    incarnation may have handed to another request."""
    d = rig.stub()
    rig.agent.default_state = XferState.PROC
    rig.connect(d)
    n = 3  # the default error limit: the third error evicts the peer
    for i in range(n):
        rig.writer.finished.put(rig.finished(f"t{i}", 1))
        rig.register(rig.registration(d, rig.reg(d, f"t{i}", [20 + i], request_id=f"r{i}")))
    rig.step()
    assert len(rig.agent.writes) == n
    for wr in rig.agent.writes:
        rig.agent.script_states(wr.xfer, TransferError(TransferKind.BACKEND, "check: boom"))
    rig.step()
    assert rig.failures()["write_error"] == n
    assert rig.hs.get(d.key) is None  # evicted for transport errors: maybe alive, fences owed
    assert all(rig.pool.allocator.state_of(f"t{i}") == BlockState.QUARANTINED for i in range(n))

    d.new_incarnation()  # D restarted at the same address
    rig.agent.default_state = XferState.DONE
    rig.owner.force_housekeeping()
    rig.step()  # the owed fences make P connect again: to the new incarnation

    def reconnected() -> bool:
        rig.owner.force_housekeeping()
        rig.step()
        conn = rig.hs.get(d.key)
        return conn is not None and conn.metadata.incarnation == d.incarnation

    wait_until(reconnected, what="P to connect to D's new incarnation")
    rig.owner.force_housekeeping()
    rig.step()
    assert len(rig.agent.writes) == n, "a fence of the old incarnation was written to the new one"
    assert rig.counters().get("fences_sent", 0) == 0
    assert rig.free() == 32  # the blocks of the replaced incarnation's WRITEs are free


# ------------------------------------------------------------------ cancel from D


def test_cancel_of_waiting_registration_acknowledged(rig: Rig) -> None:
    d = rig.stub()
    rig.connect(d)
    rig.notify_from(d, rig.reg(d, "t1", [1, 2], request_id="r1"))
    rig.step()
    rig.notify_from(d, protocol.Cancel(request_id="r1", transfer_id="t1"))
    rig.step()
    (ack,) = rig.sent_to(d)
    assert isinstance(ack, protocol.Failure)
    assert (ack.request_id, ack.reason, ack.may_have_written) == ("r1", "cancelled", False)
    assert rig.counters()["cancels_received"] == 1
    assert rig.tm.snapshot().gauges["regs_waiting_blocks"] == 0


def test_a_notification_that_finds_d_gone_evicts_it_after_the_pass(rig: Rig) -> None:
    """NIXL says D's agent is gone when P acknowledges its cancel: the peer is evicted (its
    agent removed) by the end of the pass, not left degraded until some WRITE fails too."""
    d = rig.stub()
    rig.connect(d)
    rig.notify_from(d, rig.reg(d, "t1", [1, 2], request_id="r1"))
    rig.step()
    rig.agent.raise_on("send_notif", TransferError(TransferKind.PEER_DEAD, "send_notif: gone"))
    rig.notify_from(d, protocol.Cancel(request_id="r1", transfer_id="t1"))
    rig.step()
    assert rig.hs.get(d.key) is None
    assert d.agent_name in rig.agent.removed
    assert rig.counters()["peers_evicted"] == 1


def _cancel_from_unconnected(rig: Rig, d: StubPeer, rid: str) -> None:
    """D's Cancel of a request P does not know, from a D rank P holds no connection to."""
    rig.notify_from(
        d,
        protocol.Cancel(
            request_id=rid,
            transfer_id=rid,
            decode_host="127.0.0.1",
            decode_port=d.key[1],
            decode_tp_rank=0,
        ),
    )


def _stepped(rig: Rig, cond: bool) -> bool:
    """One pass of the writer, then whether ``cond`` (read before it) held."""
    rig.step()
    return cond


def _acks_to(rig: Rig, d: StubPeer) -> list[protocol.Failure]:
    return [m for m in rig.sent_to(d) if isinstance(m, protocol.Failure)]


def test_cancel_ack_to_an_unconnected_d_is_retried_until_a_handshake_succeeds(
    rig: Rig,
) -> None:
    """A failed handshake does not drop the acknowledgement: D's blocks would stay
    quarantined for as long as P lives. It is owed and tried again with a back-off."""
    d = rig.stub(error="not_ready")  # D refuses handshakes (e.g. busy starting)
    _cancel_from_unconnected(rig, d, "r9")
    acks = rig.writer._out.acks
    wait_until(lambda: _stepped(rig, len(d.requests) >= 1 and not acks._pending), what="1st")
    assert acks.n_owed == 1 and not _acks_to(rig, d)
    d.error = None  # D is up now
    acks.retry(time.monotonic() + 60)  # its back-off is over
    wait_until(lambda: _stepped(rig, bool(_acks_to(rig, d))), what="the acknowledgement")
    (ack,) = _acks_to(rig, d)
    assert (ack.request_id, ack.reason, ack.may_have_written) == ("r9", "cancelled", False)
    assert acks.n_owed == 0
    assert rig.failures().get("cancel_unacknowledged", 0) == 0


def test_cancel_ack_given_up_after_its_attempts_is_counted(rig: Rig) -> None:
    d = rig.stub(error="not_ready")
    _cancel_from_unconnected(rig, d, "r9")
    acks = rig.writer._out.acks
    for i in range(1, MAX_ATTEMPTS + 1):

        def tried(n: int = i) -> bool:
            return _stepped(rig, len(d.requests) >= n and not acks._pending)

        wait_until(tried, what=f"handshake {i}")
        acks.retry(time.monotonic() + 60)
    assert acks.n_owed == 0
    assert rig.failures()["cancel_unacknowledged"] == 1
    assert not _acks_to(rig, d)


def test_cancel_while_handshaking_acknowledged_without_write(rig: Rig) -> None:
    d, _ = _pending_push(rig)
    rig.notify_from(d, protocol.Cancel(request_id="t1", transfer_id="t1"))
    rig.step()
    d.release()
    wait_until(lambda: len(rig.writer.deferred) == 1)
    rig.step()
    assert rig.agent.count("post_write") == 0
    assert rig.free() == 32
    (ack,) = rig.sent_to(d)
    assert isinstance(ack, protocol.Failure)
    assert ack.reason == "cancelled" and not ack.may_have_written


def test_cancel_while_a_failing_handshake_is_acknowledged_once_d_answers(rig: Rig) -> None:
    """The handshake under way when D cancelled fails: the acknowledgement is owed (to the
    address in D's PUSH_REG) and sent once a later handshake succeeds -- not dropped, which
    left D's blocks quarantined for as long as P lived (the fault soak)."""
    d, _ = _pending_push(rig)
    rig.notify_from(d, protocol.Cancel(request_id="t1", transfer_id="t1"))
    rig.step()
    d.release(error="not_ready")  # the held handshake is answered with an error
    wait_until(lambda: _stepped(rig, rig.writer._out.acks.n_owed == 1), what="an owed ack")
    assert not _acks_to(rig, d) and rig.free() == 32
    d.hold = False  # D answers handshakes now: the ack's own handshake, held, too
    d.release()
    wait_until(lambda: _stepped(rig, bool(_acks_to(rig, d))), what="the acknowledgement")
    (ack,) = _acks_to(rig, d)
    assert ack.reason == "cancelled" and not ack.may_have_written
    assert rig.agent.count("post_write") == 0


def test_cancel_of_unknown_transfer_is_acknowledged_but_cannot_drop_a_later_one(
    rig: Rig,
) -> None:
    d = rig.stub()
    rig.connect(d)
    rig.notify_from(d, protocol.Cancel(request_id="t9", transfer_id="t9"))
    rig.step()
    (ack,) = rig.sent_to(d)
    assert isinstance(ack, protocol.Failure) and not ack.may_have_written
    # A Cancel for a transfer P never saw must not poison that id: a later, real transfer
    # with it is pushed normally (otherwise anyone could cancel requests in advance).
    rig.writer.finished.put(rig.finished("t9", 2))
    rig.notify_from(d, rig.reg(d, "t9", [1, 2]))
    rig.step()
    assert rig.agent.count("post_write") == 1


def test_cancel_from_another_agent_than_the_registration_is_forged(rig: Rig) -> None:
    d, other = rig.stub(), rig.stub()
    rig.connect(d)
    rig.connect(other)
    rig.notify_from(d, rig.reg(d, "t5", [1]))
    rig.step()
    rig.notify_from(other, protocol.Cancel(request_id="t5", transfer_id="t5"))
    rig.step()
    assert rig.tm.snapshot().failures.get("forged_notif") == 1
    rig.writer.finished.put(rig.finished("t5", 1))
    rig.step()
    assert rig.agent.count("post_write") == 1  # the real registration still gets its push


def test_cancel_during_write_leaves_it_to_the_completion(rig: Rig) -> None:
    d = rig.stub()
    rig.agent.default_state = XferState.PROC
    _post_one(rig, d)
    rig.step()
    rig.notify_from(d, protocol.Cancel(request_id="t1", transfer_id="t1"))
    rig.step()
    assert rig.sent_to(d) == []  # no "nothing was written" ack: bytes are moving
    rig.agent.default_state = XferState.DONE
    rig.step()
    assert rig.free() == 32  # the WRITE's own completion notif tells D


def test_cancel_before_p_ever_connected_is_still_acknowledged(rig: Rig) -> None:
    d = rig.stub()  # answers handshakes, but P has none with it yet
    rig.notify_from(d, rig.reg(d, "t1", [1], request_id="r1"))
    rig.step()
    # The Cancel carries D's side-channel address: P handshakes there to acknowledge.
    rig.notify_from(
        d,
        protocol.Cancel(
            request_id="r1", transfer_id="t1", decode_host=d.key[0], decode_port=d.key[1]
        ),
    )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not rig.sent_to(d):
        rig.step()
        time.sleep(0.005)
    acks = [m for m in rig.sent_to(d) if isinstance(m, protocol.Failure)]
    assert acks and acks[0].reason == "cancelled" and not acks[0].may_have_written


# ------------------------------------------------------------------ writer modes


def _slow_and_healthy(rig: Rig) -> tuple[StubPeer, StubPeer]:
    """Push 1 goes to a new D whose handshake hangs; push 2 to a connected, healthy D."""
    slow, healthy = rig.stub(hold=True), rig.stub()
    rig.connect(healthy)
    w = rig.writer
    w.finished.put(rig.finished("slow", 1))
    w.finished.put(rig.finished("fast", 1))
    rig.register(rig.registration(slow, rig.reg(slow, "slow", [1])))
    rig.register(rig.registration(healthy, rig.reg(healthy, "fast", [1])))
    return slow, healthy


def test_blocking_mode_waits_on_the_handshake(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(WriterMode.BLOCKING)
    slow, healthy = _slow_and_healthy(rig)
    t = threading.Thread(target=rig.step, daemon=True)
    t.start()
    wait_until(slow.got_request.is_set)
    # The head-of-line baseline: the writer sits in the handshake; the healthy push waits.
    assert t.is_alive()
    assert rig.agent.count("post_write") == 0
    slow.release()
    t.join(10)
    assert not t.is_alive()
    assert len(rig.agent.writes) == 2
    conn_slow = rig.hs.get(slow.key)
    assert conn_slow is not None and rig.agent.writes[0].remote is conn_slow.remote_dlist
    assert len(rig.writer.deferred) == 0  # no deferral in this mode
    del healthy


def test_deferred_mode_writes_healthy_peer_while_another_handshakes(rig: Rig) -> None:
    slow, healthy = _slow_and_healthy(rig)
    rig.step()  # returns although the slow handshake hangs
    wait_until(slow.got_request.is_set)
    (wr,) = rig.agent.writes
    conn_h = rig.hs.get(healthy.key)
    assert conn_h is not None and wr.remote is conn_h.remote_dlist
    slow.release()
    wait_until(lambda: len(rig.writer.deferred) == 1)
    rig.step()
    assert len(rig.agent.writes) == 2


# ------------------------------------------------------------------ peers and robustness


def test_new_incarnation_of_d_is_rehandshaken(rig: Rig) -> None:
    d = rig.stub()
    rig.connect(d)
    old_name = d.agent_name
    d.new_incarnation()  # D restarted at the same address with a fresh agent name
    rig.writer.finished.put(rig.finished("t1", 1))
    rig.register(rig.registration(d, rig.reg(d, "t1", [0])))
    rig.step()
    assert old_name in rig.agent.removed  # old agent removed before the new one is loaded
    _passes_until(rig, lambda: rig.agent.count("post_write") == 1, "the WRITE")
    conn = rig.hs.get(d.key)
    assert conn is not None and conn.agent_name == d.agent_name
    (wr,) = rig.agent.writes
    assert wr.remote is conn.remote_dlist


def test_lease_expiry_frees_finished_blocks(rig: Rig) -> None:
    rig.writer.finished.put(rig.finished("t1", 4))
    rig.step()
    assert rig.free() == 28
    rig.writer.housekeeping(time.monotonic() + rig.writer.cfg.timeouts.lease_s + 1)
    assert rig.free() == 32
    assert rig.failures()["lease_expired"] == 1


def test_bad_notifications_are_counted_and_the_writer_keeps_going(rig: Rig) -> None:
    d = rig.stub()
    rig.connect(d)
    rig.agent.deliver(d.agent_name, b"garbage")
    rig.agent.deliver(d.agent_name, b"PUSH_REG:" + b"\x81\xa1x" + b"\x91" * 30_000 + b"\x00")
    rig.agent.deliver(d.agent_name, b"x" * (protocol.MAX_NOTIF_BYTES + 1))
    rig.notify_from(d, rig.reg(d, "t1", [1]))
    rig.writer.finished.put(rig.finished("t1", 1))
    rig.step()
    assert rig.failures()["malformed_notif"] == 3
    assert rig.agent.count("post_write") == 1


def test_unexpected_notification_kind_counted(rig: Rig) -> None:
    d = rig.stub()
    rig.notify_from(d, protocol.Completion(request_id="x"))
    rig.step()
    assert rig.failures()["unexpected_notif"] == 1


def test_heartbeat_renews_lease(rig: Rig) -> None:
    d = rig.stub()
    rig.writer.finished.put(rig.finished("t1", 1))
    rig.step()
    rig.notify_from(d, protocol.Heartbeat(transfer_ids=["t1", "unknown"]))
    rig.step()
    assert rig.counters()["heartbeats_received"] == 1


def test_registrations_over_the_cap_are_refused_and_counted(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvpush.prefill.writer.MAX_PENDING_REGISTRATIONS", 2)
    d = rig.stub()
    rig.connect(d)
    for tid in ("a", "b", "c"):
        rig.notify_from(d, rig.reg(d, tid, [1]))
    rig.step()
    assert rig.writer.table.count(Registered) == 2 and rig.writer.table.get("c") is None
    assert rig.failures()["too_many_registrations"] == 1
    rig.writer.finished.put(rig.finished("a", 1))  # the two held still match their blocks
    rig.step()
    assert rig.writer.table.count(Registered) == 1

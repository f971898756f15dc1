"""Component tests of coalescing in P's writer (issue 30): real pool, telemetry, codec, push table,
owner loop and handshakes over real ZMQ to stub D peers; only the NIXL agent is faked. Each test
runs the writer's passes itself (``rig.step()``), so what one pass posts is observable.

Pushes matched for the same D rank in one pass go as one WRITE (descriptor lists concatenated)
with one ``Completions`` naming them all -- when D's PUSH_REGs say it takes them; a fence, a
cancel and a failed batch stay exact per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest

from kvpush.memory.allocator import BlockState
from kvpush.memory.descriptors import xfer_index_list
from kvpush.prefill.coalesce import MAX_MEMBERS
from kvpush.transport.agent import TransferError, TransferKind, XferState
from kvpush.wire import protocol
from tests.component.test_writer import P_POOL, Rig, _make_rig, close_rig
from tests.support.fakes import StubPeer, decode_notif

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(coalesce: bool = True) -> Rig:
        r = _make_rig(coalesce=coalesce)  # ``tests.component.test_writer``'s rig
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        close_rig(r)


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:
    return make_rig()


def _ready(
    rig: Rig, d: StubPeer, n: int, *, batch_done: bool = True, first: int = 0
) -> list[list[int]]:
    """``n`` pushes of one block each to ``d`` (connected), finished and registered so that the
    next pass matches them all. Returns D's block ids of each, in order."""
    rig.connect(d)
    d_ids = []
    for i in range(first, first + n):
        tid = f"t{i}"
        rig.writer.finished.put(rig.finished(tid, 1))
        ids = [i]
        reg = rig.reg(d, tid, ids, request_id=f"req-{i}")
        reg = msgspec.structs.replace(reg, batch_done=batch_done)
        rig.register(rig.registration(d, reg))
        d_ids.append(ids)
    return d_ids


def _remote_idx(d: StubPeer, ids: list[int]) -> list[int]:
    """D's descriptor indices of a push, as a WRITE of its own names them."""
    md = d.metadata_of(0)
    return list(xfer_index_list(ids, md.num_blocks, md.regions))


def test_pushes_ready_in_one_pass_go_as_one_write_with_one_notification(rig: Rig) -> None:
    d = rig.stub()
    d_ids = _ready(rig, d, 5)
    rig.step()
    (wr,) = rig.agent.writes
    # The five pushes' descriptors, every one of them once, ordered by P's local index.
    want = [i for ids in d_ids for i in _remote_idx(d, ids)]
    assert sorted(wr.remote_idx.tolist()) == sorted(want)
    local = np.asarray(wr.local_idx).tolist()
    assert len(local) == len(want) and local == sorted(local)
    note = decode_notif(wr.notif)
    assert isinstance(note, protocol.Completions)
    assert [x.request_id for x in note.done] == [f"req-{i}" for i in range(5)]
    assert [x.transfer_id for x in note.done] == [f"t{i}" for i in range(5)]
    geom = P_POOL  # one block of every region, as a single Completion would say
    assert all(x.nbytes == geom.regions * geom.block_bytes for x in note.done)
    rig.step()  # DONE: every member ends ok, its blocks back
    assert rig.counters()["pushes_ok"] == 5
    assert rig.free() == 32
    assert wr.xfer.released


def test_a_batch_gives_every_members_blocks_back_before_any_is_reported() -> None:
    """The pushes a WRITE ended ok give their blocks back together (``release_many``), and
    whoever waits for one of them finds them all free: no outcome is out before the blocks."""
    seen: list[tuple[str, bool, int]] = []
    holder: list[Rig] = []
    rig = _make_rig(on_outcome=lambda o: seen.append((o.transfer_id, o.ok, holder[0].free())))
    holder.append(rig)
    try:
        d = rig.stub()
        _ready(rig, d, 5)
        rig.step()
        rig.step()  # DONE
        assert seen == [(f"t{i}", True, 32) for i in range(5)]
        assert rig.counters()["pushes_ok"] == 5
    finally:
        close_rig(rig)


def test_a_d_that_does_not_take_completions_gets_one_write_each(rig: Rig) -> None:
    """An older D (no ``batch_done`` in its PUSH_REG): single WRITEs with single Completions,
    byte for byte what it got before coalescing existed."""
    d = rig.stub()
    _ready(rig, d, 3, batch_done=False)
    rig.step()
    assert len(rig.agent.writes) == 3
    notes = [decode_notif(w.notif) for w in rig.agent.writes]
    assert all(isinstance(n, protocol.Completion) for n in notes)
    assert [n.request_id for n in notes if isinstance(n, protocol.Completion)] == [
        "req-0",
        "req-1",
        "req-2",
    ]


def test_coalescing_off_posts_one_write_each(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(coalesce=False)
    d = rig.stub()
    _ready(rig, d, 3)
    rig.step()
    assert len(rig.agent.writes) == 3
    assert all(isinstance(decode_notif(w.notif), protocol.Completion) for w in rig.agent.writes)


def test_one_ready_push_goes_alone_with_its_own_completion(rig: Rig) -> None:
    d = rig.stub()
    _ready(rig, d, 1)
    rig.step()
    (wr,) = rig.agent.writes
    note = decode_notif(wr.notif)
    assert isinstance(note, protocol.Completion) and note.request_id == "req-0"


def test_each_d_rank_gets_its_own_write(rig: Rig) -> None:
    d1, d2 = rig.stub(), rig.stub()
    _ready(rig, d1, 2)
    _ready(rig, d2, 3, first=10)
    rig.step()
    assert len(rig.agent.writes) == 2
    notes = [decode_notif(w.notif) for w in rig.agent.writes]
    names = sorted(
        [x.request_id for x in n.done] for n in notes if isinstance(n, protocol.Completions)
    )
    assert names == [["req-0", "req-1"], ["req-10", "req-11", "req-12"]]


def test_a_batch_never_names_more_than_its_cap(rig: Rig) -> None:
    """More ready pushes than a batch may carry: cut into several WRITEs, none lost."""
    d = rig.stub()
    n = 30  # P's pool has 32 blocks
    _ready(rig, d, n)
    rig.step()
    named = []
    for w in rig.agent.writes:
        note = decode_notif(w.notif)
        names = (
            [x.request_id for x in note.done]
            if isinstance(note, protocol.Completions)
            else [note.request_id]
            if isinstance(note, protocol.Completion)
            else []
        )
        assert len(names) <= MAX_MEMBERS
        named += names
    assert named == [f"req-{i}" for i in range(n)]


def test_a_failed_post_fails_every_member_and_nothing_is_quarantined(rig: Rig) -> None:
    d = rig.stub()
    rig.agent.raise_on("post_write", TransferError(TransferKind.BACKEND, "transfer: boom"))
    _ready(rig, d, 4)
    rig.step()
    assert rig.failures()["write_post_failed"] == 4
    assert rig.free() == 32  # nothing was posted: every member's blocks are free at once
    fails = [m for m in rig.sent_to(d) if isinstance(m, protocol.Failure)]
    assert sorted(f.request_id for f in fails) == [f"req-{i}" for i in range(4)]
    assert not any(f.may_have_written for f in fails)


@pytest.mark.parametrize("how", ["err_state", "timeout"])
def test_a_failed_batch_fails_each_member_and_one_fence_frees_them(rig: Rig, how: str) -> None:
    d = rig.stub()
    rig.agent.default_state = XferState.PROC
    _ready(rig, d, 3)
    rig.step()
    (wr,) = rig.agent.writes
    if how == "timeout":
        for infl in rig.writer.table.inflight():
            infl.deadline = 0.0
    else:
        rig.agent.script_states(wr.xfer, XferState.ERR)
    rig.step()
    reason = "write_timeout" if how == "timeout" else "write_error"
    assert rig.failures()[reason] == 3
    assert wr.xfer.released
    for i in range(3):
        assert rig.pool.allocator.state_of(f"t{i}") == BlockState.QUARANTINED
    fails = [m for m in rig.sent_to(d) if isinstance(m, protocol.Failure)]
    assert sorted(f.request_id for f in fails) == ["req-0", "req-1", "req-2"]
    assert all(f.may_have_written for f in fails)
    # Housekeeping fences them: the fence names every member's request.
    rig.agent.default_state = XferState.DONE
    rig.owner.force_housekeeping()
    rig.step()
    fence = decode_notif(rig.agent.writes[-1].notif)
    assert isinstance(fence, protocol.Fence)
    assert sorted(fence.request_ids) == ["req-0", "req-1", "req-2"]
    rig.step()
    assert rig.counters()["fences_ok"] == 1
    assert rig.free() == 32


def test_peer_dead_while_polling_a_batch_frees_every_member(rig: Rig) -> None:
    d = rig.stub()
    rig.agent.default_state = XferState.PROC
    _ready(rig, d, 3)
    rig.step()
    (wr,) = rig.agent.writes
    rig.agent.script_states(wr.xfer, TransferError(TransferKind.PEER_DEAD, "gone"))
    rig.step()
    assert rig.failures()["peer_dead"] == 3
    assert rig.free() == 32
    assert rig.hs.get(d.key) is None


def test_a_cancel_in_the_same_pass_sees_its_push_posted_and_leaves_it_to_the_completion(
    rig: Rig,
) -> None:
    """D cancels one member in the pass that matched it: the cancel comes after the WRITE was
    posted (as without coalescing), so its completion tells D when the bytes landed."""
    d = rig.stub()
    rig.agent.default_state = XferState.PROC
    _ready(rig, d, 3)
    rig.notify_from(d, protocol.Cancel(request_id="req-1", transfer_id="t1", decode_host=d.key[0]))
    rig.step()
    (wr,) = rig.agent.writes  # posted before the cancel was handled
    note = decode_notif(wr.notif)
    assert isinstance(note, protocol.Completions)
    assert [x.request_id for x in note.done] == ["req-0", "req-1", "req-2"]
    assert not [m for m in rig.sent_to(d) if isinstance(m, protocol.Failure)]  # no early ack
    rig.agent.default_state = XferState.DONE
    rig.step()
    assert rig.counters()["pushes_ok"] == 3
    assert rig.free() == 32


def test_a_cancel_before_the_blocks_matched_is_not_batched(rig: Rig) -> None:
    """A member cancelled before its blocks met the registration never reaches a batch; the
    others still go together."""
    d = rig.stub()
    rig.connect(d)
    for i in range(3):
        reg = rig.reg(d, f"t{i}", [i], request_id=f"req-{i}")
        reg = msgspec.structs.replace(reg, batch_done=True)
        rig.register(rig.registration(d, reg))
    rig.notify_from(d, protocol.Cancel(request_id="req-1", transfer_id="t1", decode_host=d.key[0]))
    rig.step()  # registrations (and the cancel) in; no blocks yet
    for i in range(3):
        rig.writer.finished.put(rig.finished(f"t{i}", 1))
    rig.step()
    (wr,) = rig.agent.writes
    note = decode_notif(wr.notif)
    assert isinstance(note, protocol.Completions)
    assert [x.request_id for x in note.done] == ["req-0", "req-2"]
    rig.step()
    assert rig.free() == 32  # the cancelled one's blocks went back when they finished

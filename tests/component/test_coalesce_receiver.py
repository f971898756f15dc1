"""Component tests of D's side of coalescing (issue 30): its PUSH_REGs say it takes
``Completions`` (unless ``--no-coalesce``), and one ``Completions`` completes each request it
names exactly as a ``Completion`` of its own would: verified, late ones settled, unknown ones
counted, another agent's refused. Real pool, telemetry, codec, owner loop and handshakes over
real ZMQ to stub P peers; only the NIXL agent is faked.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvpush.memory.allocator import BlockState
from kvpush.wire import protocol
from tests.component.test_receiver import D_POOL, Rig

pytestmark = pytest.mark.timeout(120)


def _done(*rids: str) -> protocol.Completions:
    return protocol.Completions(
        done=[protocol.Done(request_id=r, transfer_id=r, nbytes=0) for r in rids]
    )


@pytest.mark.parametrize("coalesce", [True, False])
def test_push_reg_says_whether_d_takes_completions(
    make_d_rig: Callable[..., Rig], coalesce: bool
) -> None:
    rig = make_d_rig(coalesce)
    p = rig.stub()
    rig.decode(p, "t1")
    assert rig.registered(p, "t1").batch_done is coalesce


def test_one_completions_completes_every_request_it_names_verified(
    make_d_rig: Callable[..., Rig],
) -> None:
    rig = make_d_rig()
    p = rig.stub()
    futs = {t: rig.decode(p, t, n=2) for t in ("t1", "t2", "t3")}
    for t in futs:
        rig.registered(p, t)
        rig.land(t)
    rig.from_p(p, _done("t1", "t2", "t3"))
    for t, fut in futs.items():
        rep = rig.result(fut)
        assert rep.outcome == "ok" and rep.verified is True, (t, rep)
        assert rep.nbytes == 2 * D_POOL.regions * D_POOL.block_bytes
    assert rig.counters()["requests_ok"] == 3
    assert rig.free() == D_POOL.num_blocks


def test_a_member_whose_bytes_are_wrong_fails_alone(make_d_rig: Callable[..., Rig]) -> None:
    rig = make_d_rig()
    p = rig.stub()
    good, bad = rig.decode(p, "t1", n=2), rig.decode(p, "t2", n=2)
    rig.registered(p, "t1")
    rig.registered(p, "t2")
    rig.land("t1")  # t2's bytes never landed
    rig.from_p(p, _done("t1", "t2"))
    assert rig.result(good).outcome == "ok"
    rep = rig.result(bad)
    assert rep.outcome == "failed" and rep.verified is False


def test_a_batch_settles_an_abandoned_member_and_counts_an_unknown_one(
    make_d_rig: Callable[..., Rig],
) -> None:
    rig = make_d_rig()
    p = rig.stub()
    gone = rig.decode(p, "t1", deadline_s=30)
    live = rig.decode(p, "t2", deadline_s=300)
    rig.registered(p, "t1")
    rig.registered(p, "t2")
    rig.role.receiver.housekeeping(time.monotonic() + 31)  # t1 abandoned, quarantined
    assert gone.result(1).reason == "deadline"
    assert rig.pool.allocator.state_of("t1") == BlockState.QUARANTINED
    rig.land("t2")
    rig.from_p(p, _done("t1", "nobody", "t2"))
    assert rig.result(live).outcome == "ok"
    rig.steps_until(lambda: rig.free() == D_POOL.num_blocks, "t1's late completion")
    assert rig.failures()["unknown_completion"] == 1


def test_a_batch_from_another_agent_completes_nothing(make_d_rig: Callable[..., Rig]) -> None:
    rig = make_d_rig()
    p = rig.stub()
    fut = rig.decode(p, "t1")
    rig.registered(p, "t1")
    rig.from_p(p, _done("t1"), sender="mallory")
    rig.step()
    assert not fut.done()
    assert rig.failures()["forged_notif"] == 1


def test_a_batch_naming_a_request_twice_completes_it_once(make_d_rig: Callable[..., Rig]) -> None:
    rig = make_d_rig()
    p = rig.stub()
    fut = rig.decode(p, "t1")
    rig.registered(p, "t1")
    rig.land("t1")
    rig.from_p(p, _done("t1", "t1"))
    assert rig.result(fut).outcome == "ok"
    assert rig.counters()["requests_ok"] == 1


def test_a_batch_with_nothing_to_read_frees_every_member_before_any_answer(
    make_d_rig: Callable[..., Rig],
) -> None:
    """Verification off: the requests one ``Completions`` ends give their blocks back in one
    pass (``Completer.submit_many``), and whoever is answered finds all of them free."""
    rig = make_d_rig()
    rig.role.completer.verify = False
    p = rig.stub()
    seen: list[int] = []
    futs = [rig.decode(p, t, n=2) for t in ("t1", "t2", "t3")]
    for t, fut in zip(("t1", "t2", "t3"), futs, strict=True):
        fut.add_done_callback(lambda _: seen.append(rig.free()))
        rig.registered(p, t)
    rig.from_p(p, _done("t1", "t2", "t3"))
    for fut in futs:
        rep = rig.result(fut)
        assert rep.outcome == "ok" and rep.verified is None
    assert seen == [D_POOL.num_blocks] * 3
    assert rig.counters()["requests_ok"] == 3


def test_a_batch_answered_together_is_counted_and_timed_as_each_alone(
    make_d_rig: Callable[..., Rig],
) -> None:
    """The requests one ``Completions`` ends with nothing to read are answered together
    (``Completer._answer_ok``): each answer ok with its own latency, bytes and stamps in
    order, every one counted before any answer is out, each latency and step in the
    histograms."""
    rig = make_d_rig()
    rig.role.completer.verify = False
    p = rig.stub()
    counted: list[int] = []
    tids = ("t1", "t2", "t3")
    futs = [rig.decode(p, t, n=2) for t in tids]
    for t, fut in zip(tids, futs, strict=True):
        fut.add_done_callback(lambda _: counted.append(rig.counters()["requests_ok"]))
        rig.registered(p, t)
    rig.from_p(p, _done(*tids))
    reps = [rig.result(f) for f in futs]
    assert [(r.transfer_id, r.outcome) for r in reps] == [(t, "ok") for t in tids]
    assert counted == [3, 3, 3]
    per = 2 * D_POOL.bytes_per_block_all_regions
    assert all(r.nbytes == per and r.latency_s > 0 for r in reps)
    assert all(r.phases["answered"] >= r.phases["completion_received"] for r in reps)
    snap = rig.role.ctx.telemetry.snapshot()
    assert snap.counters["bytes_received"] == 3 * per
    assert snap.histograms["decode_latency"].count == 3
    assert snap.histograms["phase_push_wait"].count == 3

"""Component tests of D's batched PUSH_REGs (issue 30, ``kvpush.decode.registrar``): the
registrations of one owner pass bound for a P that takes them go as one ``PushRegs``, in order;
a single one, a P that does not take them (older kvpush, vLLM, ``--no-coalesce``) and a D run
with ``--no-coalesce`` send one ``PushReg`` each, as before; a request cancelled before its
registration went out is never registered (P hears nothing, its blocks are free at once); a
batch whose send fails sends each of its requests down the single send's failure path. Real
pool, telemetry, codec, owner loop and handshakes over real ZMQ to stub P peers; only the NIXL
agent is faked.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from kvpush.transport.agent import TransferError, TransferKind
from kvpush.wire import protocol
from tests.component.test_receiver import D_POOL, Rig
from tests.support.fakes import StubPeer, wait_until

pytestmark = pytest.mark.timeout(120)


def _p(rig: Rig, takes: bool = True) -> StubPeer:
    """A stub P whose metadata says whether it takes ``PushRegs``, already connected (its
    first request registered and answered), so that later requests need no handshake."""
    p = rig.stub()
    p.metadata = msgspec.structs.replace(p.metadata, takes_push_regs=takes)
    fut = rig.decode(p, "first")
    rig.registered(p, "first")
    rig.from_p(p, protocol.Completion(request_id="first", transfer_id="first"))
    rig.pool.fill("first", rig.pool.allocator.blocks_of("first"))
    assert rig.result(fut).outcome == "ok"
    return p


def _regs(rig: Rig, p: StubPeer) -> list[tuple[str, list[str]]]:
    """What D sent P after its first request: each notification's kind and transfer ids."""
    out: list[tuple[str, list[str]]] = []
    for m in rig.sent_to(p):
        if isinstance(m, protocol.PushRegs):
            out.append(("batch", [r.transfer_id for r in m.expand()]))
        elif isinstance(m, protocol.PushReg) and m.transfer_id != "first":
            out.append(("single", [m.transfer_id]))
    return out


def test_one_pass_of_registrations_goes_as_one_push_regs_in_order(
    make_d_rig: Callable[..., Rig],
) -> None:
    rig = make_d_rig()
    p = _p(rig)
    futs = {t: rig.decode(p, t) for t in ("t1", "t2", "t3", "t4")}
    rig.step()  # one pass: all four taken, registered together
    assert _regs(rig, p) == [("batch", ["t1", "t2", "t3", "t4"])]
    batch = next(m for m in rig.sent_to(p) if isinstance(m, protocol.PushRegs))
    alone = rig.registered(p, "first")
    for r in batch.expand():  # each registration exactly as its own PushReg would be
        ids = [rig.pool.allocator.blocks_of(r.request_id).tolist()]
        assert r == msgspec.structs.replace(
            alone, request_id=r.request_id, transfer_id=r.transfer_id, local_block_ids=ids
        )
    assert rig.counters()["push_regs_sent"] == 5
    for t in futs:
        rig.pool.fill(t, rig.pool.allocator.blocks_of(t))
    rig.from_p(
        p,
        protocol.Completions(done=[protocol.Done(request_id=t, transfer_id=t) for t in futs]),
    )
    for fut in futs.values():
        assert rig.result(fut).outcome == "ok"
    assert rig.free() == D_POOL.num_blocks


@pytest.mark.parametrize(("takes", "coalesce"), [(False, True), (True, False)])
def test_a_p_that_does_not_take_them_or_a_d_without_coalescing_sends_one_each(
    make_d_rig: Callable[..., Rig], takes: bool, coalesce: bool
) -> None:
    rig = make_d_rig(coalesce)
    p = _p(rig, takes)
    for t in ("t1", "t2", "t3"):
        rig.decode(p, t)
    rig.step()
    assert _regs(rig, p) == [("single", ["t1"]), ("single", ["t2"]), ("single", ["t3"])]


def test_a_lone_registration_goes_as_a_plain_push_reg(make_d_rig: Callable[..., Rig]) -> None:
    rig = make_d_rig()
    p = _p(rig)
    rig.decode(p, "t1")
    rig.step()
    assert _regs(rig, p) == [("single", ["t1"])]


def test_a_request_cancelled_before_its_registration_left_is_never_registered(
    make_d_rig: Callable[..., Rig],
) -> None:
    rig = make_d_rig()
    p = _p(rig)
    futs = {t: rig.decode(p, t) for t in ("t1", "t2", "t3")}
    rig.role.cancel("t2")  # drained after the new requests, in the same pass
    rig.step()
    assert _regs(rig, p) == [("batch", ["t1", "t3"])]
    rep = rig.result(futs["t2"])
    assert rep.outcome == "failed" and rep.reason == "cancelled"
    assert not [m for m in rig.sent_to(p) if isinstance(m, protocol.Cancel)]  # P never knew it
    assert rig.pool.allocator.blocks_of("t2").size == 0  # free at once, not quarantined


def test_a_failed_batch_send_takes_each_request_down_the_single_send_path(
    make_d_rig: Callable[..., Rig],
) -> None:
    """P's agent is gone under D: the batch's send fails; like a single PUSH_REG's failure,
    each request handshakes afresh once and registers again, and all of them complete."""
    rig = make_d_rig()
    p = _p(rig)
    futs = {t: rig.decode(p, t) for t in ("t1", "t2", "t3")}
    rig.agent.raise_on("send_notif", TransferError(TransferKind.PEER_DEAD, "agent gone"))
    p.hold = True  # the fresh handshake waits, so that all three are back before a pass
    p.got_request.clear()
    rig.step()
    wait_until(p.got_request.is_set, what="the fresh handshake")
    assert not _regs(rig, p)  # the failed send left nothing
    p.release()
    # Its answer reaches each request on the handshake's thread, one at a time: a pass that
    # ran between two of them would register the first alone (correct, but not this test).
    wait_until(lambda: len(rig.role.receiver.ready) == 3, what="every request back")
    rig.step()
    assert _regs(rig, p) == [("batch", ["t1", "t2", "t3"])], [f.done() for f in futs.values()]
    for t in futs:
        rig.pool.fill(t, rig.pool.allocator.blocks_of(t))
        rig.from_p(p, protocol.Completion(request_id=t, transfer_id=t))
    for fut in futs.values():
        assert rig.result(fut).outcome == "ok"
    assert rig.free() == D_POOL.num_blocks

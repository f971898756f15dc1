"""Settling pushes (``kvpush.prefill.settle``): a coalesced WRITE's pushes settled together end
each exactly as one alone -- blocks back, counters, histograms, stamps, outcomes in order, each
outcome out only once its counters count it; failed ones through ``Outcomes.settle``; twice is
once; the fault hook fires at its n-th push, in whichever batch that falls."""

from __future__ import annotations

import time
import types

import msgspec
import pytest

from kvpush.config import Role
from kvpush.memory.allocator import BlockAllocator
from kvpush.prefill.settle import Settler
from kvpush.prefill.table import Finished, Push, PushOutcome, Registration, Writing
from kvpush.telemetry import phases
from kvpush.telemetry.names import Counter, Failure, Hist
from kvpush.telemetry.store import Telemetry
from tests.unit.test_table import push_reg

REG = push_reg("t")  # (D at 127.0.0.1:1, rank 0)


class _Out:
    """``Outcomes.settle``'s part: what a failed push was told."""

    def __init__(self, report: list[PushOutcome]) -> None:
        self.report = report
        self.settled: list[tuple[str, str, bool]] = []

    def settle(self, push: Push, reason: str, detail: str, *, quarantine: bool) -> None:
        self.settled.append((push.key, reason, quarantine))
        self.report.append(PushOutcome(push.finished.transfer_id, False, reason, detail))


class _Hs:
    def __init__(self, names: list[str]) -> None:
        self.conns = [types.SimpleNamespace(agent_name=n, address=f"{n}:1") for n in names]

    def connected(self) -> list[types.SimpleNamespace]:
        return self.conns


def _settler(
    stamps: bool = True, drop_after: int = 0
) -> tuple[Settler, Telemetry, BlockAllocator, list[PushOutcome], _Out, list[str]]:
    tm = Telemetry(Role.PREFILL, "p")
    alloc = BlockAllocator(64)
    reports: list[PushOutcome] = []
    counted_before_report: list[int] = []

    def report(o: PushOutcome) -> None:
        counted_before_report.append(tm.snapshot().counters.get(Counter.PUSHES_OK, 0))
        reports.append(o)

    dropped: list[str] = []
    ctx = types.SimpleNamespace(
        cfg=types.SimpleNamespace(phase_stamps=stamps),
        pool=types.SimpleNamespace(allocator=alloc),
        telemetry=tm,
        report=report,
        handshakes=_Hs(["d0", "d1"]),
        agent=types.SimpleNamespace(drop_remote_under=dropped.append),
        instruments=types.SimpleNamespace(drop_agents_after=drop_after),
    )
    out = _Out(reports)
    s = Settler(ctx, out)  # type: ignore[arg-type]
    s.counted = counted_before_report  # type: ignore[attr-defined]
    return s, tm, alloc, reports, out, dropped


def _writing(alloc: BlockAllocator, i: int, t0: float, regs: int = 1) -> Writing:
    key = f"t{i}"
    ids = alloc.allocate(key, 1)
    f = Finished(key, key, key, ids, t0 + 0.001 * i)
    rs = tuple(
        Registration(key, msgspec.structs.replace(REG, decode_tp_rank=k), "d", t0 + k)
        for k in range(regs)
    )
    w = Writing(Push(f, rs), t_start=t0 + 10, t_posted=t0 + 11)
    w.t_done = t0 + 12
    w.nbytes = 1000 + i
    return w


def test_a_batch_settles_each_push_as_alone_in_order_counted_before_its_outcome() -> None:
    s, tm, alloc, reports, out, _ = _settler()
    t0 = time.monotonic() - 100
    ws = [_writing(alloc, i, t0) for i in range(3)]
    ws[1].failed[0] = (Failure.WRITE_ERROR, True)  # one leg failed: quarantined, told apart
    s.settle_many(ws)
    assert [(o.transfer_id, o.ok) for o in reports] == [("t1", False), ("t0", True), ("t2", True)]
    assert out.settled == [("t1", Failure.WRITE_ERROR, True)]
    # Each ok one counted before it is out (the batch's counters are bumped before the first).
    assert s.counted == [2, 2]  # type: ignore[attr-defined]
    snap = tm.snapshot()
    assert snap.counters[Counter.PUSHES_OK] == 2
    assert snap.counters[Counter.BYTES_PUSHED] == 1000 + 1002
    for h in (Hist.PUSH_LATENCY, Hist.PHASE_MATCH_WAIT, Hist.PHASE_HANDSHAKE_WAIT):
        assert snap.histograms[h].count == 2, h
    # Blocks: the ok ones' back to the pool; the failed one's left to Outcomes (here: held).
    assert alloc.owners() == ["t1"]
    ok = reports[1]
    assert ok.nbytes == 1000 and ok.peer == ("127.0.0.1", 1, 0)
    shift = phases.wall_shift()
    stamps = ok.phases
    assert stamps[phases.REGISTRATION_MATCHED] == pytest.approx(t0 + shift, abs=0.01)
    assert stamps[phases.HANDSHAKE_DONE] - stamps[phases.REGISTRATION_MATCHED] == pytest.approx(
        10.0
    )
    assert stamps[phases.WRITE_DONE] - stamps[phases.WRITE_POSTED] == pytest.approx(1.0)
    # Settling again changes nothing.
    s.settle_many(ws)
    s.settle(ws[0])
    assert len(reports) == 3 and tm.snapshot().counters[Counter.PUSHES_OK] == 2


def test_matched_is_when_the_blocks_and_the_last_registration_are_both_here() -> None:
    s, tm, alloc, reports, _, _ = _settler()
    t0 = time.monotonic() - 100
    w = _writing(alloc, 0, t0, regs=3)  # PUSH_REGs at t0, t0+1, t0+2; blocks at t0
    s.settle(w)
    st = reports[0].phases
    assert st[phases.HANDSHAKE_DONE] - st[phases.REGISTRATION_MATCHED] == pytest.approx(8.0)
    mw = tm.snapshot().histograms[Hist.PHASE_MATCH_WAIT]
    assert mw.count == 1 and mw.max == pytest.approx(2.0, rel=0.2)  # first arrival -> match


def test_without_stamps_no_phase_histogram_and_no_stamp() -> None:
    s, tm, alloc, reports, _, _ = _settler(stamps=False)
    s.settle_many([_writing(alloc, i, time.monotonic()) for i in range(2)])
    assert [o.phases for o in reports] == [{}, {}]
    snap = tm.snapshot()
    assert snap.histograms[Hist.PUSH_LATENCY].count == 2
    assert Hist.PHASE_MATCH_WAIT not in snap.histograms


@pytest.mark.parametrize("batches", [[5], [2, 2, 1], [1, 1, 1, 1, 1]])
def test_the_fault_hook_fires_once_at_its_nth_push_whatever_the_batches(
    batches: list[int],
) -> None:
    s, _, alloc, _, _, dropped = _settler(drop_after=4)
    i = 0
    for n in batches:
        s.settle_many([_writing(alloc, i + k, time.monotonic()) for k in range(n)])
        i += n
    assert dropped == ["d0", "d1"]

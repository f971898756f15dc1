"""The join of a request's shares over D's TP ranks (``kvpush.decode.join.TpJoin``), unit level:
one answer per request, decided by the first failed share or by the last ok one; the ranks
to cancel after a failure; the shares held for a whole-page digest, each released once. Pure;
a hypothesis test drives random arrival orders and outcomes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.decode.join import TpJoin
from kvpush.telemetry.names import Failure
from kvpush.wire import protocol


def _ok(rank: int, **kw: Any) -> protocol.DecodeRep:
    rep = protocol.DecodeRep(
        transfer_id="t",
        request_id="r-1",
        outcome="ok",
        latency_s=0.1 * (rank + 1),
        nbytes=100 + rank,
        verified=True,
        phases={"answered": 10.0 + rank, f"only_{rank}": 1.0},
    )
    return msgspec.structs.replace(rep, **kw)


def _failed(reason: str = "prefill_dead", detail: str = "P rank 0 is gone") -> protocol.DecodeRep:
    return protocol.DecodeRep(
        transfer_id="t", request_id="r-1", outcome="failed", reason=reason, detail=detail
    )


def test_all_ok_is_decided_by_the_last_share_and_merges_them() -> None:
    j = TpJoin(3, t0=0.0)
    assert j.add(2, _ok(2)) is None
    assert j.add(0, _ok(0)) is None
    final = j.add(1, _ok(1))
    assert final is not None and final is j.final
    assert final.outcome == "ok" and final.transfer_id == "t" and final.request_id == "r-1"
    assert final.nbytes == 100 + 101 + 102
    assert final.latency_s == pytest.approx(0.3)  # the slowest rank's
    assert final.verified is True and final.sha256 == ""
    assert final.phases == {"answered": 12.0, "only_0": 1.0, "only_1": 1.0, "only_2": 1.0}
    assert j.to_cancel() == [] and j.to_release() == []  # no digest: nothing held


def test_verified_only_when_every_rank_verified() -> None:
    j = TpJoin(2, t0=0.0)
    j.add(0, _ok(0))
    final = j.add(1, _ok(1, verified=None))
    assert final is not None and final.verified is None
    j = TpJoin(2, t0=0.0)
    j.add(0, _ok(0))
    final = j.add(1, _ok(1, verified=False))
    assert final is not None and final.verified is False


def test_whole_digest_reads_every_share_in_rank_order_then_releases_them_once() -> None:
    asked: list[list[str]] = []

    def digest(ids: list[str]) -> str:
        asked.append(ids)
        return "ab" * 32

    j = TpJoin(2, t0=0.0, digest=digest)
    assert j.add(1, _ok(1, request_id="r-b")) is None
    assert j.to_release() == []  # held until the request is decided
    final = j.add(0, _ok(0, request_id="r-a"))
    assert final is not None and final.sha256 == "ab" * 32
    assert asked == [["r-a", "r-b"]]
    assert j.to_release() == [(0, "r-a"), (1, "r-b")]
    assert j.to_release() == []


def test_first_failed_share_decides_names_its_rank_and_cancels_the_rest() -> None:
    clock = iter([7.5]).__next__
    j = TpJoin(4, t0=5.0, digest=lambda ids: "x", clock=clock)
    assert j.add(3, _ok(3, request_id="r-3")) is None
    final = j.add(1, _failed(reason=""))
    assert final is not None and final.outcome == "failed"
    assert final.reason == Failure.RANK_FAILED  # a share without a reason
    assert final.detail == "D rank 1: P rank 0 is gone"
    assert final.latency_s == pytest.approx(2.5)
    assert j.to_cancel() == [0, 2]
    assert j.to_release() == [(3, "r-3")]  # held for a digest nobody reads now
    # Later shares decide nothing; an ok one held for the digest is released.
    assert j.add(0, _ok(0, request_id="r-0")) is None
    assert j.add(2, _failed()) is None
    assert j.to_release() == [(0, "r-0")]
    assert j.final is final


def test_failed_detail_naming_its_rank_is_kept_and_bounded() -> None:
    j = TpJoin(2, t0=0.0, clock=lambda: 1.0)
    final = j.add(0, _failed(detail="D rank 0 failed (RankCrash: boom)"))
    assert final is not None and final.detail == "D rank 0 failed (RankCrash: boom)"
    assert final.reason == "prefill_dead"
    j = TpJoin(2, t0=0.0, clock=lambda: 1.0)
    final = j.add(1, _failed(detail="y" * 1000))
    assert final is not None and len(final.detail) == 1000
    assert final.detail.startswith("D rank 1: y")


def test_a_rank_answers_once() -> None:
    j = TpJoin(2, t0=0.0)
    j.add(0, _ok(0))
    with pytest.raises(ValueError, match="answered twice"):
        j.add(0, _ok(0))
    with pytest.raises(ValueError, match="not a rank"):
        j.add(2, _ok(2))


@settings(max_examples=200, deadline=None)
@given(
    outcomes=st.lists(st.booleans(), min_size=1, max_size=8).flatmap(
        lambda oks: st.tuples(st.just(oks), st.permutations(range(len(oks))))
    ),
    digest=st.booleans(),
)
def test_any_arrival_order_gives_one_answer(
    outcomes: tuple[list[bool], list[int]], digest: bool
) -> None:
    oks, order = outcomes
    n = len(oks)
    j = TpJoin(n, t0=0.0, digest=(lambda ids: "d") if digest else None, clock=lambda: 1.0)
    finals: list[tuple[int, protocol.DecodeRep]] = []
    cancelled: list[int] = []
    released: list[int] = []
    for i, rank in enumerate(order):
        rep = _ok(rank, request_id=f"r-{rank}") if oks[rank] else _failed()
        got = j.add(rank, rep)
        if got is not None:
            finals.append((i, got))
            cancelled = j.to_cancel()
        released.extend(r for r, _ in j.to_release())
    assert len(finals) == 1  # one answer, whatever the order
    at, final = finals[0]
    if all(oks):
        assert final.outcome == "ok" and at == n - 1 and cancelled == []
        assert final.nbytes == sum(100 + r for r in range(n))
    else:
        first_failed = next(i for i, r in enumerate(order) if not oks[r])
        assert final.outcome == "failed" and at == first_failed
        assert final.detail.startswith(f"D rank {order[at]}: ")
        assert cancelled == sorted(order[at + 1 :])  # the ranks still out then
    # Every ok share held for the digest is released exactly once; none without a digest.
    assert sorted(released) == ([r for r in range(n) if oks[r]] if digest else [])

"""``fleet check``'s block budget (``kvpush.commands.fleet.pools.Pools``), pure: pairs that share an
endpoint run only as many at once as its pool holds; a pair may always run alone (a full D is
then named by its own failure); a failed pair's blocks hold pairs back only while the endpoint
itself shows too few free, and for at most a deadline, after which the pair is "pool too small"
-- never a failure the check caused. The endpoint's answer and the clock are handed in.
"""

from __future__ import annotations

from kvpush.commands.fleet.pools import GO, WAIT, Pools, TooSmall, limit_of
from kvpush.config import Role
from kvpush.fleet.record import EndpointRecord, Geometry, Load

T = 1_800_000_000.0


def rec(address: str, role: Role, free: int | None = 64, tp: int = 1) -> EndpointRecord:
    return EndpointRecord(
        role=role, engine_id="e", incarnation="i", address=address, host="h", pid=1,
        tp_size=tp, wire="kvpush", compat_hash="h", kvpush_version="0",
        geometry=Geometry(num_blocks=64, layers=2, regions=4, block_bytes=4096,
                          dtype="bfloat16", kv_layout="NHD"),
        load=Load() if free is None else Load(free_blocks=free, updated_at=T),
    )  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def pools(*recs: EndpointRecord, free: dict[str, int | None] | None = None) -> tuple[Pools, Clock]:
    clock = Clock()
    answers = free or {}
    return Pools({r.address: r for r in recs}, 10.0, lambda a: answers.get(a), clock), clock


def test_limit_is_the_records_free_blocks_per_rank() -> None:
    assert limit_of(rec("p", Role.PREFILL, free=40)) == 40
    assert limit_of(rec("p", Role.PREFILL, free=None)) == 64  # no load summary: the pool
    assert limit_of(rec("p", Role.PREFILL, free=100, tp=2)) == 50  # summed over 2 ranks


def test_pairs_sharing_a_pool_run_as_many_as_it_holds() -> None:
    ps, _ = pools(rec("P", Role.PREFILL), rec("D1", Role.DECODE), rec("D2", Role.DECODE),
                  rec("D3", Role.DECODE))  # fmt: skip
    assert ps.admit("P", "D1", 30) == GO
    assert ps.admit("P", "D2", 30) == GO
    assert ps.admit("P", "D3", 30) == WAIT  # 90 > 64 at P
    ps.release("P", "D1", 30, ok=True)
    assert ps.admit("P", "D3", 30) == GO
    assert ps.pool("P").held == 60


def test_a_pair_may_always_run_alone() -> None:
    ps, _ = pools(rec("P", Role.PREFILL), rec("D", Role.DECODE, free=0))
    assert ps.admit("P", "D", 64) == GO  # a full D: its own no_free_blocks will name it


def test_serialised_note() -> None:
    ps, _ = pools(rec("P", Role.PREFILL), rec("D1", Role.DECODE), rec("D2", Role.DECODE))
    notes = ps.serialised({"P": 2, "D1": 1, "D2": 1}, {"P": 64, "D1": 64, "D2": 64}, 8)
    assert notes == ["prefill P: 64 blocks per push, 64 of 64 free: 1 of its 2 pairs at a time "
                     "(not 2)"]  # fmt: skip


def test_a_failed_pairs_blocks_hold_back_only_on_the_endpoints_word() -> None:
    free: dict[str, int | None] = {"P": 0}
    ps, clock = pools(rec("P", Role.PREFILL), rec("D1", Role.DECODE), rec("D2", Role.DECODE),
                      free=free)  # fmt: skip
    assert ps.admit("P", "D1", 64) == GO
    ps.release("P", "D1", 64, ok=False)  # its push may still hold P's blocks
    assert ps.admit("P", "D2", 64) == WAIT  # P says 0 free
    clock.t += 0.1
    assert ps.admit("P", "D2", 64) == WAIT  # not asked again so soon
    clock.t += 1.0
    free["P"] = 64  # P freed them (its lease lapsed)
    assert ps.admit("P", "D2", 64) == GO
    assert ps.pool("P").remnant == 0


def test_an_endpoint_that_cannot_tell_does_not_hold_pairs_back() -> None:
    ps, _ = pools(rec("P", Role.PREFILL), rec("D1", Role.DECODE), rec("D2", Role.DECODE))
    assert ps.admit("P", "D1", 64) == GO
    ps.release("P", "D1", 64, ok=False)
    assert ps.admit("P", "D2", 64) == GO  # no answer (frozen, gone): the pair says what


def test_a_shortage_the_remnant_cannot_explain_is_the_pairs_to_name() -> None:
    ps, _ = pools(rec("P", Role.PREFILL), rec("D1", Role.DECODE), rec("D2", Role.DECODE),
                  free={"P": 0})  # fmt: skip
    assert ps.admit("P", "D1", 4) == GO
    ps.release("P", "D1", 4, ok=False)
    assert ps.admit("P", "D2", 64) == GO  # 0 free + 4 held back < 64: others fill P


def test_remnant_past_a_deadline_is_pool_too_small_not_a_failure() -> None:
    ps, clock = pools(rec("P", Role.PREFILL), rec("D1", Role.DECODE), rec("D2", Role.DECODE),
                      free={"P": 0})  # fmt: skip
    assert ps.admit("P", "D1", 64) == GO
    ps.release("P", "D1", 64, ok=False)
    assert ps.admit("P", "D2", 64) == WAIT
    clock.t += 11.0
    verdict = ps.admit("P", "D2", 64)
    assert isinstance(verdict, TooSmall)
    assert verdict.detail == (
        "pool too small: a push of 64 blocks, prefill P shows 0 of 64 free after 11s "
        "(a failed pair's push may still hold 64)"
    )

"""The phase vocabulary and its pure helpers (kvpush.telemetry.phases), and drive's per-phase
statistics (kvpush.commands.drive.trace.phase_stats)."""

from __future__ import annotations

import time

from kvpush.commands.drive.trace import phase_stats
from kvpush.telemetry import phases
from kvpush.telemetry.phases import CAUSAL, ORDER, Phase


def test_order_and_causal_chain() -> None:
    assert [p.value for p in ORDER] == [
        "d_allocated", "push_reg_sent", "registration_matched", "handshake_done",
        "write_posted", "write_done", "completion_received", "verified", "answered",
    ]  # fmt: skip
    assert Phase.WRITE_DONE not in CAUSAL and len(CAUSAL) == len(ORDER) - 1


def test_stamp_is_a_no_op_when_stamps_are_off() -> None:
    phases.stamp(None, phases.D_ALLOCATED)  # no error, nothing to record into
    got: dict[str, float] = {}
    phases.stamp(got, phases.D_ALLOCATED)
    assert list(got) == ["d_allocated"] and got["d_allocated"] > 0


def test_steps_time_what_both_ends_have() -> None:
    d = {"d_allocated": 1.0, "push_reg_sent": 1.5, "completion_received": 2.0, "answered": 2.25}
    # no verification: the answer step starts at the completion
    assert phases.steps(d, phases.D_STEPS) == [
        ("phase_register", 0.5), ("phase_push_wait", 0.5), ("phase_answer", 0.25),
    ]  # fmt: skip
    d["verified"] = 2.125
    assert dict(phases.steps(d, phases.D_STEPS))["phase_answer"] == 0.125
    # a clock that went back is a zero, never a negative duration
    assert phases.steps({"write_posted": 5.0, "write_done": 4.0}, phases.P_STEPS) == [
        ("phase_write", 0.0)
    ]


def test_merge_keeps_each_phase_of_the_last_rank() -> None:
    got = phases.merge([{"a": 1.0, "b": 5.0}, {"a": 2.0}, {}])
    assert got == {"a": 2.0, "b": 5.0}


def test_last_reached_ignores_the_answer() -> None:
    assert phases.last_reached({}) == "sent"
    assert phases.last_reached({"answered": 3.0}) == "sent"  # refused: answered at once
    assert phases.last_reached({"d_allocated": 1, "push_reg_sent": 2, "answered": 3}) == (
        "push_reg_sent"
    )
    assert list(phases.ordered({"answered": 3, "x": 9, "d_allocated": 1})) == [
        "d_allocated", "answered", "x",
    ]  # fmt: skip


def test_phase_stats_over_ok_records() -> None:
    recs = [
        {"outcome": "ok", "phases": {"d_allocated": 0.001 * k, "answered": 0.01 * k}}
        for k in range(1, 101)
    ] + [{"outcome": "failed", "phases": {"d_allocated": 9.0}}]
    st = phase_stats(recs)
    assert list(st) == ["d_allocated", "answered"]
    assert st["d_allocated"]["count"] == 100
    assert st["d_allocated"]["p50"] == 0.05 and st["d_allocated"]["p99"] == 0.099
    assert st["answered"]["max"] == 1.0


def test_a_monotonic_stamp_converted_later_keeps_its_wall_time() -> None:
    """P converts its monotonic stamps to the wall clock when a push completes; the time between
    the stamp and the conversion must not leak into it (it did: the shift was computed from a
    ``now`` read earlier, so whatever ran in between moved P's phases later than D's)."""
    t_mono, t_wall = time.monotonic(), time.time()
    time.sleep(0.2)  # the push's work, or a preemption, before the conversion
    assert abs(t_mono + phases.wall_shift() - t_wall) < 0.02


def test_wall_shift_reads_both_clocks_back_to_back() -> None:
    now = [100.0]

    def clock(offset: float) -> float:
        now[0] += 0.001  # every read takes a millisecond
        return now[0] + offset

    shift = phases.wall_shift(lambda: clock(1000.0), lambda: clock(0.0))
    assert abs(shift - 1000.0) <= 0.001 + 1e-9

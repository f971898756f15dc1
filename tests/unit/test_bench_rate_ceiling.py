"""``kvpush bench rate``'s CPU ceiling: the slower side's CPU per push bounds the rate."""

from __future__ import annotations

import math

from kvpush.commands.bench.rate_report import ceiling_note, cpu_ceiling


def test_the_slower_side_sets_the_ceiling() -> None:
    assert cpu_ceiling(80.0, 50.0) == 1e6 / 80.0
    assert cpu_ceiling(40.0, 100.0) == 1e4


def test_no_cpu_figure_is_no_ceiling() -> None:
    assert math.isnan(cpu_ceiling(0.0, 0.0))
    assert math.isnan(cpu_ceiling(math.nan, math.nan))


def test_the_note_names_the_side_and_the_share_of_raw() -> None:
    note = ceiling_note(64, 80.0, 50.0, 50_000.0)
    assert "12,500 pushes/s" in note or "12500 pushes/s" in note
    assert "(25% of raw NIXL)" in note and "P's per-push CPU" in note
    assert "D's per-push CPU" in ceiling_note(64, 40.0, 100.0, 50_000.0)


def test_the_note_says_what_d_s_load_generator_spent_when_measured() -> None:
    note = ceiling_note(64, 40.0, 100.0, 50_000.0, d_client_us=35.5)
    assert "D's 100.0 us (35.5 of it in the thread that calls decode())" in note
    assert "of it in the thread" not in ceiling_note(64, 40.0, 100.0, 50_000.0)

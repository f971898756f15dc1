"""``kvpush bench peer``'s plan and report (pure): cells, pools, rates, ratios, targets."""

from __future__ import annotations

import math

import pytest

from kvpush.commands.bench.peer_plan import PeerPlan
from kvpush.commands.bench.peer_report import COLUMNS, report, summarize
from kvpush.commands.bench.report import Report
from kvpush.errors import ConfigError


def test_plan_cells_pools_and_counts() -> None:
    plan = PeerPlan.make(quick=False)
    assert [(c.blocks, c.inflight) for c in plan.cells] == [
        (1, 1), (1, 16), (16, 1), (16, 16), (256, 1), (256, 16),
    ]  # fmt: skip
    assert {c.key: c.n for c in plan.cells}["b1_i16"] == 600
    assert plan.d_blocks == 256 * 17 and plan.p_blocks == 2 * plan.d_blocks
    assert plan.geometry.block_tokens == 16
    assert plan.geometry.block_bytes == 2 * 16 * 2 * 64 * 2
    assert plan.max_len >= 256 * 16
    small = PeerPlan.make(quick=True, requests=1, rounds=2)
    assert small.rounds == 2
    assert all(c.n >= max(4, 2 * c.inflight) for c in small.cells)


def test_plan_rejects_zero_requests() -> None:
    with pytest.raises(ConfigError, match="--requests"):
        PeerPlan.make(quick=False, requests=0)


def _round(ok: int, elapsed: float, lat: float, p_cpu: float, d_cpu: float) -> dict[str, object]:
    return {"ok": ok, "failed": 0, "elapsed_s": elapsed, "latency_s": [lat] * ok,
            "p_cpu_s": p_cpu, "d_cpu_s": d_cpu}  # fmt: skip


def test_summarize_takes_the_median_round_and_pools_latency() -> None:
    s = summarize([_round(10, 1.0, 0.001, 0.01, 0.02), _round(10, 0.5, 0.003, 0.03, 0.04),
                   _round(10, 2.0, 0.002, 0.02, 0.06)])  # fmt: skip
    assert s["per_s"] == 10.0  # rates 10, 20, 5
    assert s["p50_s"] == 0.002 and s["p99_s"] == 0.003
    assert s["p_cpu_us"] == pytest.approx(2000.0) and s["d_cpu_us"] == pytest.approx(4000.0)
    assert s["requests"] == 30 and s["failed"] == 0
    assert math.isnan(summarize([])["per_s"])


def test_report_has_one_row_ratio_and_target_per_cell() -> None:
    plan = PeerPlan.make(quick=True, rounds=1)
    samples = {
        c.key: {
            "kvpush": [_round(c.n, 1.0, 0.001, 0.001, 0.001)],
            "vllm": [_round(c.n, 2.0 if c.blocks < 256 else 0.5, 0.002, 0.002, 0.002)],
        }
        for c in plan.cells
    }
    rep = Report("peer", "t", True)
    report(rep, plan, samples)
    (table,) = rep.tables
    assert table["columns"] == COLUMNS
    ratios = [row[COLUMNS.index("kvpush/vLLM")] for row in table["rows"]]
    assert ratios == ["2.00x", "2.00x", "2.00x", "2.00x", "0.50x", "0.50x"]
    assert [t["met"] for t in rep.targets] == [True, True, True, True, False, False]
    fig = rep.figures["b256_i16"]
    assert isinstance(fig, dict) and fig["ratio"] == 0.5
    assert "NixlPushConnector" in table["note"]


def test_report_of_a_missing_system_is_not_a_pass() -> None:
    plan = PeerPlan.make(quick=True, rounds=1)
    samples = {c.key: {"kvpush": [_round(c.n, 1.0, 0.001, 0.001, 0.001)]} for c in plan.cells}
    rep = Report("peer", "t", True)
    report(rep, plan, samples)
    assert all(t["met"] is None for t in rep.targets)
    assert all(row[COLUMNS.index("kvpush/vLLM")] == "-" for row in rep.tables[0]["rows"])

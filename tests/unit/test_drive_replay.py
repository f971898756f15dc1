"""``drive --workload``'s schedule and report, pure (``kvpush.commands.drive.workload``,
``workload_report``): each request's blocks and due time from its trace line; a prompt no pool
can hold is refused by line number; the report's buckets, series and pool figures add up; the
options of a replay and of a plain drive are not mixed."""

from __future__ import annotations

import subprocess

import pytest

from kvpush.commands.common.results import RequestResult, summarize
from kvpush.commands.drive.schedule import Pools
from kvpush.commands.drive.workload import MAX_REQUEST_BLOCKS, Replay
from kvpush.commands.drive.workload_report import Record, bin_width, build, spark
from kvpush.commands.workload.trace import TraceRequest, Workload
from kvpush.telemetry.names import Failure
from tests.support.procs import KVPUSH, clean_env


def workload(*reqs: tuple[float, int]) -> Workload:
    return Workload(
        "t.jsonl",
        tuple(TraceRequest(k + 10, ts, n, 1) for k, (ts, n) in enumerate(reqs)),
        (),
    )


def test_blocks_and_due_times_come_from_the_trace() -> None:
    notes: list[str] = []
    r = Replay(workload((1000, 1), (1500, 16), (3000, 17)), 16, 2.0, notes.append)
    assert [r.blocks(i) for i in range(3)] == [1, 1, 2]
    assert [r.due(i) for i in range(3)] == [0.0, 0.25, 1.0]  # from the first, / speedup
    assert r.requests == 3


def test_a_prompt_no_pool_holds_is_refused_by_its_line() -> None:
    notes: list[str] = []
    r = Replay(
        workload((0, 160), (0, 161), (0, 16 * (MAX_REQUEST_BLOCKS + 1))), 16, 1, notes.append
    )
    r.begin(0.0, Pools({"p:1": 1000}, {"d:1": 8, "d:2": 10}))
    try:
        assert r.refuse(0) is None  # 10 blocks: the larger D holds it
        reason, detail = r.refuse(1) or (None, "")
        assert reason is Failure.NO_FREE_BLOCKS
        assert detail == (
            "never sent: a prompt of 161 tokens is 11 blocks of 16 tokens, more than any D's "
            "whole pool holds (10 blocks)"
        )
        assert notes == [
            "workload line 11: a prompt of 161 tokens is 11 blocks of 16 tokens, more than any "
            "D's whole pool holds (10 blocks): counted failed (no_free_blocks); the replay goes on"
        ]
        assert "more than one request may carry (65,536)" in (r.refuse(2) or (None, ""))[1]
    finally:
        r.stop()


def test_a_pool_seen_by_no_preflight_refuses_nothing() -> None:
    r = Replay(workload((0, 10**9)), 16, 1, lambda s: None)
    assert r.refuse(0) is not None  # over what one request may carry
    r2 = Replay(workload((0, 16 * 1000)), 16, 1, lambda s: None)
    assert r2.refuse(0) is None  # no pools known: D answers for itself


def rec(i: int, tokens: int, blocks: int, ended: float, lat: float, d: str, ok: bool = True,
        nbytes: int = 0) -> Record:  # fmt: skip
    res = RequestResult(i, f"r-{i}", "p:1", d, ok, "" if ok else "no_free_blocks", "", lat,
                        nbytes, True if ok else None)  # fmt: skip
    return Record(i + 1, tokens, blocks, ended - lat, 0.001 * i, ended, res)


def test_the_report_adds_up() -> None:
    recs = [
        rec(0, 500, 1, 0.10, 0.05, "d:1", nbytes=1000),
        rec(1, 2000, 4, 0.30, 0.25, "d:1", nbytes=4000),  # in flight with 0 and 2 on d:1
        rec(2, 2000, 4, 0.20, 0.10, "d:1", nbytes=4000),
        rec(3, 70000, 90, 0.40, 0.01, "d:2", ok=False),
        rec(4, 70000, 90, 0.40, 0.0, "", ok=False),  # never sent
    ]
    base = summarize([r.result for r in recs], 1.0)
    points = [(0.0, "d:1", 0, 8), (0.1, "d:1", 8, 8), (0.3, "d:1", 3, 8), (0.5, "d:1", 0, 8)]
    w = build(base, recs, points, Pools({}, {"d:1": 8, "d:2": 100}), workload=workload((0, 1)),
              block_tokens=16, speedup=1, tolerance_s=0.002, concurrency=4).workload  # fmt: skip
    assert w["blocks_total"] == 189 and w["blocks_ok"] == 9
    assert [(b["bucket"], b["requests"], b["ok"], b["failed"]) for b in w["latency_by_prompt"]] == [
        ("<1k", 1, 1, 0), ("1k-4k", 2, 2, 0), (">=64k", 2, 0, 2),
    ]  # fmt: skip
    assert w["latency_by_prompt"][1]["latency_s"] == {"p50": 0.10, "p99": 0.25}
    assert w["latency_by_prompt"][2]["latency_s"] is None
    assert w["lateness_s"]["late"] == 2 and w["lateness_s"]["max"] == 0.004
    assert w["bin_s"] == 0.25
    assert sum(w["gb_per_s"]) * w["bin_s"] * 1e9 == pytest.approx(9000)
    d1, d2 = w["pools"]["d:1"], w["pools"]["d:2"]
    assert d1["peak_used_blocks"] == 8 and d1["total_blocks"] == 8
    assert d1["time_full_s"] == pytest.approx(0.2)  # full from 0.1 s to the next sample
    assert d1["used_blocks"] == [8, 3, 0, None, None]  # the highest sample per bin; none: None
    # requests 1 and 2 at once (0 ends at 0.10 s as 2 starts: an end counts first)
    assert d1["demand_peak_blocks"] == 8
    assert d2["total_blocks"] == 100 and d2["samples"] == 0 and d2["demand_peak_blocks"] == 90


def test_bins_and_sparks() -> None:
    assert bin_width(5) == 0.25 and bin_width(30) == 1.0 and bin_width(3600) == 120.0
    assert spark([0, 1, None, 0.5]) == "▁█ ▅"
    assert spark([]) == ""


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--workload", "x.jsonl", "--requests", "5", "--rate", "2"],
         "--workload sizes and paces the requests itself: not with --requests, --rate"),
        (["--speedup", "2", "--limit", "3"],
         "--speedup, --limit shape a trace replay: they take --workload FILE"),
    ],
)  # fmt: skip
def test_replay_and_plain_options_are_not_mixed(args: list[str], said: str) -> None:
    r = subprocess.run([*KVPUSH, "drive", "-p", "127.0.0.1:1", "-d", "127.0.0.1:2", *args],
                       capture_output=True, text=True, env=clean_env(), timeout=60)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert f"error: {said}" in r.stderr

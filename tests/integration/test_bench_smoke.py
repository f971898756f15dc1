"""Smoke test of ``kvpush bench``: every scenario runs in --quick mode and returns a well-formed
result (tables, targets, figures, chart). Structure only: no timing or ratio is asserted here --
numbers from a shared CI host mean nothing; BENCHMARKS.md holds a full run's figures."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kvpush.commands import bench
from kvpush.commands.bench.console import run_bench
from kvpush.errors import ExitStatus

pytestmark = pytest.mark.integration

CHARTS = {"hol", "handshake", "bandwidth", "scale", "tp", "model"}


def _etcd_installed() -> bool:
    from kvpush.commands.bench.fleet import etcd_binary
    from kvpush.commands.bench.procs import BenchError

    try:
        return Path(etcd_binary()).exists()
    except BenchError:
        return False


def test_handshake_etcd_rows_skipped_without_etcd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No etcd that can start: the etcd rows of ``bench handshake`` are skipped with a note
    naming why, not an error; the side-channel rows are reported alone."""
    import contextlib

    from kvpush.commands.bench import handshake_etcd
    from kvpush.commands.bench.report import Report

    monkeypatch.setenv("KVPUSH_ETCD_BIN", str(tmp_path / "no-such-etcd"))
    said: list[str] = []
    with contextlib.ExitStack() as stack:
        url, why = handshake_etcd.start_etcd(stack, tmp_path, said.append)
    assert url == "" and why.startswith("etcd rows skipped: etcd did not start:"), why
    assert set(handshake_etcd.specs(url)) == {"cmp-p-sidechannel", "cmp-d-sidechannel"}
    rep = Report("handshake", "t", True)
    row = {"side_channel_s": 1e-3, "load_s": 1e-3, "prep_s": 0.0, "warm_s": 0.0, "total_s": 2e-3}
    handshake_etcd.report(rep, {"sidechannel": {"D->P notif": [row]}}, why)
    assert rep.notes == [why]
    assert [r[1] for r in rep.tables[0]["rows"]] == ["sidechannel"]


def _check_result(r: Mapping[str, object], name: str, out: Path) -> None:
    assert r["scenario"] == name
    assert r["quick"] is True
    assert r["command"] == f"kvpush bench {name} --quick"
    # strict JSON: no NaN or infinity anywhere
    text = json.dumps(r, allow_nan=False)
    assert json.loads((out / f"{name}.json").read_text()) == json.loads(text)
    machine = r["machine"]
    assert isinstance(machine, dict) and machine["cpus"] and len(machine["loadavg"]) == 3
    tables = r["tables"]
    assert isinstance(tables, list) and tables
    for t in tables:
        assert t["title"] and t["columns"] and t["rows"]
        for row in t["rows"]:
            assert len(row) == len(t["columns"]), (t["title"], row)
            assert all(isinstance(c, str) for c in row)
    targets = r["targets"]
    assert isinstance(targets, list) and targets
    for tg in targets:
        assert tg["name"] and tg["target"] and tg["measured"]
        assert tg["met"] in (True, False, None)
    assert isinstance(r["figures"], dict) and r["figures"]
    charts = r["charts"]
    assert isinstance(charts, list)
    if name in CHARTS:
        assert charts, f"{name} draws a chart"
    for c in charts:
        root = ET.parse(c).getroot()
        assert root.tag.endswith("svg")


def _check_model(r: Mapping[str, object]) -> None:
    """Every shape x size x id pattern measured with every method; ids recorded; verified."""
    params = r["params"]
    figures = r["figures"]
    assert isinstance(params, dict) and isinstance(figures, dict)
    shapes = [s["name"] for s in params["shapes"]]
    assert [s.split("/")[0] for s in shapes] == ["llama-8b", "llama-70b-tp8", "mla"]
    cells = {(c["shape"], c["tokens"], c["pattern"]): c for c in figures["cells"]}
    assert set(cells) == {
        (s, t, p) for s in shapes for t in params["tokens"] for p in params["patterns"]
    }
    assert set(params["patterns"]) == {"contiguous", "shuffled", "churn", "churn-freelist"}
    for c in cells.values():
        for key in ("kvpush_gbps", "raw_gbps", "raw_nomerge_gbps", "pvw_gbps"):
            assert len(c[key]) == params["rounds"] and all(x > 0 for x in c[key]), key
        assert c["kvpush_failed"] == 0
        assert c["verified"] == c["verify_requests"] > 0
        # merged descriptors: at least one per region, at most one per block per region
        assert c["regions"] <= c["descs_per_write"] <= c["descs_unmerged"]
        assert c["descs_unmerged"] == c["blocks"] * c["regions"]
        if c["pattern"] == "contiguous":
            assert c["descs_per_write"] == c["regions"]  # a fresh pool: one run per request
        if c["pattern"].startswith("churn"):
            assert c["pool"]["d"]["resident_blocks"] > 0
    mla = next(s for s in params["shapes"] if s["name"].startswith("mla"))
    assert mla["regions"] == mla["layers"]  # one latent region per layer
    cost = figures["alloc_cost"]
    assert {c["allocator"] for c in cost} == {"extent", "freelist"}
    assert all(c["allocate_ns"] > 0 for c in cost)
    targets = r["targets"]
    assert isinstance(targets, list)
    names = [t["name"] for t in targets]
    for claim in ("kvpush / raw NIXL", "kvpush on a fresh pool", "plain free list", "allocation"):
        assert any(claim in n for n in names), claim


def _my_workers() -> list[int]:
    """Bench worker processes that are children of this test process."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"kvpush.commands.bench.worker" in cmd:
            out.append(int(entry))
    return out


# The three longest scenarios run in the slow suite (``make test`` stays near 10 minutes).
_SLOW_SCENARIOS = {"hol", "model", "fleet"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_SCENARIOS else n
        for n in bench.SCENARIOS
    ],
)
def test_scenario_quick(name: str, tmp_path: Path) -> None:
    r = bench.run(name, quick=True, out_dir=tmp_path)
    _check_result(r, name, tmp_path)
    figures: Any = r["figures"]  # the scenario's JSON for machines: read as the test expects
    data: Any = r["data"]
    if name == "hol":
        assert {"slow", "dead", "two-slow+healthy"} <= set(figures)
        assert "alone" not in figures  # the third peer's reference: no targets of its own
        assert set(data["series"]) == {
            f"{c}/{m}"
            for c in ("slow", "dead", "two-slow+healthy", "alone")
            for m in ("deferred", "blocking")
        }
        # the reference of the third peer's target: a fresh D joining alone, once per repeat
        assert len(figures["healthy_alone_join_s"]) == 1, figures["healthy_alone_join_s"]
        targets: Any = r["targets"]
        third = [t for t in targets if t["name"].startswith("healthy third peer joins")]
        assert len(third) == 1 and third[0]["measured"] != "failed", third
        assert figures["healthy_third_over_alone"] > 0, figures["healthy_third_over_alone"]
    if name == "handshake":
        sizes = figures["sizes"]
        assert len(sizes) >= 2 and all(
            s["notif_total_s"] > 0 and s["full_total_s"] > 0 for s in sizes
        )
        # Each handshake starts from nothing (not the last one's connection, reused): only a
        # full one prepares the remote descriptor list.
        assert all(s["notif_prep_s"] < s["full_prep_s"] for s in sizes), sizes
        # Agent metadata over the side channel vs NIXL's etcd backend, in the same rounds: the
        # etcd rows when an etcd binary is installed (the test extras), else a note saying why not.
        nm = figures["nixl_metadata"]
        kinds = ("D->P notif", "P->D full")
        ts = ("sidechannel", "etcd") if _etcd_installed() else ("sidechannel",)
        assert set(nm) == {f"{k}/{t}" for k in kinds for t in ts}, nm
        assert all(e["n"] >= 1 and e["total_s"] > 0 and e["load_s"] > 0 for e in nm.values())
        if len(ts) == 1:
            assert any("etcd rows skipped" in n for n in r["notes"]), r["notes"]
    if name in ("bandwidth", "rate"):
        assert "verified" in json.dumps(r["tables"]) or r["notes"]
    if name == "rate":
        _check_floors(figures["floors"], r["notes"])
    if name == "model":
        _check_model(r)
    # every worker wrote its log, and none outlives its scenario
    assert list((tmp_path / "logs").iterdir())
    assert _my_workers() == []


def _check_floors(floors: Any, notes: list[str]) -> None:
    """The small requests beside their floors: raw NIXL notifications counted by the target,
    kvpush's notifications both ways, UCX's own rates when ucx_perftest is installed."""
    from kvpush.commands.bench import ucx_floors

    assert floors["raw_notifs"] and all(x["per_s"] > 0 for x in floors["raw_notifs"])
    assert floors["kvpush_d_to_p_notifs_per_s"] > 0
    assert floors["kvpush_p_to_d_notifs_per_s"] > 0
    if ucx_floors.perftest() is None:
        assert floors["ucx"] == [] and any("UCX floors skipped" in n for n in notes), notes
    else:
        assert len(floors["ucx"]) == len(ucx_floors.cases(quick=True)), (floors["ucx"], notes)


def test_unknown_scenario_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench("nope", quick=True, json_out=False, out_dir=None) == ExitStatus.USAGE
    err = capsys.readouterr().err
    assert "error: unknown benchmark scenario 'nope'" in err
    assert (
        "hint: choose one of hol, handshake, bandwidth, rate, scale, tp, model, fleet, device, "
        "or all" in err
    )

"""``kvpush bench peer`` end to end, small: kvpush P -> D beside vLLM's own NixlPushConnector
P -> D (the vLLM side in the vLLM virtualenv, through the bench's own driver).

A smoke test, not a measurement: one round of a few requests per cell; it checks that every
cell was measured on both systems (positive rates, latencies and CPU), that the ratio column
is filled, and that the report says what the vLLM figure includes. One vLLM pair start-up is
most of its time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CELLS = [(b, i) for b in (1, 16, 256) for i in (1, 16)]


def test_bench_peer_quick_reports_every_cell(vllm_py: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")}
    cmd = [
        sys.executable, "-m", "kvpush", "bench", "peer", "--quick", "--json",
        "--requests", "32", "--rounds", "1", "--vllm-python", vllm_py,
        "--out-dir", str(tmp_path),
    ]  # fmt: skip
    p = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=840, check=False
    )
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout)
    assert r["scenario"] == "peer"
    assert json.loads((tmp_path / "peer.json").read_text())["figures"] == r["figures"]
    for blocks, inflight in CELLS:
        f = r["figures"][f"b{blocks}_i{inflight}"]
        assert (f["blocks"], f["inflight"]) == (blocks, inflight)
        for system in ("kvpush", "vllm"):
            s = f[system]
            assert s["failed"] == 0, (blocks, inflight, system, s)
            assert s["per_s"] > 0 and s["requests"] > 0, (blocks, inflight, system, s)
            assert 0 < s["p50_s"] <= s["p99_s"], (blocks, inflight, system, s)
            assert s["p_cpu_us"] > 0 and s["d_cpu_us"] > 0, (blocks, inflight, system, s)
        assert f["ratio"] == pytest.approx(f["kvpush"]["per_s"] / f["vllm"]["per_s"])
    (table,) = r["tables"]
    assert "kvpush/vLLM" in table["columns"]
    ratio_col = table["columns"].index("kvpush/vLLM")
    assert [(row[0], row[1]) for row in table["rows"]] == [(str(b), str(i)) for b, i in CELLS]
    assert all(row[ratio_col].endswith("x") for row in table["rows"]), table["rows"]
    assert "NixlPushConnector" in table["note"] and "no model forward" in table["note"]
    assert len(r["targets"]) == len(CELLS)


def test_bench_peer_without_vllm_python_is_a_usage_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")}
    p = subprocess.run(
        [sys.executable, "-m", "kvpush", "bench", "peer", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "error: bench peer needs vLLM's python" in p.stderr
    assert "hint: build it with scripts/vllm-venv.sh" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "peer.json").exists()

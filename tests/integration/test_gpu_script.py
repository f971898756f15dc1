"""scripts/gpu-check.sh (issue 20) tested here, where there is no GPU: its dry run end to end on
the CPU, and the clear errors (not tracebacks) when CUDA is asked for and absent: the script
itself, ``serve-*`` and ``bench device``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT, clean_env

SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=clean_env(PYTHON=sys.executable),
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(400)
def test_dry_run_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _script("--dry-run", "--out", str(out), timeout=380)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "== gpu-check PASSED (dry-run, device cpu)" in r.stdout
    assert "size: checkout " in r.stdout and "(limit 64 MiB)" in r.stdout
    assert sorted(os.listdir(out)) == [
        "device.json", "gpu-check.log", "gpu-tests.jsonl", "summary.json",
    ]  # fmt: skip
    s = json.loads((out / "summary.json").read_text())
    assert (s["mode"], s["device"], s["tests_exit"], s["bench_exit"]) == ("dry-run", "cpu", 0, 0)
    tests = {t["test"]: t for t in s["tests"]}
    assert set(tests) == {"llama-8b tp1", "llama-70b-tp8 tp1", "llama-8b tp2"}
    for t in tests.values():
        assert t["ok"] == t["verified"] == t["requests"] > 0, t
        for role in ("prefill", "decode"):
            assert t["endpoints"][role]["device_kind"] == "DRAM"
            assert t["endpoints"][role]["telemetry_device"] == "cpu"
    cells = s["bench_cells"]
    assert [c["shape"] for c in cells] == ["llama-8b/L2", "llama-70b-tp8/L2"]
    for c in cells:
        assert c["verified"] == c["verify_requests"] > 0
        assert c["kvpush_median"] > 0 and c["raw_median"] > 0 and c["copy_median"] > 0
    assert s["travel_bytes"] < 64 << 20


@pytest.mark.integration
def test_script_without_cuda_says_so(tmp_path: Path) -> None:
    if _has_cuda():
        pytest.skip("this host has CUDA")
    r = _script("--out", str(tmp_path / "out"), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("error:", "hint:"))]
    assert lines == [
        "error: no usable CUDA device on this host (torch.cuda.is_available() is False)",
        "hint: run this on a GPU host, or 'scripts/gpu-check.sh --dry-run' to test the script "
        "on the CPU",
    ]
    assert "Traceback" not in r.stdout + r.stderr


def test_script_refuses_an_unknown_argument() -> None:
    r = _script("--gpu", timeout=30)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "error: unknown argument '--gpu'",
        "hint: scripts/gpu-check.sh [--dry-run] [--out DIR]",
    ]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("args", "spec"),
    [
        (["serve-prefill", "--port", "0", "--device", "cuda", "-o", "plain"], "cuda"),
        (["serve-decode", "--port", "0", "--device", "cuda:1", "--tp", "2", "-o", "plain"],
         "cuda:1"),
        (["bench", "device", "--device", "cuda", "--quick"], "cuda"),
    ],
)  # fmt: skip
def test_cuda_asked_for_and_absent_is_a_clear_error(kvpush_run, args: list[str], spec: str) -> None:
    if _has_cuda():
        pytest.skip("this host has CUDA")
    r = kvpush_run(*args)
    assert r.err_lines == [
        f"error: CUDA requested (--device {spec}) but this host has no usable CUDA device",
        "hint: use --device cpu",
    ]
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_bench_device_option_is_for_the_device_scenario(kvpush_run) -> None:
    r = kvpush_run("bench", "hol", "--device", "cuda", "--quick")
    assert r.err_lines == [
        "error: bench hol runs on DRAM only (--device cuda)",
        "hint: --device applies to device: kvpush bench device --device cuda",
    ]
    assert r.returncode == 2
    r = kvpush_run("bench", "all", "--device", "cuda:0")
    assert r.err_lines == [
        "error: bench all runs on DRAM only (--device cuda:0)",
        "hint: --device applies to device: kvpush bench device --device cuda:0",
    ]
    assert r.returncode == 2

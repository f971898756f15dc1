"""The GPU path (issue 20): P and D endpoints with ``--device cuda``, pushes at model shapes,
every byte verified at D, telemetry showing the device. Marked ``gpu``: not part of
``make test``; ``scripts/gpu-check.sh`` runs it on a CUDA host (``KVPUSH_GPU_DEVICE=cuda``)
and, as its dry run, here on the CPU (``KVPUSH_GPU_DEVICE=cpu``).

Each test appends one JSON line (what ran, what it found) to ``$KVPUSH_GPU_OUT/gpu-tests.jsonl``
when that variable is set: the script's results.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

L8B = ["--layers", "32", "--block-tokens", "16", "--kv-heads", "8", "--head-dim", "128"]
L70B = ["--layers", "80", "--block-tokens", "16", "--kv-heads", "1", "--head-dim", "128"]
SHAPE_ARGS = {"llama-8b": L8B, "llama-70b-tp8": L70B}


def _device() -> str:
    dev = os.environ.get("KVPUSH_GPU_DEVICE", "")
    if dev:
        return dev
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    except ImportError:
        pass
    pytest.skip("no CUDA device (KVPUSH_GPU_DEVICE=cpu runs this module on the CPU: the dry run)")


def _cuda_count() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _record(entry: dict[str, Any]) -> None:
    out = os.environ.get("KVPUSH_GPU_OUT")
    if out:
        with (Path(out) / "gpu-tests.jsonl").open("a") as f:
            f.write(json.dumps({"ts": time.time(), **entry}) + "\n")


def _plan(device: str) -> tuple[int, int, int]:
    """(tokens per request, requests, pool blocks): real sizes on a GPU, small on the CPU."""
    if device.startswith("cuda"):
        return 2048, 64, 1024
    return 128, 6, 64


def _drive_and_check(kvpush_run, serve, device: str, shape: str, tp: int) -> dict[str, Any]:
    tokens, n, nb = _plan(device)
    geo = [*SHAPE_ARGS[shape], "--dtype", "bfloat16", "--num-blocks", str(nb)]
    if tp > 1:
        geo += ["--tp", str(tp)]
        if shape == "llama-70b-tp8":
            pytest.skip("llama-70b-tp8 is one rank's share (1 KV head): no second rank to split")
    p = serve.start("prefill", *geo, "--device", device, timeout=180)
    d = serve.start("decode", *geo, "--device", device, timeout=180)
    t0 = time.monotonic()
    r = kvpush_run(
        "drive", "-p", p.address, "-d", d.address, "--shape", shape, "--tokens", str(tokens),
        "-n", str(n), "-c", "4", "--json", timeout=240,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    # Telemetry from each endpoint: the device its pool lives on, every rank.
    infos = {}
    for e in (p, d):
        s = kvpush_run("probe", e.address, "--stats", "--json", timeout=60)
        assert s.returncode == 0, s.stdout + s.stderr
        rep = json.loads(s.stdout)
        infos[e.role] = {
            "device_kind": rep["metadata"]["device_kind"],
            "telemetry_device": rep["stats"]["info"]["device"],
            "nixl_version": rep["metadata"].get("nixl_version", ""),
        }
    entry = {
        "test": f"{shape} tp{tp}",
        "device": device,
        "tokens": tokens,
        "requests": n,
        "ok": out["ok"],
        "verified": out["verified"],
        "bytes_total": out["bytes_total"],
        "drive_gb_per_s": out.get("gb_per_s"),
        "latency_s": out.get("latency_s"),
        "elapsed_s": round(elapsed, 2),
        "endpoints": infos,
    }
    _record(entry)
    assert (out["ok"], out["verified"]) == (n, n), out
    want_kind = "VRAM" if device.startswith("cuda") else "DRAM"
    for role, info in infos.items():
        assert info["device_kind"] == want_kind, (role, info)
        # torch's name of the device: cuda -> cuda:0
        assert info["telemetry_device"].split(":")[0] == device.split(":")[0], (role, info)
    return entry


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", ["llama-8b", "llama-70b-tp8"])
def test_tp1_push_at_model_shape_every_byte_verified(kvpush_run, serve, shape: str) -> None:
    _drive_and_check(kvpush_run, serve, _device(), shape, 1)


@pytest.mark.timeout(300)
def test_tp2_two_ranks(kvpush_run, serve) -> None:
    device = _device()
    if device.startswith("cuda"):
        base = int(device.partition(":")[2] or 0)
        have = _cuda_count()
        if have < base + 2:
            reason = (
                f"TP 2 on one GPU is not possible: kvpush places rank r on cuda:N+r (one GPU per "
                f"rank, as vLLM's workers), so --device {device} --tp 2 needs cuda:{base} and "
                f"cuda:{base + 1}; this host has {have} CUDA device(s)"
            )
            _record({"test": "llama-8b tp2", "device": device, "skipped": reason})
            pytest.skip(reason)
    _drive_and_check(kvpush_run, serve, device, "llama-8b", 2)

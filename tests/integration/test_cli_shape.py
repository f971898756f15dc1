"""``--shape`` (issue 10): a real model's geometry on ``drive`` and ``demo``; ``--tp`` on demo.

Real endpoint processes; the shape's pages are real (llama-70b-tp8: 160 regions of 4 KiB; mla:
61 regions of one 72 KiB latent), every byte verified.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration

# One rank of Llama 3 70B at TP 8, as `--shape llama-70b-tp8` describes it.
L70B = ["--layers", "80", "--block-tokens", "16", "--kv-heads", "1", "--head-dim", "128"]


def test_drive_tokens_need_a_shape(pd_pair, kvpush_run) -> None:
    p, d = pd_pair
    r = kvpush_run("drive", "-p", p.address, "-d", d.address, "--tokens", "512")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: --tokens needs --shape" in r.stderr
    assert "hint: name the model, e.g. --shape llama-8b" in r.stderr


def test_drive_unknown_shape_names_the_known_ones(pd_pair, kvpush_run) -> None:
    p, d = pd_pair
    r = kvpush_run("drive", "-p", p.address, "-d", d.address, "--shape", "llama-405b")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: unknown shape 'llama-405b'" in r.stderr
    assert "hint: choose one of llama-8b, llama-70b-tp8, mla" in r.stderr


def test_drive_refuses_endpoints_of_another_geometry(pd_pair, kvpush_run) -> None:
    p, d = pd_pair  # 2 layers of 4 KiB blocks
    r = kvpush_run("drive", "-p", p.address, "-d", d.address, "--shape", "llama-8b")
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"error: {p.address} (prefill) is not shape llama-8b: layers 2 vs 32" in r.stderr


def test_drive_at_a_models_shape_sizes_requests_in_tokens(serve, kvpush_run) -> None:
    p = serve.start("prefill", *L70B, "--num-blocks", "64")
    d = serve.start("decode", *L70B, "--num-blocks", "64")
    r = kvpush_run(
        "drive", "-p", p.address, "-d", d.address, "--shape", "llama-70b-tp8",
        "--tokens", "100", "-n", "20", "-c", "2", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert (out["ok"], out["verified"]) == (20, 20)
    assert out["bytes_total"] == 20 * 7 * 160 * 4096  # ceil(100 / 16) blocks x 160 x 4 KiB


def test_demo_at_the_mla_shape_with_tp(kvpush_run) -> None:
    r = kvpush_run(
        "demo", "--shape", "mla", "--tp", "2,1", "--requests", "24", "--concurrency", "2",
        "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is True and out["drive"]["verified"] == 24
    assert out["drive"]["bytes_total"] == 24 * 4 * 61 * 64 * 576 * 2  # the whole latent

"""``kvpush drive`` and ``kvpush demo`` end to end against real endpoint processes."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration

SMALL = ["--num-blocks", "64", "--layers", "2", "--block-bytes", "4096"]


def test_drive_json_all_verified(pd_pair, kvpush_run) -> None:
    p, d = pd_pair
    r = kvpush_run("drive", "-p", p.address, "-d", d.address, "-n", "60", "-c", "4", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert (out["requests"], out["ok"], out["failed"], out["verified"]) == (60, 60, 0, 60)
    assert out["all_verified"] is True
    assert out["bytes_total"] == 60 * 4 * 4 * 4096  # requests x blocks x regions x block
    lat = out["latency_s"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert out["by_decode"] == {d.address: 60}


def test_drive_human_summary_with_rate(pd_pair, kvpush_run) -> None:
    p, d = pd_pair
    r = kvpush_run(
        "drive",
        "--prefill",
        p.address,
        "--decode",
        d.address,
        "--requests",
        "20",
        "--rate",
        "100",
        "--blocks",
        "2",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "drive summary"
    assert lines[1].split() == ["requests", "20:", "20", "ok,", "0", "failed"]
    assert lines[-1].split() == ["all", "bytes", "verified", "yes"]


def test_drive_two_decoders_round_robin(pd_pair, serve, kvpush_run) -> None:
    p, d = pd_pair
    d2 = serve.start("decode", *SMALL)
    r = kvpush_run(
        "drive", "-p", p.address, "-d", d.address, "-d", d2.address, "-n", "40", "--json"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # The 8 workers are spread over the two Ds (4 each, closed loop): both take a share.
    by = json.loads(r.stdout)["by_decode"]
    assert set(by) == {d.address, d2.address} and sum(by.values()) == 40, by
    # Each of the 4 workers homed on a D sends its first request there at once (closed loop):
    # at least 4 each. The rest of the split follows the Ds' latencies (a D that just started
    # pays its first handshakes), which a loaded host makes anything.
    assert min(by.values()) >= 4, by


def test_drive_unverified_exits_1(pd_pair, serve, kvpush_run) -> None:
    p, _ = pd_pair
    d = serve.start("decode", *SMALL, "--no-verify")
    r = kvpush_run("drive", "-p", p.address, "-d", d.address, "-n", "10", "--json")
    out = json.loads(r.stdout)
    assert out["ok"] == 10 and out["verified"] == 0 and out["all_verified"] is False
    assert r.returncode == 1


def test_drive_checks_roles_and_pool(pd_pair, kvpush_run) -> None:
    p, d = pd_pair
    r = kvpush_run("drive", "-p", d.address, "-d", p.address, "-n", "1")
    assert r.err_lines == [
        f"error: {d.address} is a decode endpoint, not prefill",
        "hint: give --prefill only prefill endpoints",
    ]
    assert r.returncode == 2
    r = kvpush_run("drive", "-p", p.address, "-d", d.address, "--blocks", "65")
    assert r.err_lines == [
        f"error: --blocks 65 exceeds the pool of {p.address} (64 blocks)",
        "hint: use --blocks 64 or fewer",
    ]
    assert r.returncode == 2


def test_demo_json(kvpush_run) -> None:
    r = kvpush_run("demo", "--requests", "60", "--json", timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is True
    assert out["drive"]["all_verified"] is True and out["drive"]["ok"] == 60
    assert out["extra_decoder_requests"] > 0
    roles = sorted(c["role"] for c in out["children"])
    assert roles == ["decode", "decode", "decode", "prefill"]
    assert all(c["returncode"] == 0 for c in out["children"])
    assert out["workdir"] is None  # logs removed after a clean run


def test_demo_live_view_and_summary(kvpush_run) -> None:
    r = kvpush_run("demo", "--requests", "30", "--decoders", "1", "--live", timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[0] == "demo summary"
    assert r.stdout.rstrip().endswith("demo ok")
    assert "(joined mid-run)" in r.stdout
    assert "Handshakes" in r.stderr  # P's live telemetry was drawn

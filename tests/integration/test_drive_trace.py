"""``drive --trace`` (issue 16, item 5): where each request's time went, both legs on drive's
clock; the phase histograms of each endpoint. Real endpoints on 127.0.0.1."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kvpush.telemetry.phases import CAUSAL, ORDER, P_PHASES
from tests.conftest import SMALL, unused_port
from tests.support.procs import KVPUSH, clean_env

pytestmark = pytest.mark.integration

D_HISTS = {"phase_register", "phase_push_wait", "phase_verify", "phase_answer"}
P_HISTS = {"phase_match_wait", "phase_handshake_wait", "phase_post", "phase_write"}


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_trace_phases_are_ordered_and_add_up_to_the_latency(serve, kvpush_run, tmp_path) -> None:
    mp = unused_port()
    p = serve.start("prefill", *SMALL, "--metrics-port", str(mp))
    d = serve.start("decode", *SMALL)
    trace = tmp_path / "trace.jsonl"
    r = kvpush_run(
        "drive", "-p", p.address, "-d", d.address, "-n", "40", "-c", "4", "--json",
        "--trace", str(trace),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    recs = _records(trace)
    assert sorted(x["index"] for x in recs) == list(range(40))
    for x in recs:
        assert x["outcome"] == "ok" and x["reason"] == "" and "ended_at" not in x
        ph = x["phases"]
        assert list(ph) == [q.value for q in ORDER], x  # every phase, in order
        err = x["clock_error_s"]
        assert 0 <= err < 0.5, x
        causal = [(q.value, ph[q]) for q in CAUSAL]
        assert causal[0][1] >= -err, x  # D allocated after drive sent the request
        for (qa, a), (qb, b) in itertools.pairwise(causal):
            assert b >= a - err, (qa, a, qb, b, x)  # each phase after the one before it
        assert ph["write_done"] >= ph["write_posted"] - err
        # The phases add up to the latency: D's answer is the last of them, then its way back.
        assert ph["answered"] <= x["latency_s"] + err, x
        assert ph["answered"] > 0
    out = json.loads(r.stdout)
    assert list(out["phases"]) == [q.value for q in ORDER]
    for st in out["phases"].values():
        assert st["count"] == 40 and 0 <= st["p50"] <= st["p99"] <= st["max"]
    text = kvpush_run("drive", "-p", p.address, "-d", d.address, "-n", "4", "--trace",
                      str(tmp_path / "t2.jsonl"))  # fmt: skip
    assert text.returncode == 0, text.stdout + text.stderr
    assert "phases (since sent)  d_allocated: p50 " in text.stdout
    assert "answered: p50 " in text.stdout
    # Each endpoint's telemetry times the steps between its phases (-o json, live, Prometheus).
    for e, hists in ((d, D_HISTS), (p, P_HISTS)):
        s = json.loads(kvpush_run("probe", e.address, "--stats", "--json").stdout)
        got = s["stats"]["histograms"]
        assert hists <= set(got), (e.role, sorted(got))
        assert all(got[h]["count"] == 44 for h in hists), {h: got[h]["count"] for h in hists}
    prom = urllib.request.urlopen(f"http://127.0.0.1:{mp}/metrics", timeout=5).read().decode()
    for h in P_HISTS:
        assert f"kvpush_{h}_seconds_count{{" in prom, h


@pytest.mark.slow
def test_a_request_failed_at_a_known_phase_says_so(serve, tmp_path) -> None:
    """P freezes after D's first request: the second is allocated and registered by D, then
    never pushed -- its record ends at push_reg_sent, with the reason."""
    p = serve.start("prefill", *SMALL)
    d = serve.start("decode", *SMALL)
    trace = tmp_path / "trace.jsonl"
    drive = subprocess.Popen(
        [*KVPUSH, "drive", "-p", p.address, "-d", d.address, "-n", "2", "-c", "1",
         "--rate", "0.1", "--timeout", "4", "--json", "--trace", str(trace)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (trace.exists() and trace.read_text().strip()):  # request 0 is done
            assert drive.poll() is None, drive.communicate()
            assert time.monotonic() < deadline, "request 0 never finished"
            time.sleep(0.02)
        p.popen.send_signal(signal.SIGSTOP)  # request 1 is sent ~10 s after request 0
        out, err = drive.communicate(timeout=90)
    finally:
        p.popen.send_signal(signal.SIGCONT)
        if drive.poll() is None:
            drive.kill()
    assert drive.returncode == 1, out + err
    first, second = sorted(_records(trace), key=lambda x: x["index"])
    assert first["outcome"] == "ok", first
    assert second["outcome"] == "failed"
    assert second["ended_at"] == "push_reg_sent", second
    assert second["reason"] in ("deadline", "prefill_unreachable"), second
    assert list(second["phases"])[:2] == ["d_allocated", "push_reg_sent"]
    assert not P_PHASES & set(second["phases"])  # P never matched it
    assert "completion_received" not in second["phases"]
    assert json.loads(out)["failed"] == 1


def test_a_refused_request_ends_before_any_phase(serve, kvpush_run, tmp_path) -> None:
    """No P up: the requests never go out -- 'sent' is where they ended, and why."""
    p = serve.start("prefill", *SMALL)
    d = serve.start("decode", *SMALL)
    trace = tmp_path / "trace.jsonl"
    drive = subprocess.Popen(
        [*KVPUSH, "drive", "-p", p.address, "-d", d.address, "-n", "30", "-c", "1",
         "--rate", "5", "--json", "--trace", str(trace)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (trace.exists() and trace.read_text().strip()):
            assert drive.poll() is None, drive.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        p.stop(signal.SIGKILL)
        out, err = drive.communicate(timeout=90)
    finally:
        if drive.poll() is None:
            drive.kill()
    assert drive.returncode == 1, out + err
    recs = _records(trace)
    assert len(recs) == 30
    unsent = [x for x in recs if x["outcome"] == "failed" and not x["phases"]]
    assert unsent, recs
    for x in unsent:
        assert x["ended_at"] == "sent" and x["reason"] == "prefill_unreachable", x

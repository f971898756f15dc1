"""``kvpush serve-*`` as real processes: ready file, output modes, signals, metrics, settings."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SMALL = ["--num-blocks", "16", "--layers", "1", "--block-bytes", "4096"]


def _lines(s, n: int, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [ln for ln in s.log_text().splitlines() if ln.startswith("{")]
        if len(lines) >= n:
            return lines
        time.sleep(0.1)
    raise AssertionError("no telemetry lines:\n" + s.log_text())


def test_ready_file_json_lines_and_sigterm(serve) -> None:
    s = serve.start("prefill", *SMALL, "--engine-id", "p-test")
    assert set(s.info) >= {"address", "engine_id", "incarnation", "pid", "role"}
    assert s.info["engine_id"] == "p-test"
    assert s.info["role"] == "prefill"
    assert s.info["pid"] == s.proc.pid
    assert s.info["address"].startswith("127.0.0.1:")
    snap = json.loads(_lines(s, 2)[-1])
    assert snap["role"] == "prefill"
    assert snap["engine_id"] == "p-test"
    assert snap["incarnation"] == s.info["incarnation"]
    assert snap["gauges"]["pool_total"] == 16
    assert s.stop(signal.SIGTERM) == 0
    assert not s.ready_file.exists()
    assert "Traceback" not in s.log_text()


def test_sigint_drains_and_exits_0(serve) -> None:
    s = serve.start("decode", *SMALL, output="plain")
    assert s.stop(signal.SIGINT) == 0
    assert "SIGINT received: draining" in s.log_text()


def test_second_signal_forces_exit_130() -> None:
    # Two signals sent back to back to another process may coalesce into one (POSIX does not
    # queue standard signals), so the flag's contract is checked in a process signalling itself.
    code = (
        "import os, signal, time\n"
        "from kvpush.runtime.signals import StopFlag\n"
        "f = StopFlag(); f.install()\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
        "assert f.event.is_set() and f.signame == 'SIGTERM'\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
        "raise SystemExit(0)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 130, p.stderr
    assert p.stderr == "kvpush: second signal: exiting without draining\n"


def test_a_signal_while_the_main_thread_holds_the_flags_lock_does_not_deadlock() -> None:
    """The freeze of issue 16, made deterministic: the signal arrives while the main thread is
    inside ``Event.wait`` (it holds the event's lock there). The handler must not take that
    lock: it returns, and the relay thread sets the flag once the lock is free."""
    code = (
        "import os, signal\n"
        "from kvpush.runtime.signals import StopFlag\n"
        "f = StopFlag(); f.install()\n"
        "with f.event._cond:  # where Event.wait holds it\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    for _ in range(10000):  # the handler runs between these bytecodes\n"
        "        pass\n"
        "    assert f.signame == 'SIGTERM' and not f.event.is_set()\n"
        "assert f.event.wait(10)\n"
        "print('ok')\n"
    )
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the signal handler deadlocked on the flag's lock (the main thread held it)")
    assert p.returncode == 0 and p.stdout == "ok\n", p.stderr


def test_every_signal_handler_of_kvpush_is_the_stop_flags() -> None:
    """The deadlock above was in a second place: the test and bench worker
    ``kvpush.commands.common.node`` set a ``threading.Event`` from its own handler (a CI run's D did
    not stop within 20 s of SIGTERM). Only ``StopFlag`` installs handlers."""
    root = Path(__file__).resolve().parents[2] / "kvpush"
    own = root / "runtime" / "signals.py"
    found = [
        f"{path.relative_to(root.parent)}:{n}"
        for path in sorted(root.rglob("*.py"))
        if path != own
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "signal.signal(" in line
    ]
    assert not found, f"signal handlers outside StopFlag: {found}"


def test_plain_lines(serve) -> None:
    s = serve.start("decode", *SMALL, output="plain")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [ln for ln in s.log_text().splitlines() if " decode " in ln and "pool_free=" in ln]
        if lines:
            break
        time.sleep(0.1)
    assert lines, s.log_text()
    assert "pool_free=16/16" in lines[-1]
    assert s.stop() == 0


def test_force_color_does_not_select_the_live_view(serve, make_env) -> None:
    # rich treats a pipe as a terminal under FORCE_COLOR; kvpush decides with isatty().
    s = serve.start("decode", *SMALL, output=None, env=make_env(FORCE_COLOR="1"))
    deadline = time.monotonic() + 30
    while "pool_free=" not in s.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s.stop() == 0
    assert "pool_free=16/16" in s.log_text()
    assert "Handshakes" not in s.log_text()


def test_live_output_forced_without_a_terminal_says_so_and_prints_lines(serve) -> None:
    # -o live with stderr in a file cannot draw: one warning, then the plain lines (the live
    # view on a real terminal: tests/integration/test_cli_live.py).
    s = serve.start("prefill", *SMALL, output="live")
    time.sleep(1.5)
    assert s.stop() == 0
    text = s.log_text()
    assert text.count("-o live draws on stderr, which is not a terminal here") == 1
    assert "pushes/s=" in text and "Handshakes" not in text


def test_metrics_endpoint(serve, free_port: int) -> None:
    s = serve.start("prefill", *SMALL, "--metrics-port", str(free_port), "--engine-id", "p-metrics")
    assert s.info["metrics"] == f"http://127.0.0.1:{free_port}/metrics"
    with urllib.request.urlopen(s.info["metrics"], timeout=10) as r:
        body = r.read().decode()
    assert 'kvpush_pool_capacity_blocks{engine_id="p-metrics",role="prefill"} 16.0' in body
    assert "kvpush_uptime_seconds" in body
    assert s.stop() == 0


def test_options_env_and_config_reach_the_endpoint(serve, make_env, tmp_path, kvpush_run) -> None:
    cfg = tmp_path / "kvpush.toml"
    cfg.write_text('num_blocks = 24\nkv_layout = "HND"\n[decode]\nhandshake = "full"\n')
    s = serve.start(
        "decode",
        "--config",
        str(cfg),
        "--block-bytes",
        "8192",
        env=make_env(KVPUSH_LAYERS="3", KVPUSH_KV_LAYOUT="NHD", KVPUSH_VERIFY="0"),
    )
    r = kvpush_run("probe", s.address, "--json", "--stats")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    md = out["metadata"]
    assert (md["num_blocks"], md["layers"], md["block_bytes"], md["kv_layout"]) == (
        24,
        3,
        8192,
        "NHD",
    )
    assert out["stats"]["info"]["handshake"] == "full"
    assert s.stop() == 0


def test_model_like_geometry(serve, kvpush_run) -> None:
    s = serve.start(
        "prefill",
        "--num-blocks",
        "8",
        "--layers",
        "2",
        "--block-tokens",
        "16",
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
        "--dtype",
        "float16",
    )
    r = kvpush_run("probe", s.address, "--json", "--stats")
    out = json.loads(r.stdout)
    assert out["metadata"]["block_bytes"] == 16 * 2 * 64 * 2
    assert out["metadata"]["dtype"] == "float16"
    assert out["stats"]["info"]["writer"] == "deferred"  # the blocking one is no serve flag
    assert s.stop() == 0

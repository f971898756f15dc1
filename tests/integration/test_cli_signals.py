"""Clean ends: demo under SIGTERM/SIGHUP/SIGINT, an endpoint whose stdout reader goes away.

Real processes on 127.0.0.1. A demo stopped by a signal exits 130 with its summary, leaves no
child process running and no work directory behind; ``serve-* -o json | head -1`` goes on
serving after ``head`` exits and drains cleanly (exit 0) on SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.procs import KVPUSH, clean_env

pytestmark = pytest.mark.integration

SMALL = ["--num-blocks", "16", "--layers", "1", "--block-bytes", "4096"]


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if text.encode() in cmdline:
            pids.append(int(entry))
    return pids


@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGTERM,
        pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
        pytest.param(signal.SIGINT, marks=pytest.mark.slow),
    ],
    ids=["SIGTERM", "SIGHUP", "SIGINT"],
)
def test_demo_cleans_up_on_a_signal(sig: int) -> None:
    demo = subprocess.Popen(
        [*KVPUSH, "demo", "--requests", "1000000", "--no-live"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
    )
    try:
        assert demo.stderr is not None
        first = demo.stderr.readline()
        m = re.search(r"\(work dir (\S+)\)", first)
        assert m, first
        workdir = m.group(1)
        seen = [first]
        deadline = time.monotonic() + 120
        while "driving" not in seen[-1]:
            assert time.monotonic() < deadline, "".join(seen)
            line = demo.stderr.readline()
            assert line, "".join(seen)
            seen.append(line)
        assert len(_processes_mentioning(workdir)) >= 3  # P and two Ds are running
        demo.send_signal(sig)
        stdout, stderr = demo.communicate(timeout=120)
    finally:
        demo.kill()
    name = signal.Signals(sig).name
    assert demo.returncode == 130, stderr
    assert f"demo: interrupted by {name}: endpoints stopped; work directory removed" in stderr
    assert "Traceback" not in stderr
    assert stdout.splitlines()[0] == "demo summary"
    assert stdout.rstrip().endswith("demo interrupted")
    assert not Path(workdir).exists()
    assert _processes_mentioning(workdir) == []


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_endpoint_survives_a_closed_stdout(tmp_path: Path, kvpush_run, role: str) -> None:
    ready = tmp_path / "ready.json"
    errlog = tmp_path / "stderr.log"
    with open(errlog, "wb") as err:
        ep = subprocess.Popen(
            [*KVPUSH, f"serve-{role}", *SMALL, "--port", "0", "-o", "json", "--interval",
             "0.2", "--ready-file", str(ready)],
            stdout=subprocess.PIPE,
            stderr=err,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        assert ep.stdout is not None
        first = ep.stdout.readline()  # what `| head -1` reads before it exits
        assert json.loads(first)["role"] == role
        ep.stdout.close()
        deadline = time.monotonic() + 60
        while "stdout was closed by its reader" not in errlog.read_text(errors="replace"):
            assert ep.poll() is None, errlog.read_text(errors="replace")
            assert time.monotonic() < deadline, errlog.read_text(errors="replace")
            time.sleep(0.1)
        address = json.loads(ready.read_text())["address"]
        r = kvpush_run("probe", address, "--json")
        assert r.returncode == 0, r.stderr  # still serving
        ep.send_signal(signal.SIGTERM)
        assert ep.wait(60) == 0
    finally:
        ep.kill()
    text = errlog.read_text(errors="replace")
    assert "stopped cleanly" in text
    assert "Traceback" not in text and "BrokenPipe" not in text


def test_endpoint_drains_on_sighup(serve) -> None:
    s = serve.start("decode", *SMALL, output="plain")
    assert s.stop(signal.SIGHUP) == 0
    assert "SIGHUP received: draining" in s.log_text()

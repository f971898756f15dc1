"""``kvpush.commands.common.launch``, the launcher of the demo's endpoints, the bench's workers and
the tests' processes, on real child processes: the ready file is read, an early exit and a timeout
are typed errors, ``stop_all`` leaves nothing running (a child that ignores SIGTERM is killed at
the deadline, after ``before_kill``) and reports the exit statuses; ``child_env`` strips the
operator's ``KVPUSH_*`` and sets plain output. The tests' layer over it
(``tests/support/procs.py``) fails a start with the log and dumps a frozen child's stacks.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvpush.commands.common import launch
from kvpush.errors import KvpushError

PY = sys.executable


def _failed(why: str) -> KvpushError:
    return KvpushError(f"child {why}")


def test_ready_file_and_log(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    code = (
        "import json, os, sys, time\n"
        "print('hello log', flush=True)\n"
        f"open({str(ready)!r} + '.tmp', 'w').write(json.dumps({{'address': 'x:1'}}))\n"
        f"os.replace({str(ready)!r} + '.tmp', {str(ready)!r})\n"
        "time.sleep(60)\n"
    )
    env = launch.child_env(keep_kvpush=False, KVPUSH_X="no", OTHER="yes")
    assert "KVPUSH_X" in env  # extra wins over the filter
    p = launch.spawn([PY, "-c", code], tmp_path / "c.log", env)
    try:
        assert launch.wait_ready_file(p, ready, 30, _failed) == {"address": "x:1"}
    finally:
        assert launch.stop_all([p], launch.terminate, 10) == [-signal.SIGTERM]
    assert "hello log" in (tmp_path / "c.log").read_text()


def test_early_exit_and_timeout_are_errors(tmp_path: Path) -> None:
    p = launch.spawn(
        [PY, "-c", "raise SystemExit(3)"], tmp_path / "a.log", launch.child_env(keep_kvpush=True)
    )
    with pytest.raises(KvpushError, match="exited with status 3 while starting"):
        launch.wait_ready_file(p, tmp_path / "never.json", 30, _failed)
    q = launch.spawn(
        [PY, "-c", "import time; time.sleep(60)"],
        tmp_path / "b.log",
        launch.child_env(keep_kvpush=True),
    )
    try:
        with pytest.raises(KvpushError, match=r"did not start within 0\.3s"):
            launch.wait_ready_file(q, tmp_path / "never.json", 0.3, _failed)
    finally:
        launch.stop_all([q], launch.terminate, 10)
    assert q.poll() is not None


def test_stop_all_kills_what_ignores_the_ask(tmp_path: Path) -> None:
    stubborn = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('armed', flush=True)\n"
        "time.sleep(60)\n"
    )
    log = tmp_path / "s.log"
    p = launch.spawn(
        [PY, "-c", stubborn], log, launch.child_env(keep_kvpush=True), own_session=True
    )
    polite = launch.spawn(
        [PY, "-c", "import time; time.sleep(60)"],
        tmp_path / "p.log",
        launch.child_env(keep_kvpush=True),
    )
    for _ in range(200):  # the handler is installed before the ask
        if "armed" in log.read_text():
            break
        time.sleep(0.05)
    codes = launch.stop_all([p, polite], launch.terminate, 1.0, group=True)
    assert codes == [-signal.SIGKILL, -signal.SIGTERM]


def test_the_tests_launcher_dumps_the_stacks_of_a_process_that_does_not_stop(
    tmp_path: Path,
) -> None:
    """``tests/support/procs.Proc.stop``: a child still running at the deadline gets its
    stacks (``py-spy dump``) appended to its log before the SIGKILL -- a frozen endpoint in any
    suite says where it froze."""
    from tests.support.procs import Proc

    log = tmp_path / "stuck.log"
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('armed', flush=True)\n"
        "def stuck_here():\n"
        "    time.sleep(60)\n"
        "stuck_here()\n"
    )
    popen = launch.spawn([PY, "-c", code], log, launch.child_env(keep_kvpush=True))
    p = Proc(popen=popen, address="127.0.0.1:1", engine_id="", incarnation="", log=log)
    _armed(log)
    assert p.stop(timeout=1.0) == -signal.SIGKILL
    text = log.read_text()
    assert "did not exit within 1s of SIGTERM; py-spy dump before SIGKILL" in text, text
    assert "stuck_here" in text, text


def _armed(log: Path) -> None:
    for _ in range(200):  # the handler is installed before the ask
        if "armed" in log.read_text():
            return
        time.sleep(0.05)


def test_child_env_strips_kvpush_and_sets_plain_output(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPUSH_PORT", "1234")
    monkeypatch.setenv("NO_COLOR", "")
    monkeypatch.setenv("COLUMNS", "80")
    env = launch.child_env(keep_kvpush=False, on_path=True, plain=True, COLUMNS="120")
    assert not [k for k in env if k.startswith("KVPUSH_")]
    assert env["NO_COLOR"] == "1" and env["TERM"] == "dumb" and env["PYTHONUNBUFFERED"] == "1"
    assert env["COLUMNS"] == "120"  # extra wins over the plain defaults
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(launch.ROOT)
    kept = launch.child_env(keep_kvpush=True)
    assert kept["KVPUSH_PORT"] == "1234" and kept["COLUMNS"] == "80" and kept["NO_COLOR"] == ""


def test_stop_reports_the_status_and_calls_before_kill_on_the_live_child(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    stubborn = launch.spawn(
        [
            PY,
            "-c",
            "import signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('armed', flush=True)\n"
            "time.sleep(60)\n",
        ],
        log,
        launch.child_env(keep_kvpush=True),
    )
    _armed(log)
    seen: list[int | None] = []
    rc = launch.stop(stubborn, 0.5, before_kill=lambda p: seen.append(p.poll()))
    assert rc == -signal.SIGKILL
    assert seen == [None]  # the hook ran while the child still ran, once
    polite = launch.spawn(
        [PY, "-c", "import time; time.sleep(60)"],
        tmp_path / "p.log",
        launch.child_env(keep_kvpush=True),
    )
    calls: list[object] = []
    assert launch.stop(polite, 10, launch.sender(signal.SIGHUP), before_kill=calls.append) == (
        -signal.SIGHUP
    )
    assert calls == []
    assert launch.stop(polite, 10) == -signal.SIGHUP  # a child already gone: its status again


def test_the_tests_launcher_fails_a_start_with_the_log_and_kills_a_slow_one(
    tmp_path: Path,
) -> None:
    """``tests/support/procs.launch`` and ``wait_ready``: a child that exits before its ready
    file, or is not ready in time, fails the test with its log; the slow one is not left
    running."""
    from tests.support.procs import launch as launch_proc
    from tests.support.procs import wait_ready

    with pytest.raises(AssertionError, match=r"(?s)bad exited with status 3 while starting:.*boom"):
        launch_proc(
            [PY, "-c", "print('boom', flush=True); raise SystemExit(3)"],
            tmp_path / "bad.ready",
            tmp_path / "bad.log",
        )
    slow = launch_proc(
        [PY, "-c", "print('waiting', flush=True); import time; time.sleep(60)"],
        tmp_path / "slow.ready",
        tmp_path / "slow.log",
        role="prefill",
        wait=False,
    )
    with pytest.raises(AssertionError, match=r"serve-prefill did not start within 0\.5s"):
        wait_ready(slow, 0.5)
    assert slow.popen.poll() == -signal.SIGKILL and slow.returncode == -signal.SIGKILL

"""The one launcher of endpoint processes for tests: real processes, a ready file, a log.

Every test process goes through ``launch``: it starts a command with its output in a log file,
waits until the command has written its ready file (JSON with at least ``address``), and hands
back a ``Proc`` that can be stopped (SIGTERM, then SIGKILL), killed, or read. Two commands are
launched: ``serve_cmd`` -- the operator's ``python -m kvpush serve-prefill|serve-decode``
(CLI suites) -- and ``node_cmd`` -- ``python -m kvpush.ops.node CONFIG_JSON READY`` with knobs
the CLI does not expose (integration and fault suites). ``Launcher`` keeps the processes of one
test or module and stops the live ones at the end.

``start_endpoint(cfg, tmp, name)`` is the node form that ``tests/support/cluster.py`` uses: to
move the fault suites onto ``Launcher`` later is to call ``launch(node_cmd(cfg, ready), ...)``.
Children get ``clean_env``: the caller's environment without ``KVPUSH_*`` (a developer's own
settings must not leak into a test), with ``NO_COLOR`` and a wide ``COLUMNS`` so that output is
stable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KVPUSH = [sys.executable, "-m", "kvpush"]


def dump_stacks(pid: int) -> str:
    """Every thread's Python and native stack of ``pid`` (``py-spy``, a dev dependency), or why
    there is none."""
    spy = Path(sys.executable).with_name("py-spy")
    cmd = [str(spy) if spy.exists() else "py-spy", "dump", "--native", "--pid", str(pid)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(no stack: {e})"
    return (r.stdout + r.stderr).strip()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")}
    env.update({"NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@dataclass
class Proc:
    """One launched process; ``info`` is its ready file (address, engine_id, incarnation...)."""

    popen: subprocess.Popen[bytes]
    address: str
    engine_id: str
    incarnation: str
    log: Path
    extra: dict[str, object] = field(default_factory=dict)
    role: str = ""
    ready_file: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)
    returncode: int | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.popen

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal, wait; SIGKILL after ``timeout``. Returns the exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._dump_stacks(f"did not exit within {timeout:g}s of {signal.Signals(sig).name}")
                self.popen.kill()
                self.popen.wait(10)
        self.returncode = self.popen.returncode
        return self.returncode

    def _dump_stacks(self, why: str) -> None:
        """Append every thread's stack (``py-spy dump --native``) to the log before a SIGKILL:
        a process that froze says where (the log tail is what a failing test prints)."""
        out = dump_stacks(self.popen.pid)
        try:
            with self.log.open("a") as f:
                f.write(f"\n--- test harness: {why}; py-spy dump before SIGKILL ---\n{out}\n")
        except OSError:
            pass

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        self.returncode = self.popen.returncode

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


def serve_cmd(role: str, ready: Path, *args: str, output: str | None = "json") -> list[str]:
    """``kvpush serve-ROLE`` with a ready file, fast telemetry lines and a free port."""
    cmd = [*KVPUSH, f"serve-{role}", "--ready-file", str(ready), "--interval", "0.5"]
    if output is not None:
        cmd += ["-o", output]
    if "--port" not in args:
        cmd += ["--port", "0"]
    return [*cmd, *args]


def node_cmd(cfg: dict[str, object], ready: Path) -> list[str]:
    """The endpoint worker of integration and fault tests (``kvpush.ops.node``)."""
    return [sys.executable, "-m", "kvpush.ops.node", json.dumps(cfg), str(ready)]


def launch(
    cmd: list[str],
    ready: Path,
    log: Path,
    *,
    role: str = "",
    env: dict[str, str] | None = None,
    wait: bool = True,
    timeout: float = 60.0,
) -> Proc:
    """Start ``cmd`` (output appended to ``log``); with ``wait``, return once it is ready."""
    if ready.exists():
        ready.unlink()
    with open(log, "ab") as f:
        popen = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env or clean_env(),
        )
    p = Proc(popen, "", "", "", log, role=role, ready_file=ready)
    if wait:
        wait_ready(p, timeout)
    return p


def wait_ready(p: Proc, timeout: float = 60.0) -> None:
    """Wait for ``p``'s ready file; fail with its log if it exits or takes too long."""
    assert p.ready_file is not None
    what = f"serve-{p.role}" if p.role else p.log.stem
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.ready_file.exists():
            try:
                p.info = json.loads(p.ready_file.read_text())
            except ValueError:  # written atomically by both commands; be lenient anyway
                time.sleep(0.02)
                continue
            p.address = str(p.info["address"])
            p.engine_id = str(p.info.get("engine_id", ""))
            p.incarnation = str(p.info.get("incarnation", ""))
            return
        if p.popen.poll() is not None:
            raise AssertionError(
                f"{what} exited with {p.popen.returncode} before it was ready:\n" + p.log_text()
            )
        time.sleep(0.02)
    p.kill()
    raise AssertionError(f"{what} not ready within {timeout}s:\n" + p.log_text())


def start_endpoint(cfg: dict[str, object], tmp: Path, name: str, timeout: float = 60.0) -> Proc:
    """A node endpoint named ``name`` in ``tmp``, ready (the fault suites' entry point)."""
    ready = tmp / f"{name}.ready"
    return launch(
        node_cmd(cfg, ready),
        ready,
        tmp / f"{name}.log",
        role=str(cfg.get("role", "")),
        env=dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")),
        timeout=timeout,
    )


class Launcher:
    """The processes of one test (or module): ``serve`` and ``node`` start, ``close`` stops."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []

    def serve(
        self,
        role: str,
        *args: str,
        wait: bool = True,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        output: str | None = "json",
    ) -> Proc:
        n = len(self.procs)
        ready = self.tmp / f"{role}-{n}.ready.json"
        p = launch(
            serve_cmd(role, ready, *args, output=output),
            ready,
            self.tmp / f"{role}-{n}.log",
            role=role,
            env=env,
            wait=wait,
            timeout=timeout,
        )
        self.procs.append(p)
        return p

    # The CLI suites' name for ``serve``.
    start = serve

    def node(self, cfg: dict[str, object], name: str, timeout: float = 60.0) -> Proc:
        p = start_endpoint(cfg, self.tmp, name, timeout)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        for p in self.procs:
            p.stop()

"""The tests' commands and conveniences over ``kvpush.commands.common.launch``, the one launcher of
child processes (the demo's and the bench's too): real processes, a ready file, a log.

Every test process goes through ``launch``: it starts a command with its output in a log file
(``launch.spawn``), waits until the command has written its ready file (JSON with at least
``address``; ``launch.wait_ready_file``), and hands back a ``Proc`` that can be stopped (a
signal, then SIGKILL: ``launch.stop_all``, with the child's stacks dumped into its log before
the SIGKILL), killed, or read. A start that fails is an ``AssertionError`` carrying the log.
Two commands are launched: ``serve_cmd`` -- the operator's ``python -m kvpush
serve-prefill|serve-decode`` (CLI suites) -- and ``node_cmd`` -- ``python -m
kvpush.commands.common.node CONFIG_JSON READY`` with knobs the CLI does not expose (integration and
fault suites). ``Launcher`` keeps the processes of one test or module and stops the live ones at the
end; ``start_endpoint(cfg, tmp, name)`` is the node form that ``tests/support/cluster.py`` uses.
Children get ``clean_env``: the caller's environment without ``KVPUSH_*`` (a developer's own
settings must not leak into a test), with ``launch.PLAIN_OUTPUT`` (``NO_COLOR``, a wide
``COLUMNS``) so that output is stable.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.commands.common import launch as _launch

ROOT = _launch.ROOT
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


def dump_stacks_to_log(pid: int, log: Path, why: str) -> None:
    """Append ``pid``'s stacks to ``log`` before a SIGKILL: a process that froze says where
    (the log tail is what a failing test prints)."""
    out = dump_stacks(pid)
    try:
        with log.open("a") as f:
            f.write(f"\n--- test harness: {why}; py-spy dump before SIGKILL ---\n{out}\n")
    except OSError:
        pass


def read_log(log: Path) -> str:
    """The text of a child's log ("" when there is none)."""
    try:
        return log.read_text(errors="replace")
    except OSError:
        return ""


def clean_env(**extra: str) -> dict[str, str]:
    return _launch.child_env(keep_kvpush=False, on_path=True, plain=True, **extra)


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
        """Signal, wait; after ``timeout``, the stacks into the log and SIGKILL. Returns the
        exit status."""
        return stop_procs([self], sig, timeout)[0]

    def kill(self) -> None:
        _launch.kill(self.popen, wait_s=10)
        self.returncode = self.popen.returncode

    def log_text(self) -> str:
        return read_log(self.log)


def stop_procs(
    procs: Sequence[Proc], sig: int = signal.SIGTERM, timeout: float = 20.0
) -> list[int]:
    """Send ``sig`` to each running process, wait for all until one deadline; one still running
    then gets its stacks dumped into its log and a SIGKILL. Returns (and records) the exit
    statuses."""
    by_popen = {p.popen: p for p in procs}
    why = f"did not exit within {timeout:g}s of {signal.Signals(sig).name}"
    codes = _launch.stop_all(
        [p.popen for p in procs],
        _launch.sender(sig),
        timeout,
        before_kill=lambda popen: dump_stacks_to_log(popen.pid, by_popen[popen].log, why),
    )
    out: list[int] = []
    for p, rc in zip(procs, codes, strict=True):
        status = rc if rc is not None else p.popen.wait(10)
        p.returncode = status
        out.append(status)
    return out


def serve_cmd(role: str, ready: Path, *args: str, output: str | None = "json") -> list[str]:
    """``kvpush serve-ROLE`` with a ready file, fast telemetry lines and a free port."""
    cmd = [*KVPUSH, f"serve-{role}", "--ready-file", str(ready), "--interval", "0.5"]
    if output is not None:
        cmd += ["-o", output]
    if "--port" not in args:
        cmd += ["--port", "0"]
    return [*cmd, *args]


def node_cmd(cfg: dict[str, object], ready: Path) -> list[str]:
    """The endpoint worker of integration and fault tests (``kvpush.commands.common.node``)."""
    return [sys.executable, "-m", "kvpush.commands.common.node", json.dumps(cfg), str(ready)]


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
    ready.unlink(missing_ok=True)
    popen = _launch.spawn(cmd, log, env or clean_env(), cwd=ROOT)
    p = Proc(popen, "", "", "", log, role=role, ready_file=ready)
    if wait:
        wait_ready(p, timeout)
    return p


#: read(2)'s syscall number, as ``/proc/PID/syscall`` shows it, per machine.
_READ_SYSCALL = {"x86_64": 0, "aarch64": 63}


def wait_reading_stdin(proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    """Return once ``proc``'s main thread is blocked reading its stdin (``/proc/PID/syscall``):
    what is piped in next is read at once, not after the process's start-up, however loaded the
    host. (On a machine whose read(2) number is not known here, it returns at once.)"""
    nr = _READ_SYSCALL.get(os.uname().machine)
    if nr is None:
        return
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"pid {proc.pid} exited {proc.returncode} before reading stdin")
        try:
            fields = Path(f"/proc/{proc.pid}/syscall").read_text().split()
        except OSError:
            fields = []
        if len(fields) >= 2 and fields[0] == str(nr) and int(fields[1], 16) == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {proc.pid} did not read its stdin within {timeout}s")
        time.sleep(0.02)


def wait_ready(p: Proc, timeout: float = 60.0) -> None:
    """Wait for ``p``'s ready file; fail with its log if it exits or takes too long (and then
    kill it)."""
    assert p.ready_file is not None
    what = f"serve-{p.role}" if p.role else p.log.stem

    def failed(why: str) -> AssertionError:
        p.kill()  # not ready in time: leave nothing running (a no-op once it has exited)
        return AssertionError(f"{what} {why}:\n" + p.log_text())

    p.info = _launch.wait_ready_file(p.popen, p.ready_file, timeout, failed)
    p.address = str(p.info["address"])
    p.engine_id = str(p.info.get("engine_id", ""))
    p.incarnation = str(p.info.get("incarnation", ""))


def start_endpoint(cfg: dict[str, object], tmp: Path, name: str, timeout: float = 60.0) -> Proc:
    """A node endpoint named ``name`` in ``tmp``, ready (the fault suites' entry point). It keeps
    the caller's ``KVPUSH_*`` settings and output (unlike ``clean_env``)."""
    ready = tmp / f"{name}.ready"
    return launch(
        node_cmd(cfg, ready),
        ready,
        tmp / f"{name}.log",
        role=str(cfg.get("role", "")),
        env=_launch.child_env(keep_kvpush=True, on_path=True),
        timeout=timeout,
    )


@contextlib.contextmanager
def endpoints(tmp: Path, pool: Mapping[str, object]) -> Iterator[Callable[..., Proc]]:
    """``start(role, name, **cfg)``: node endpoints of this ``pool`` in ``tmp``; on exit each is
    stopped and must have exited 0 (its log in the failure)."""
    procs: list[Proc] = []

    def start(role: str, name: str, **extra: object) -> Proc:
        cfg: dict[str, object] = {"role": role, "pool": dict(pool)}
        cfg.update(extra)
        p = start_endpoint(cfg, tmp, name)
        procs.append(p)
        return p

    yield start
    for p in procs:
        rc = p.stop()
        assert rc == 0, f"{p.address} exited {rc}:\n{p.log_text()}"


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
        """SIGTERM every live process, wait for all of them (20 s), SIGKILL the rest."""
        stop_procs(self.procs)

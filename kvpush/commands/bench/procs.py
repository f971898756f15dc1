"""Orchestrator side of the bench workers: start them, talk to them, always stop them.

``Cluster`` is a context manager that owns every worker process it starts and kills any that is
still alive on exit (normal or not): a benchmark never leaves a process behind. ``Worker.call``
sends one command and waits for its answer; ``Worker.call_async`` returns a ``Future``. One
reader thread per worker resolves the futures from the worker's stdout; stderr goes to a log
file in the run directory (read it when a worker fails: the error names it). Processes are
started and stopped by ``kvpush.commands.common.launch``, the launcher the demo's endpoints go
through too.

Threads: the caller's, and one reader thread per worker.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar, overload

from kvpush.commands.bench.loadgen import EndpointInfo
from kvpush.commands.bench.rpc import BenchError as BenchError  # the bench's error, re-exported
from kvpush.commands.bench.rpc import LineRpc
from kvpush.commands.common import launch

R = TypeVar("R")


class Worker(LineRpc):
    """One ``python -m kvpush.commands.bench.worker`` process and its commands."""

    def __init__(self, name: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        e = launch.child_env(keep_kvpush=True, on_path=True)
        e.setdefault("NIXL_LOG_LEVEL", "WARN")
        if env:
            e.update(env)
        popen = launch.spawn(
            [sys.executable, "-m", "kvpush.commands.bench.worker"],
            log_path,
            e,
            piped=True,
            own_session=True,  # Ctrl+C in the terminal reaches the orchestrator only
            cwd=launch.ROOT,
        )
        super().__init__(popen, log_path, f"worker {name}")
        self.info: EndpointInfo | None = None  # start_endpoint's reply

    def wait_started(self, timeout_s: float = 60.0) -> None:
        self.started(timeout_s, reply=object)

    @overload
    def call(self, cmd: str, call_timeout: float = ..., *, reply: type[R], **args: object) -> R: ...
    @overload
    def call(self, cmd: str, call_timeout: float = ..., **args: object) -> object: ...
    def call(
        self, cmd: str, call_timeout: float = 120.0, *, reply: type[R] | object = object,
        **args: object,
    ) -> R | object:  # fmt: skip
        """``cmd``'s answer, read as ``reply`` (``LineRpc.call_async``)."""
        return self.result(self.call_async(cmd, reply=reply, **args), call_timeout, cmd)

    # ------------------------------------------------------------------ lifecycle
    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to stop its endpoint and exit; kill it if it does not in time."""
        if self.popen.poll() is None:
            self.call_async("stop")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout_s)
        self.kill()

    def kill(self) -> None:
        launch.kill(self.popen, group=True)
        for s in (self.popen.stdin, self.popen.stdout):
            try:
                if s is not None:
                    s.close()
            except OSError:
                pass

    @property
    def address(self) -> str:
        if self.info is None:
            raise BenchError(f"worker {self.name} hosts no endpoint", "start_endpoint first")
        return self.info["address"]

    @property
    def pid(self) -> int:
        return int(self.popen.pid)


class Cluster:
    """Starts workers in a run directory; stops and, failing that, kills all of them on exit."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.workers: list[Worker] = []

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, name: str, env: dict[str, str] | None = None) -> Worker:
        w = Worker(name, self.run_dir / f"{name}.log", env)
        self.workers.append(w)
        return w

    def endpoints(
        self, specs: Mapping[str, Mapping[str, object]], timeout_s: float = 90.0
    ) -> dict[str, Worker]:
        """Start one endpoint worker per ``name -> EndpointConfig dict``, in parallel."""
        ws = {name: self.spawn(name) for name in specs}
        futs = {}
        for name, w in ws.items():
            w.wait_started(timeout_s)
            futs[name] = w.call_async("start_endpoint", reply=EndpointInfo, config=specs[name])
        for name, f in futs.items():
            ws[name].info = ws[name].result(f, timeout_s, "start_endpoint")
        return ws

    def stop(self, w: Worker) -> None:
        w.stop()
        if w in self.workers:
            self.workers.remove(w)

    def close(self) -> None:
        ws, self.workers = self.workers, []
        by_proc = {id(w.popen): w for w in ws}
        launch.stop_all(
            [w.popen for w in ws], lambda p: by_proc[id(p)].call_async("stop"), 10, group=True
        )
        for w in ws:
            w.kill()

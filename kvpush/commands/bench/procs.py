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
import itertools
import json
import subprocess
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kvpush.commands.common import launch
from kvpush.errors import KvpushError

if TYPE_CHECKING:
    from kvpush.commands.bench.loadgen import EndpointInfo


class BenchError(KvpushError):
    """A benchmark worker failed or a scenario could not run."""


class Worker:
    def __init__(self, name: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        e = launch.child_env(keep_kvpush=True, on_path=True)
        e.setdefault("NIXL_LOG_LEVEL", "WARN")
        if env:
            e.update(env)
        self.popen = launch.spawn(
            [sys.executable, "-m", "kvpush.commands.bench.worker"],
            log_path,
            e,
            piped=True,
            own_session=True,  # Ctrl+C in the terminal reaches the orchestrator only
            cwd=launch.ROOT,
        )
        self._ids = itertools.count(1)
        self._futs: dict[int, Future[object]] = {0: Future()}
        self._lock = threading.Lock()
        self._wlock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"bench-{name}", daemon=True)
        self._reader.start()
        self.info: EndpointInfo | None = None  # start_endpoint's reply

    # ------------------------------------------------------------------ protocol
    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            with self._lock:
                fut = self._futs.pop(msg.get("id"), None)
            if fut is None:
                continue
            if msg.get("ok"):
                fut.set_result(msg.get("result"))
            else:
                fut.set_exception(
                    BenchError(
                        f"worker {self.name}: {msg.get('error')}",
                        f"see {self.log_path}",
                    )
                )
        with self._lock:
            futs, self._futs = list(self._futs.values()), {}
        for f in futs:
            if not f.done():
                f.set_exception(
                    BenchError(
                        f"worker {self.name} exited ({self.popen.poll()})", f"see {self.log_path}"
                    )
                )

    def wait_started(self, timeout_s: float = 60.0) -> None:
        with self._lock:
            f = self._futs.get(0)
        if f is not None:
            self._result(f, timeout_s, "start")

    # A reply is the worker's JSON as parsed, untyped (the one boundary where it is): each caller
    # reads it as the reply's TypedDict, declared beside the command in the worker's modules.
    def call_async(self, cmd: str, **args: object) -> Future[Any]:
        mid = next(self._ids)
        fut: Future[object] = Future()
        with self._lock:
            if self.popen.poll() is not None:
                fut.set_exception(
                    BenchError(f"worker {self.name} is not running", f"see {self.log_path}")
                )
                return fut
            self._futs[mid] = fut
        line = json.dumps({"id": mid, "cmd": cmd, "args": args}) + "\n"
        try:
            with self._wlock:
                assert self.popen.stdin is not None
                self.popen.stdin.write(line.encode())
                self.popen.stdin.flush()
        except OSError as e:
            with self._lock:
                self._futs.pop(mid, None)
            fut.set_exception(BenchError(f"worker {self.name}: cannot send {cmd}: {e}"))
        return fut

    def call(self, cmd: str, call_timeout: float = 120.0, **args: object) -> Any:
        return self._result(self.call_async(cmd, **args), call_timeout, cmd)

    def _result(self, fut: Future[object], timeout_s: float, what: str) -> object:
        try:
            return fut.result(timeout_s)
        except FutTimeout:
            raise BenchError(
                f"worker {self.name}: {what} did not answer in {timeout_s:g}s",
                f"see {self.log_path}",
            ) from None

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
            futs[name] = w.call_async("start_endpoint", config=specs[name])
        for name, f in futs.items():
            ws[name].info = cast("EndpointInfo", ws[name]._result(f, timeout_s, "start_endpoint"))
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

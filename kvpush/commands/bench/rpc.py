"""A child process that answers JSON-lines commands by id: ``LineRpc`` (the bench's workers and
``bench peer``'s vLLM drivers).

The child writes ``{"id": N, "ok": true, "result": ...}`` or ``{"id": N, "ok": false, "error":
...}`` lines on its stdout (id 0: its start-up, unasked); other lines are ignored. One reader
thread resolves each caller's future; when the child's stdout ends, every caller still waiting
gets a ``BenchError`` naming the exit status and the child's log. Threads: any thread may call;
the reader thread is the object's own.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutTimeout
from pathlib import Path
from typing import TypeVar, cast, overload

from kvpush.errors import KvpushError

R = TypeVar("R")


class BenchError(KvpushError):
    """A benchmark worker failed or a scenario could not run."""


class LineRpc:
    """Commands to ``popen`` (stdin/stdout piped) and their answers; ``label`` names it in
    errors (``worker p``, ``vLLM D driver``), each with a hint to ``log_path``."""

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path, label: str) -> None:
        self.popen = popen
        self.log_path = log_path
        self.label = label
        self._ids = itertools.count(1)
        self._started: Future[object] = Future()  # id 0: the child's start-up answer
        self._futs: dict[int, Future[object]] = {0: self._started}
        self._lock = threading.Lock()
        self._wlock = threading.Lock()
        threading.Thread(target=self._read, name=f"bench-{label}", daemon=True).start()

    def error(self, what: str) -> BenchError:
        return BenchError(f"{self.label}: {what}", f"see {self.log_path}")

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
                fut.set_exception(self.error(f"{msg.get('error')}"))
        with self._lock:
            futs, self._futs = list(self._futs.values()), {}
        for f in futs:
            if not f.done():
                f.set_exception(self.error(f"exited ({self.popen.poll()})"))

    # A reply is the child's JSON as parsed, untyped: ``reply`` names the TypedDict (or plain
    # type) it is read as, declared beside the command on the child's side. This is the one
    # boundary where the parsed JSON gets its type; without ``reply`` the answer is an ``object``
    # (waited for, or passed on, never read).
    @overload
    def call_async(self, cmd: str, *, reply: type[R], **args: object) -> Future[R]: ...
    @overload
    def call_async(self, cmd: str, **args: object) -> Future[object]: ...
    def call_async(
        self, cmd: str, *, reply: type[R] | object = object, **args: object
    ) -> Future[R] | Future[object]:
        mid = next(self._ids)
        fut: Future[object] = Future()
        with self._lock:
            if self.popen.poll() is not None:
                fut.set_exception(self.error("is not running"))
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
            fut.set_exception(self.error(f"cannot send {cmd}: {e}"))
        return cast("Future[R]", fut)  # the one place an answer gets its type: ``reply``

    def result(self, fut: Future[R], timeout_s: float, what: str) -> R:
        try:
            return fut.result(timeout_s)
        except FutTimeout:
            raise self.error(f"{what} did not answer in {timeout_s:g}s") from None

    def started(self, timeout_s: float, reply: type[R]) -> R:
        """The child's start-up answer (id 0), once it came, read as ``reply``."""
        return self.result(cast("Future[R]", self._started), timeout_s, "start-up")

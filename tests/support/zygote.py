"""A zygote for many ``kvpush serve-*`` processes: kvpush imported once, then forked.

Usage: ``python -m tests.support.zygote`` (``Zygote`` below starts and talks to it). A cold
``python -m kvpush serve-decode`` costs about a second of CPU in imports (2.5 s while it still
imported torch); the freeze
stress test SIGTERMs 200 endpoint processes, which cold would need more CPU than this 2-core
host gives in three minutes. The zygote imports what ``serve`` imports, starts no thread and no
NIXL agent, and for each request forks a child that runs the operator's own entry point
(``kvpush.cli.app.run`` with the given arguments) with stdout and stderr on a log file: the
child is a real ``kvpush serve-*`` process from ``main()`` on (its own signal handlers, NIXL
agents, side channel and exit path).

Protocol: ``ready`` once imported; then one JSON line per child on stdin (``{"argv": [...],
"log": PATH}``), answered with ``spawned PID``; every child's end is reported as ``exited PID
STATUS MONOTONIC`` (a negative status: killed by that signal); on stdin's end the zygote kills
what is left and exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from queue import Queue

from tests.support.procs import ROOT, clean_env


def _child(argv: list[str], log: str) -> None:
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        sys.argv = ["kvpush", *argv]
        from kvpush.cli.app import run

        run()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def main() -> int:
    # What serve imports, before any fork; no thread, no agent, no ZMQ context.
    import kvpush.cli.app
    import kvpush.commands.serve.command
    import kvpush.endpoint  # noqa: F401

    children: set[int] = set()
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    buf = b""
    eof = False
    while not eof or children:
        ready, _, _ = select.select([] if eof else [sys.stdin], [], [], 0.02)
        if ready:
            data = os.read(sys.stdin.fileno(), 65536)
            if not data:
                eof = True
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                out.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req["argv"], req["log"])
                children.add(pid)
                out.write(f"spawned {pid}\n")
                out.flush()
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            out.write(f"exited {pid} {code} {time.monotonic()}\n")
            out.flush()
    return 0


class Zygote:
    """The test's side: start the zygote, spawn endpoints, learn when and how they ended."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=clean_env(),
            text=True,
        )
        self._spawned: Queue[int] = Queue()
        self._lock = threading.Lock()
        self.exits: dict[int, tuple[int, float]] = {}  # pid -> (status, monotonic time)
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()  # once kvpush and torch are imported
        if first.strip() != "ready":
            self.proc.kill()
            raise AssertionError(f"the zygote did not start: {first!r}")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            words = line.split()
            if words[:1] == ["spawned"]:
                self._spawned.put(int(words[1]))
            elif words[:1] == ["exited"]:
                with self._lock:
                    self.exits[int(words[1])] = (int(words[2]), float(words[3]))

    def spawn(self, argv: list[str], log: Path) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return self._spawned.get(timeout=60)

    def exit_of(self, pid: int) -> tuple[int, float] | None:
        with self._lock:
            return self.exits.get(pid)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())

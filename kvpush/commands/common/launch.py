"""The one way kvpush starts and stops child processes: the demo's endpoints, the bench's
workers and every process the test suites launch (``tests/support/procs.py`` adds only the
tests' commands and conveniences on top).

``spawn`` starts a command with its output in a log file (stderr only when the caller reads the
child's stdout as a protocol), optionally in a session of its own (a terminal's Ctrl-C then
reaches the parent only, and ``kill`` takes the child's whole process group). ``child_env``
is the environment children get: the caller's, with or without the operator's ``KVPUSH_*``
settings, this checkout first on ``PYTHONPATH`` when asked, and ``PLAIN_OUTPUT`` (no colour, a
fixed wide terminal, unbuffered) when the output is for a log or a program to read.
``stop_all`` asks every child to stop, waits for all of them against one deadline and kills
those still running (``before_kill`` sees each first: the tests dump its stacks there);
nothing is left behind, however the caller ends, and the exit statuses come back. ``stop`` is
the same for one child; ``terminate`` and ``sender(sig)`` are the usual asks.
``wait_ready_file`` polls for the JSON ready file a child writes once it serves.

Runs on the caller's thread; owns no thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
"""The checkout (or installation) this kvpush runs from."""

Popen = subprocess.Popen[bytes]


PLAIN_OUTPUT: Mapping[str, str] = {
    "NO_COLOR": "1",
    "COLUMNS": "200",
    "TERM": "dumb",
    "PYTHONUNBUFFERED": "1",
}
"""A child's output for a log or a program, not a person: no colour, one wide fixed width, no
terminal tricks, each line written as it comes."""


def child_env(
    *, keep_kvpush: bool, on_path: bool = False, plain: bool = False, **extra: str
) -> dict[str, str]:
    """The caller's environment for a child: without ``KVPUSH_*`` unless ``keep_kvpush`` (an
    operator's own settings are for their endpoints, not a tool's children), with
    ``PLAIN_OUTPUT`` when ``plain``, this kvpush first on ``PYTHONPATH`` when ``on_path``, then
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if keep_kvpush or not k.startswith("KVPUSH_")}
    if plain:
        env.update(PLAIN_OUTPUT)
    if on_path:
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def spawn(
    cmd: Sequence[str],
    log_path: Path,
    env: dict[str, str],
    *,
    piped: bool = False,
    own_session: bool = False,
    cwd: Path | None = None,
) -> Popen:
    """Start ``cmd`` with its output appended to ``log_path``. ``piped``: the caller talks to
    the child over its stdin and stdout (only stderr goes to the log); else stdin is empty and
    stdout and stderr go to the log. ``own_session``: the child leads a process group of its
    own (``kill`` then takes the group)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(cmd),
            stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
            stdout=subprocess.PIPE if piped else log,
            stderr=log if piped else subprocess.STDOUT,
            cwd=None if cwd is None else str(cwd),
            env=env,
            start_new_session=own_session,
        )


def kill(proc: Popen, group: bool = False, wait_s: float = 5.0) -> int | None:
    """SIGKILL ``proc`` (its whole process group when ``group``) and reap it; its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
    return proc.poll()


def stop_all(
    procs: Sequence[Popen],
    ask: Callable[[Popen], object],
    timeout_s: float,
    group: bool = False,
    before_kill: Callable[[Popen], object] | None = None,
) -> list[int | None]:
    """``ask`` every running child to stop, wait for them all until one deadline, then ``kill``
    the rest, each after ``before_kill`` (while it still runs: a stack dump, a note in its log).
    Returns the exit statuses, in order (a negative signal number for a killed child; None only
    for one that not even SIGKILL ended in time)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                ask(p)
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if before_kill is not None:
                before_kill(p)
            codes.append(kill(p, group))
    return codes


def stop(
    proc: Popen,
    timeout_s: float,
    ask: Callable[[Popen], object] | None = None,
    *,
    group: bool = False,
    before_kill: Callable[[Popen], object] | None = None,
) -> int | None:
    """``stop_all`` for one child (``ask`` defaults to ``terminate``): its exit status."""
    return stop_all([proc], ask or terminate, timeout_s, group, before_kill)[0]


def terminate(proc: Popen) -> None:
    """The polite ``ask`` of ``stop_all``: SIGTERM (a kvpush endpoint drains and exits 0)."""
    proc.send_signal(signal.SIGTERM)


def sender(sig: int) -> Callable[[Popen], None]:
    """The ``ask`` that sends ``sig`` (``terminate`` is ``sender(SIGTERM)``)."""

    def ask(proc: Popen) -> None:
        proc.send_signal(sig)

    return ask


def wait_ready_file(
    proc: Popen,
    ready_path: Path,
    timeout_s: float,
    failed: Callable[[str], Exception],
    cancelled: Callable[[], None] = lambda: None,
) -> dict[str, object]:
    """Poll until ``proc`` has written its JSON ready file and return it. Raises
    ``failed(why)`` if the child exits first or ``timeout_s`` passes (a ``KvpushError`` for the
    operator's tools, an ``AssertionError`` with the log for the tests); ``cancelled`` is called
    on each turn and may raise to give up early."""
    deadline = time.monotonic() + timeout_s
    while True:
        if ready_path.exists():
            try:
                info: dict[str, object] = json.loads(ready_path.read_text())
                return info
            except (OSError, ValueError):
                pass  # written atomically, but be lenient
        cancelled()
        rc = proc.poll()
        if rc is not None:
            raise failed(f"exited with status {rc} while starting")
        if time.monotonic() > deadline:
            raise failed(f"did not start within {timeout_s:g}s")
        time.sleep(0.05)

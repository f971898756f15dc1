"""A terminal for tests: a command on a pseudo-terminal of a given size, read by pyte.

``Terminal(cmd, cols, rows)`` starts ``cmd`` with its stdin, stdout and stderr on the slave side
of a pty of that size (so ``isatty()`` is true, as for an operator), feeds everything it writes
into a ``pyte`` screen, and shows what an operator would see: ``display()`` (the rows of the
screen) after ``pump()``. ``resize(cols, rows)`` changes the window size as a terminal emulator
does (the kernel sends SIGWINCH to the child). Runs on the test's thread; no threads here.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable

import pyte


def _set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Terminal:
    def __init__(self, cmd: list[str], cols: int, rows: int, env: dict[str, str]) -> None:
        self.screen = pyte.Screen(cols, rows)
        self.stream = pyte.ByteStream(self.screen)
        self.master, slave = os.openpty()
        _set_size(slave, cols, rows)
        env = {**env, "TERM": "xterm-256color"}
        env.pop("COLUMNS", None)
        env.pop("LINES", None)
        self.proc = subprocess.Popen(
            cmd,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,  # the pty becomes its controlling terminal: SIGWINCH on resize
        )
        os.close(slave)
        self.raw = b""

    def pump(self, seconds: float) -> None:
        """Read what the child writes for ``seconds`` into the screen."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            r, _, _ = select.select([self.master], [], [], min(left, 0.05))
            if not r:
                continue
            try:
                data = os.read(self.master, 65536)
            except OSError:  # the child closed the pty
                return
            if not data:
                return
            self.raw += data
            self.stream.feed(data)

    def wait_for(self, pred: Callable[[list[str]], bool], timeout_s: float) -> list[str]:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.pump(0.2)
            if pred(self.display()):
                return self.display()
        raise AssertionError("screen never matched:\n" + "\n".join(self.display()))

    def display(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def text(self) -> str:
        return "\n".join(self.display())

    def resize(self, cols: int, rows: int) -> None:
        self.screen.resize(rows, cols)
        _set_size(self.master, cols, rows)

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + 20
            while self.proc.poll() is None and time.monotonic() < end:
                self.pump(0.1)
            if self.proc.poll() is None:
                self.proc.kill()
        rc = self.proc.wait(10)
        os.close(self.master)
        return rc

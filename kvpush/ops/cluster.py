"""The demo's child endpoints: ``python -m kvpush serve-*`` processes in one work directory.

Owns ``Cluster``: spawn children with ``--port 0 --ready-file`` in the demo's own process group
(``kill -- -PGID`` reaches them all; a terminal's Ctrl-C or hang-up reaches them too, which
drains them), wait until each is ready (``cancelled`` interrupts the wait), stop them all with
SIGTERM then SIGKILL. Children get the environment without the operator's ``KVPUSH_*``
settings. Runs on the demo's threads (spawning is locked).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.errors import ExitStatus, KvpushError

if TYPE_CHECKING:
    from kvpush.ops.demo import DemoConfig


class DemoInterrupted(KvpushError):
    """The demo was cancelled (a signal) while it was still starting its endpoints."""

    exit_status = ExitStatus.INTERRUPTED


@dataclass
class Child:
    name: str
    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_path: Path
    info: dict[str, Any] = field(default_factory=dict)
    returncode: int | None = None

    @property
    def address(self) -> str:
        return str(self.info.get("address", ""))

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])


def _child_env() -> dict[str, str]:
    # The operator's KVPUSH_* settings (a --config file, a port...) are for their own
    # endpoints, not the demo's: children get exactly the options the demo passes.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Cluster:
    """Child endpoint processes, their logs and ready files in one work directory."""

    def __init__(self, cfg: DemoConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.children: list[Child] = []
        self._lock = threading.Lock()
        self.cancelled = threading.Event()

    def _layout_flags(self) -> list[str]:
        """A latent (MLA) shape: one region per layer, the latent replicated on every rank."""
        if not self.cfg.shape:
            return []
        from kvpush.memory.shapes import get_shape

        if get_shape(self.cfg.shape).layout != "latent":
            return []
        return ["--kv-layout", "MLA", "--kv-regions", "per-layer"]

    def spawn(self, role: str, name: str, tp: int = 1) -> Child:
        ready = self.workdir / f"{name}.ready.json"
        log_path = self.workdir / f"{name}.log"
        cmd = [
            self.cfg.python,
            "-m",
            "kvpush",
            f"serve-{role}",
            "--port",
            "0",
            "--engine-id",
            name,
            "--num-blocks",
            str(self.cfg.num_blocks),
            "--layers",
            str(self.cfg.layers),
            "--block-tokens",
            str(self.cfg.block_tokens),
            "--kv-heads",
            str(self.cfg.kv_heads),
            "--head-dim",
            str(self.cfg.head_dim),
            "--dtype",
            "bfloat16",
            "--tp",
            str(tp),
            *self._layout_flags(),
            "--ready-file",
            str(ready),
            "--output",
            "json",
            "--interval",
            "1",
            "--log-level",
            "info",
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_child_env(),
            )
        child = Child(name, role, proc, log_path, ready)
        with self._lock:
            self.children.append(child)
        return child

    def wait_ready(self, child: Child, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.cfg.start_timeout_s)
        while True:
            if child.ready_path.exists():
                try:
                    child.info = json.loads(child.ready_path.read_text())
                    return
                except (OSError, ValueError):
                    pass  # written atomically, but be lenient
            if self.cancelled.is_set():
                raise DemoInterrupted(
                    f"demo interrupted while {child.name} was starting", "nothing was driven"
                )
            rc = child.proc.poll()
            if rc is not None:
                child.returncode = rc
                raise KvpushError(
                    f"demo endpoint {child.name} exited with status {rc} while starting: "
                    f"{child.log_tail(1)}",
                    f"see its log: {child.log_path}",
                )
            if time.monotonic() > deadline:
                raise KvpushError(
                    f"demo endpoint {child.name} did not start within "
                    f"{timeout_s or self.cfg.start_timeout_s:g}s",
                    f"see its log: {child.log_path}",
                )
            time.sleep(0.05)

    def stop_all(self, timeout_s: float = 20.0) -> None:
        with self._lock:
            children = list(self.children)
        for c in children:
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in children:
            try:
                c.returncode = c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
                c.returncode = -signal.SIGKILL

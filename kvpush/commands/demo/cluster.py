"""The demo's child endpoints: ``python -m kvpush serve-*`` processes in one work directory.

Owns ``Cluster``: spawn children with ``--port 0 --ready-file`` in the demo's own process group
(``kill -- -PGID`` reaches them all; a terminal's Ctrl-C or hang-up reaches them too, which
drains them), wait until each is ready (``cancelled`` interrupts the wait), stop them all with
SIGTERM then SIGKILL (``kvpush.commands.common.launch``, the launcher the bench's workers go through
too). Children get the environment without the operator's ``KVPUSH_*`` settings. Runs on the demo's
threads (spawning is locked).
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.commands.common import launch
from kvpush.config import Role
from kvpush.errors import ExitStatus, KvpushError

if TYPE_CHECKING:
    from kvpush.commands.demo.config import DemoConfig


class DemoInterrupted(KvpushError):
    """The demo was cancelled (a signal) while it was still starting its endpoints."""

    exit_status = ExitStatus.INTERRUPTED


@dataclass
class Child:
    name: str
    role: Role
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_path: Path
    info: dict[str, object] = field(default_factory=dict)
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

    def spawn(self, role: Role, name: str, tp: int = 1) -> Child:
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
            *self.cfg.model.options(),
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
        log_path.unlink(missing_ok=True)  # a fresh log per run
        # The operator's KVPUSH_* settings (a --config file, a port...) are for their own
        # endpoints, not the demo's: children get exactly the options the demo passes.
        env = launch.child_env(keep_kvpush=False, PYTHONUNBUFFERED="1")
        proc = launch.spawn(cmd, log_path, env)
        child = Child(name, role, proc, log_path, ready)
        with self._lock:
            self.children.append(child)
        return child

    def wait_ready(self, child: Child, timeout_s: float | None = None) -> None:
        def failed(why: str) -> KvpushError:
            child.returncode = child.proc.poll()
            if child.returncode is None:
                return KvpushError(
                    f"demo endpoint {child.name} {why}", f"see its log: {child.log_path}"
                )
            return KvpushError(
                f"demo endpoint {child.name} {why}: {child.log_tail(1)}",
                f"see its log: {child.log_path}",
            )

        def cancelled() -> None:
            if self.cancelled.is_set():
                raise DemoInterrupted(
                    f"demo interrupted while {child.name} was starting", "nothing was driven"
                )

        child.info = launch.wait_ready_file(
            child.proc,
            child.ready_path,
            timeout_s or self.cfg.start_timeout_s,
            failed,
            cancelled,
        )

    def stop_all(self, timeout_s: float = 20.0) -> None:
        with self._lock:
            children = list(self.children)
        codes = launch.stop_all([c.proc for c in children], launch.terminate, timeout_s)
        for c, rc in zip(children, codes, strict=True):
            c.returncode = rc

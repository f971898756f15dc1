"""Start and stop real endpoint processes for integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    address: str
    engine_id: str
    incarnation: str
    log: Path
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def stop(self, timeout: float = 15.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


def start_endpoint(cfg: dict[str, object], tmp: Path, name: str, timeout: float = 30.0) -> Proc:
    ready = tmp / f"{name}.ready"
    log = tmp / f"{name}.log"
    if ready.exists():
        ready.unlink()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with open(log, "ab") as lf:
        p = subprocess.Popen(
            [sys.executable, "-m", "kvpush.ops.node", json.dumps(cfg), str(ready)],
            cwd=ROOT,
            stdout=lf,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            p.kill()
            raise RuntimeError(f"{name} did not start in {timeout}s:\n{log.read_text()}")
        time.sleep(0.02)
    info = json.loads(ready.read_text())
    return Proc(p, info["address"], info["engine_id"], info["incarnation"], log)

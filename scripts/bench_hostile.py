#!/usr/bin/env python3
"""Benchmark: what a flood of well-formed hostile side-channel messages costs a running drive.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_hostile.py [--requests 300] [--kinds ...]

For each flood kind a fresh P/D pair (``kvpush serve-*`` on 127.0.0.1, small geometry) is
started; after a 50-request warm-up, ``kvpush drive`` runs once before the flood (baseline),
once while the flood is sent (during: started with it) and once right after it (after).
Printed: requests/s, p50 and p99 latency of each drive, the endpoint's threads and RSS once
the flood is in, and its idle CPU (share of a core over 5 s with no drive) before the flood and
1 s after it: the load-independent figure of what the flood left it doing.
The floods are issue 17's:

- ``declines``: 100 ``DeclineReq`` of 1,025 new transfer ids each, to P;
- ``delayed``: 20,000 ``DecodeReq`` with ``alloc_delay_s=600``, to D;
- ``waits``: 3,000 ``PushWaitReq`` with ``timeout_s=600``, to P.

Messages are encoded the way kvpush's own client encodes them (``protocol.encode`` +
``Authenticator.seal``) and pipelined on one DEALER socket. Runs against whichever kvpush tree
is on ``PYTHONPATH`` (and the cwd), so the same script measures a tree before and after a
change. Results go to BENCHMARKS.md ("Hostile but well-formed floods").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvpush.wire import protocol
from kvpush.wire.auth import CH_REQUEST, Authenticator

GEOM = ["--num-blocks", "256", "--layers", "2", "--block-bytes", "4096"]
KVPUSH = [sys.executable, "-m", "kvpush"]


def start(role: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    ready = tmp / f"{role}.ready"
    log = open(tmp / f"{role}.log", "ab")  # noqa: SIM115 - closed with the process
    p = subprocess.Popen(
        [*KVPUSH, f"serve-{role}", "--port", "0", "-o", "json", "--ready-file", str(ready), *GEOM],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve-{role} did not start; see {tmp}/{role}.log")
        time.sleep(0.05)
    time.sleep(0.05)
    return p, str(json.loads(ready.read_text())["address"])


def proc_stats(pid: int) -> tuple[int, float]:
    threads, rss = 0, 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return threads, rss


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(pid: int, window_s: float = 5.0) -> float:
    """Share of one core the process uses over ``window_s`` with no load on it: what its own
    housekeeping costs (load-independent, unlike a drive's req/s on a busy host)."""
    c0 = cpu_s(pid)
    time.sleep(window_s)
    return (cpu_s(pid) - c0) / window_s


def drive(p: str, d: str, n: int) -> dict[str, Any]:
    out = subprocess.run(
        [*KVPUSH, "drive", "-p", p, "-d", d, "-n", str(n), "--concurrency", "4", "--json"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r: dict[str, Any] = json.loads(line)
            return r
    return {"ok": 0, "requests": n, "requests_per_s": 0.0, "latency_s": {}, "error": out.stderr}


class Sender:
    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(f"tcp://{host}:{port}")
        self.auth = Authenticator(None)
        self.rid = 0
        self.replies = 0

    def send(self, req: Any) -> None:
        self.rid += 1
        body = protocol.encode(msgspec.structs.replace(req, rid=self.rid))
        self.sock.send_multipart([b"", protocol.MAGIC_REQ + self.auth.seal(CH_REQUEST, body)])
        while self.sock.poll(0, zmq.POLLIN):
            self.sock.recv_multipart()
            self.replies += 1


KEEP: list[Sender] = []  # a closed socket would drop what it has not sent yet


def flood(kind: str, p: str, d: str, tag: str) -> Sender:
    if kind == "declines":
        s = Sender(p)
        for i in range(100):
            ids = [f"{tag}-{i}-{j}" for j in range(1025)]
            s.send(
                protocol.DeclineReq(
                    transfer_id=ids[0], also=ids[1:], reason="no_free_blocks", origin="decode"
                )
            )
    elif kind == "delayed":
        s = Sender(d)
        host, port = p.rsplit(":", 1)
        for i in range(20_000):
            s.send(
                protocol.DecodeReq(
                    transfer_id=f"{tag}-{i}",
                    prefill_host=host,
                    prefill_port=int(port),
                    num_blocks=1,
                    alloc_delay_s=600.0,
                )
            )
    elif kind == "waits":
        s = Sender(p)
        for i in range(3000):
            s.send(protocol.PushWaitReq(transfer_id=f"{tag}-{i}", timeout_s=600.0))
    else:
        raise SystemExit(f"unknown flood {kind!r}")
    KEEP.append(s)
    return s


def row(name: str, r: dict[str, Any]) -> str:
    lat = r.get("latency_s", {})
    return (
        f"| {name} | {r.get('ok', 0)}/{r.get('requests', 0)} | {r.get('requests_per_s', 0):.0f} "
        f"| {lat.get('p50', 0) * 1e3:.0f} | {lat.get('p99', 0) * 1e3:.0f} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--kinds", nargs="*", default=["declines", "delayed", "waits"])
    args = ap.parse_args()
    print(f"tree: {os.getcwd()}  requests per drive: {args.requests}  concurrency 4\n")
    for kind in args.kinds:
        tmp = Path(tempfile.mkdtemp(prefix=f"hostile-{kind}-"))
        procs = []
        try:
            pp, p = start("prefill", tmp)
            dp, d = start("decode", tmp)
            procs = [pp, dp]
            target = dp if kind == "delayed" else pp
            drive(p, d, 50)  # warm-up: handshakes, first allocations
            cpu_before = idle_cpu(target.pid)
            base = drive(p, d, args.requests)
            t0 = time.monotonic()
            th = threading.Thread(target=flood, args=(kind, p, d, "h"), daemon=True)
            th.start()
            during = drive(p, d, args.requests)
            th.join()
            flood_s = time.monotonic() - t0
            threads, rss = proc_stats(target.pid)
            time.sleep(1.0)
            cpu_after = idle_cpu(target.pid)
            after = drive(p, d, args.requests)
            who = "D" if kind == "delayed" else "P"
            print(f"### flood: {kind} (sent in {flood_s:.1f} s; {who} then has {threads} threads, "
                  f"{rss:.0f} MB RSS; {who} idle CPU {cpu_before:.0%} of a core before the "
                  f"flood, {cpu_after:.0%} after it)\n")  # fmt: skip
            print("| drive | ok | req/s | p50 ms | p99 ms |\n|---|---|---|---|---|")
            for name, r in (("before", base), ("during", during), ("after", after)):
                print(row(name, r))
            print(flush=True)
        finally:
            for pr in procs:
                pr.kill()
                pr.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

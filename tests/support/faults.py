"""Fault injection for the ``tests/test_faults_*.py`` suites: real processes, real NIXL.

What lives here:

* ``Cluster``: starts, kills, freezes and restarts endpoint processes (``-m kvpush.ops.node``)
  with short deadlines, and at teardown checks that every endpoint that was not killed on purpose
  exits 0 without a traceback in its log.
* ``run_leg`` / ``run_legs``: both legs of a request over the real side channels, with client
  timeouts short enough that a dead peer costs seconds, and a ``Result`` that always says how the
  request ended (``ok`` or ``failed`` with a reason, also when the D process itself is gone).
* Invariant checks: ``check_results`` (every request ended; every ok request verified by D),
  ``settle`` (pool counts back to their start, or the difference is exactly the quarantined
  blocks), ``ProcStats`` (RSS, open fds and threads from ``/proc``: memory and handles bounded).
* Hostile peers: ``BlackHole`` (a bound ZMQ ROUTER that never answers), ``SilentListener`` (a TCP
  listener that accepts and never speaks), ``Forger`` (a third process with its own NIXL agent
  that loads a peer's agent through a real handshake and sends forged or junk notifications, with
  or without the token) and ``junk_frames`` (malformed side-channel frames).
* ``Relay`` and ``NetnsPair``: a userspace relay between two TUN devices in two network
  namespaces, adding delay or a partition (this kernel has no ``tc netem``; DESIGN.md section 3).

* ``start_in_netns`` / ``run_in_netns``: endpoints (optionally under ``unshare``) and request
  drivers inside those namespaces.

Run as ``python -m tests.support.faults forger`` this module is the forger process: it reads one
JSON command per line on stdin and answers one JSON line per command on stdout. ``legs ...`` and
``stats ADDR`` run requests or read a snapshot and print one JSON line (the netns test runs them
inside a namespace).
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import json
import os
import random
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.ports import free_port as free_port
from tests.support.procs import ROOT, Proc, dump_stacks, start_endpoint

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


# ------------------------------------------------------------------------------------ processes


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
        _remember_token(p.address, cfg.get("auth_token"))
        return p

    def restart(self, name: str, **override: object) -> Proc:
        """Start ``name`` again with its last config (the old process must be gone)."""
        old = self.procs[name]
        assert old.popen.poll() is not None, f"{name} is still running"
        cfg = {**self.cfgs[name], **override}
        self.cfgs[name] = cfg
        p = start_endpoint(cfg, self.tmp, name)
        self.procs[name] = p
        _remember_token(p.address, cfg.get("auth_token"))
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
            rc = p.stop() if pid not in self._stopped else p.popen.returncode
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


@dataclass(frozen=True)
class ProcStats:
    rss_mb: float
    fds: int
    threads: int

    @staticmethod
    def of(pid: int) -> ProcStats:
        rss = threads = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
        return ProcStats(rss / 1024, len(os.listdir(f"/proc/{pid}/fd")), threads)

    def assert_bounded(
        self, after: ProcStats, what: str, rss_mb: float = 96, fds: int = 24, threads: int = 16
    ) -> None:
        assert after.rss_mb - self.rss_mb < rss_mb, f"{what}: RSS grew {self} -> {after}"
        assert after.fds - self.fds < fds, f"{what}: open fds grew {self} -> {after}"
        assert after.threads - self.threads < threads, f"{what}: threads grew {self} -> {after}"


# ------------------------------------------------------------------------------------ requests


# The token of every endpoint a Cluster started with one: the test's clients use it.
_TOKENS: dict[str, bytes] = {}


def _remember_token(address: str, token: object) -> None:
    if isinstance(token, str):
        _TOKENS[address] = token.encode()
    else:
        _TOKENS.pop(address, None)


def client(address: str, timeout_s: float) -> Any:
    """A side-channel client for ``address``, with the endpoint's token if it has one."""
    from kvpush.transport.client import SideChannelClient
    from kvpush.wire.auth import Authenticator

    host, port = address.rsplit(":", 1)
    auth = Authenticator(_TOKENS.get(address))
    return SideChannelClient(host, int(port), auth=auth, timeout_s=timeout_s)


def request(address: str, req: Any, timeout_s: float = 5.0) -> Any:
    """One side-channel request on a fresh socket (closed after: worker threads come and go)."""
    with client(address, timeout_s) as c:
        return c.request(req, timeout_s=timeout_s)


def snapshot(address: str, timeout_s: float = 5.0) -> dict[str, Any]:
    from kvpush.wire import protocol

    rep = request(address, protocol.StatsReq(), timeout_s)
    assert isinstance(rep, protocol.StatsRep), rep
    return rep.snapshot


def gauges(address: str) -> dict[str, float]:
    g = snapshot(address)["gauges"]
    assert isinstance(g, dict)
    return g


def failures(address: str) -> dict[str, int]:
    f = snapshot(address)["failures"]
    assert isinstance(f, dict)
    return f


def counters(address: str) -> dict[str, int]:
    c = snapshot(address)["counters"]
    assert isinstance(c, dict)
    return c


@dataclass
class Result:
    tid: str
    d: str
    outcome: str  # ok | failed
    reason: str = ""
    detail: str = ""
    verified: bool | None = None
    latency_s: float = 0.0  # as the client saw it
    p_outcome: str = ""
    p_reason: str = ""
    server_latency_s: float = 0.0
    t_end: float = 0.0  # monotonic, when the D leg returned


def run_leg(
    tid: str,
    p_addr: str,
    d_addr: str,
    blocks: int,
    *,
    deadline_s: float = 0.0,
    p_delay_s: float = 0.0,
    send_p: bool = True,
    d_timeout_s: float = 20.0,
    p_timeout_s: float = 10.0,
) -> Result:
    """D leg (registers), then after ``p_delay_s`` the P leg; return how D's request ended.

    A D that does not answer (killed, or frozen past the client timeout) yields
    ``failed/d_unreachable``: the request ended with the process that held it.
    """
    from kvpush.errors import KvpushError
    from kvpush.wire import protocol

    host, port = p_addr.rsplit(":", 1)
    out: dict[str, Any] = {}
    t0 = time.monotonic()

    def decode_leg() -> None:
        # A fresh client: the D leg of a request owns its socket (late replies stay there).
        with client(d_addr, d_timeout_s) as c:
            try:
                out["d"] = c.request(
                    protocol.DecodeReq(
                        transfer_id=tid,
                        prefill_host=host,
                        prefill_port=int(port),
                        num_blocks=blocks,
                        deadline_s=deadline_s,
                    ),
                    timeout_s=d_timeout_s,
                )
            except KvpushError as e:
                out["d_err"] = e
        out["t_d"] = time.monotonic()

    t = threading.Thread(target=decode_leg, name=f"leg-{tid}")
    t.start()
    p_outcome, p_reason = "", ""
    if send_p:
        if p_delay_s > 0:
            time.sleep(p_delay_s)
        try:
            p_rep = request(
                p_addr, protocol.PrefillReq(transfer_id=tid, num_blocks=blocks), p_timeout_s
            )
            assert isinstance(p_rep, protocol.PrefillRep), p_rep
            p_outcome, p_reason = p_rep.outcome, p_rep.reason
        except KvpushError as e:
            p_outcome, p_reason = "failed", f"p_unreachable: {e}"
    t.join(d_timeout_s + 10)
    assert not t.is_alive(), f"D leg of {tid} did not return"
    lat = out.get("t_d", time.monotonic()) - t0
    if "d" not in out:
        return Result(
            tid,
            d_addr,
            "failed",
            "d_unreachable",
            str(out.get("d_err", "")),
            latency_s=lat,
            p_outcome=p_outcome,
            p_reason=p_reason,
            t_end=t0 + lat,
        )
    rep = out["d"]
    assert isinstance(rep, protocol.DecodeRep), rep
    return Result(
        tid,
        d_addr,
        rep.outcome,
        rep.reason,
        rep.detail,
        rep.verified,
        lat,
        p_outcome,
        p_reason,
        rep.latency_s,
        t0 + lat,
    )


def run_legs(
    items: list[tuple[str, str, str, int]], concurrency: int = 8, **kw: Any
) -> list[Result]:
    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(lambda it: run_leg(*it, **kw), items))


def check_results(results: list[Result], allowed: set[str] | None = None) -> Counter[str]:
    """Every request ended ok (and D verified every byte) or failed with a reason."""
    reasons: Counter[str] = Counter()
    for r in results:
        assert r.outcome in ("ok", "failed"), r
        if r.outcome == "ok":
            assert r.verified is True, f"{r.tid}: ok but not verified: {r}"
            reasons["ok"] += 1
        else:
            assert r.reason, f"{r.tid}: failed without a reason: {r}"
            assert r.reason != "verify_failed", f"{r.tid}: CORRUPTED KV: {r}"
            if allowed is not None:
                assert r.reason in allowed, f"{r.tid}: unexpected reason {r.reason}: {r}"
            reasons[r.reason] += 1
    return reasons


def fresh_batch(
    p_addr: str, d_addrs: list[str], n: int = 16, blocks: int = 4, prefix: str = "fresh"
) -> list[Result]:
    """Survivors keep serving: ``n`` requests, all ok and verified."""
    tag = uuid.uuid4().hex[:6]
    items = [(f"{prefix}-{tag}-{i}", p_addr, d_addrs[i % len(d_addrs)], blocks) for i in range(n)]
    res = run_legs(items, concurrency=4)
    bad = [r for r in res if r.outcome != "ok" or r.verified is not True]
    assert not bad, bad[:3]
    return res


_BUSY_GAUGES = (
    "pool_allocated",
    "pool_inflight",
    "d_waiting",
    "inflight_writes",
    "deferred",
    "finished_waiting_reg",
    "regs_waiting_blocks",
)


def settle(
    address: str, timeout_s: float = 10.0, quarantine_clears: bool = False
) -> dict[str, float]:
    """Wait until nothing is allocated or in flight; then every block is free or quarantined.

    With ``quarantine_clears`` also wait for quarantine to drain (fences landed) and require it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        g = gauges(address)
        busy = any(g.get(k, 0) for k in _BUSY_GAUGES)
        if quarantine_clears:
            busy = busy or g.get("pool_quarantined", 0) > 0
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for k in _BUSY_GAUGES:
        assert g.get(k, 0) == 0, f"{address}: {k} = {g.get(k)} after {timeout_s}s: {g}"
    assert g["pool_free"] + g["pool_quarantined"] == g["pool_total"], (address, g)
    if quarantine_clears:
        assert g["pool_quarantined"] == 0, (address, g)
    return g


def skip_unless_marker_selected(request: Any, marker: str) -> None:
    """Skip a long test unless the run selected its marker (``-m slow``): the default run stays
    short even where the pytest configuration does not deselect it."""
    import pytest

    expr = str(request.config.getoption("markexpr") or "")
    if os.environ.get("KVPUSH_RUN_SLOW") == "1":
        return
    if marker not in expr.replace(f"not {marker}", ""):
        pytest.skip(f"{marker} test: run with -m {marker} (or KVPUSH_RUN_SLOW=1)")


def wait_for(pred: Any, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


# ------------------------------------------------------------------------------ hostile peers


class BlackHole:
    """A bound ZMQ ROUTER that completes ZMTP and never answers (a wedged side channel)."""

    def __enter__(self) -> BlackHole:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close(0)
        self._ctx.term()


class SilentListener:
    """A TCP listener that accepts connections and never sends a byte."""

    def __enter__(self) -> SilentListener:
        self._srv = socket.socket()
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self._srv.settimeout(0.1)
        self.port = int(self._srv.getsockname()[1])
        self.address = f"127.0.0.1:{self.port}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="silent-listener", daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._srv.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            self._conns.append(c)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(2)
        for c in self._conns:
            c.close()
        self._srv.close()


def junk_frames(seed: int, n: int, max_frame: int) -> Iterator[list[bytes]]:
    """Malformed side-channel requests as DEALER frame lists (ZMQ adds the identity)."""
    from kvpush import PROTOCOL_VERSION
    from kvpush.wire import protocol

    rng = random.Random(seed)

    def rb(k: int) -> bytes:
        return rng.randbytes(k)

    enc = protocol.encode
    kinds = [
        lambda: [b"", rb(rng.randint(0, 300))],
        lambda: [rb(rng.randint(1, 50))],
        lambda: [b"", b""],
        lambda: [b"x", b"y", b"z", b"w"],
        lambda: [b"", protocol.MAGIC_REQ + rb(rng.randint(0, 500))],
        lambda: [b"", protocol.MAGIC_REQ + protocol.make_envelope_bytes(rb(64))],
        lambda: [b"", protocol.MAGIC_REQ + enc([PROTOCOL_VERSION + 7, 0.0, b"", b"", b""])],
        lambda: [b"", protocol.MAGIC_REQ + protocol.make_envelope_bytes(enc({"type": "nope"}))],
        lambda: [
            b"",
            protocol.MAGIC_REQ
            + protocol.make_envelope_bytes(
                enc(
                    {
                        "type": "decode",
                        "transfer_id": "x" * 5000,
                        "prefill_host": "h",
                        "prefill_port": -1,
                        "num_blocks": 0,
                    }
                )
            ),
        ],
        lambda: [
            b"",
            protocol.MAGIC_REQ
            + protocol.make_envelope_bytes(
                enc({"type": "prefill", "transfer_id": "j", "num_blocks": 1 << 40})
            ),
        ],
        lambda: [b"", protocol.MAGIC_REQ + rb(max_frame + 1)],  # oversized (soft limit)
        lambda: [b"", enc(["get_meta_msg", "x", None])],
        lambda: [b"", enc([1] * 100)],
    ]
    for i in range(n):
        yield kinds[i % len(kinds)]()


# ------------------------------------------------------------------------------------- forger


class Forger:
    """Drive a forger process (``python -m tests.support.faults forger``) with JSON commands."""

    def __init__(self, tmp: Path, name: str = "forger") -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.log = tmp / f"{name}.log"
        self._lf = open(self.log, "ab")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.support.faults", "forger"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._lf,
            env=env,
        )
        hello = self._read(30)
        assert hello.get("ready"), hello
        self.agent_name = str(hello["agent"])

    def _read(self, timeout_s: float) -> dict[str, Any]:
        stdout = self.popen.stdout
        assert stdout is not None
        box: list[bytes] = []
        t = threading.Thread(target=lambda: box.append(stdout.readline()))
        t.daemon = True
        t.start()
        t.join(timeout_s)
        if not box or not box[0]:
            raise AssertionError(f"forger did not answer:\n{self.log.read_text(errors='replace')}")
        out: dict[str, Any] = json.loads(box[0])
        return out

    def cmd(self, timeout_s: float = 60.0, **c: Any) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(c) + "\n").encode())
        self.popen.stdin.flush()
        rep = self._read(timeout_s)
        if "error" in rep and not c.get("allow_error"):
            raise AssertionError(f"forger {c.get('op')} failed: {rep['error']}")
        return rep

    def connect(
        self, address: str, token: str | None = None, mode: str = "notif"
    ) -> dict[str, Any]:
        """Real handshake: fetch the peer's metadata (with ``token`` if given), load its agent."""
        return self.cmd(op="connect", address=address, token=token, mode=mode)

    def send(
        self,
        to: str,
        msg: dict[str, Any] | list[dict[str, Any]],
        token: str | None = None,
        repeat: int = 1,
    ) -> None:
        """Send typed notifications (``msg["type"]`` = a protocol struct name) sealed with
        ``token`` (None: no tag), each ``repeat`` times with the same bytes (a replay)."""
        msgs = msg if isinstance(msg, list) else [msg]
        self.cmd(op="send", to=to, msgs=msgs, msg=None, token=token, repeat=repeat)

    def junk(self, to: str, count: int, seed: int = 0) -> int:
        return int(self.cmd(op="junk", to=to, count=count, seed=seed)["sent"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cmd(op="quit", timeout_s=10)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)
        for f in (self.popen.stdin, self.popen.stdout):
            if f is not None:
                f.close()
        self._lf.close()


def _junk_notifs(seed: int, count: int) -> Iterator[bytes]:
    from kvpush import PROTOCOL_VERSION
    from kvpush.wire import protocol
    from kvpush.wire.auth import Authenticator
    from kvpush.wire.notifs import NotifCodec

    rng = random.Random(seed)
    codec = NotifCodec(Authenticator(None))
    enc = protocol.encode

    def rb(k: int) -> bytes:
        return rng.randbytes(k)

    def rid() -> str:
        return f"junk-{rng.randrange(1 << 30)}"

    kinds = [
        lambda: rb(rng.randint(1, 2000)),
        lambda: rb(256 << 10),  # 256 KiB: over the 64 KiB notification limit
        lambda: protocol.MAGIC_NOTIF + rb(rng.randint(0, 400)),
        lambda: protocol.MAGIC_NOTIF + protocol.make_envelope_bytes(rb(rng.randint(0, 400))),
        lambda: protocol.MAGIC_NOTIF + enc([PROTOCOL_VERSION + 9, 0.0, b"", b"", b""]),
        lambda: protocol.MAGIC_NOTIF + protocol.make_envelope_bytes(enc({"type": "zzz"})),
        lambda: b"PUSH_REG:" + rb(rng.randint(0, 200)),
        lambda: b"PUSH_REG:" + enc({"request_id": 5, "local_block_ids": "x"}),
        lambda: b"HB:" + rb(50),
        lambda: codec.encode(protocol.Completion(request_id=rid(), nbytes=1 << 40)),
        lambda: codec.encode(
            protocol.Failure(request_id=rid(), reason="junk", may_have_written=True)
        ),
        lambda: codec.encode(protocol.Fence(fence_id="f", request_ids=[rid() for _ in range(64)])),
        lambda: codec.encode(protocol.Heartbeat(transfer_ids=[rid() for _ in range(256)])),
        lambda: codec.encode(protocol.Cancel(request_id=rid(), transfer_id=rid())),
        lambda: (
            protocol.MAGIC_NOTIF
            + protocol.make_envelope_bytes(
                enc(
                    {
                        "type": "push_reg",
                        "request_id": "r",
                        "decode_engine_id": "e",
                        "decode_host": "h",
                        "decode_port": 70000,
                        "local_block_ids": [[-1]],
                        "remote_engine_id": "p",
                        "remote_host": "h",
                        "remote_port": 1,
                    }
                )
            )
        ),
    ]
    for i in range(count):
        yield kinds[i % len(kinds)]()


def _forger_main() -> int:  # pragma: no cover - runs in the forger process
    from kvpush.config import AgentConfig
    from kvpush.transport.client import SideChannelClient
    from kvpush.transport.nixl import NixlAgent
    from kvpush.wire import protocol
    from kvpush.wire.auth import Authenticator
    from kvpush.wire.notifs import NotifCodec

    agent = NixlAgent(f"forger-{uuid.uuid4().hex[:8]}", AgentConfig())
    peers: dict[str, str] = {}  # address -> agent name
    out = sys.stdout

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    def progress(seconds: float) -> int:
        n = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            n += sum(len(v) for v in agent.get_notifs().values())
            time.sleep(0.001)
        return n

    types = {
        "PushReg": protocol.PushReg,
        "Completion": protocol.Completion,
        "Failure": protocol.Failure,
        "Fence": protocol.Fence,
        "Cancel": protocol.Cancel,
        "Heartbeat": protocol.Heartbeat,
        "Ping": protocol.Ping,
    }
    answer({"ready": True, "agent": agent.name})
    for line in sys.stdin:
        c = json.loads(line)
        op = c.get("op")
        try:
            if op == "quit":
                answer({"ok": True})
                break
            if op == "connect":
                host, port = c["address"].rsplit(":", 1)
                tok = c.get("token")
                auth = Authenticator(tok.encode() if tok else None)
                with SideChannelClient(host, int(port), auth=auth, timeout_s=5) as cl:
                    rep = cl.request(protocol.HandshakeReq(mode=c.get("mode", "notif")))
                assert isinstance(rep, protocol.HandshakeRep), rep
                md = protocol.decode_metadata(rep.metadata)
                name = agent.add_remote(rep.agent_metadata)
                agent.make_connection(name)
                peers[c["address"]] = name
                progress(0.05)
                answer(
                    {
                        "ok": True,
                        "agent_name": name,
                        "engine_id": md.engine_id,
                        "incarnation": md.incarnation,
                        "num_blocks": md.num_blocks,
                    }
                )
            elif op == "send":
                tok = c.get("token")
                codec = NotifCodec(Authenticator(tok.encode() if tok else None))
                for m in c.get("msgs") or [c["msg"]]:
                    msg = dict(m)
                    cls = types[msg.pop("type")]
                    data = codec.encode(cls(**msg))
                    for _ in range(int(c.get("repeat", 1))):
                        agent.send_notif(peers[c["to"]], data)
                    progress(0.0)
                progress(0.05)
                answer({"ok": True})
            elif op == "junk":
                sent = 0
                for data in _junk_notifs(int(c.get("seed", 0)), int(c["count"])):
                    agent.send_notif(peers[c["to"]], data)
                    sent += 1
                    if sent % 64 == 0:
                        progress(0.0)
                progress(1.0)  # let UCX flush: sends still queued here die with this process
                answer({"ok": True, "sent": sent})
            else:
                answer({"error": f"unknown op {op!r}"})
        except Exception as e:
            answer({"error": f"{type(e).__name__}: {e}"})
    for name in peers.values():
        agent.remove_remote(name)
    agent.close()
    return 0


# ------------------------------------------------------------------------------ network namespaces

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


class Relay:
    """Move IP packets between two TUN fds after ``delay_s``; ``partition`` drops everything."""

    def __init__(self, fd_a: int, fd_b: int, delay_s: float) -> None:
        self.fds = (fd_a, fd_b)
        self.delay_s = delay_s
        self.partitioned = False
        self.forwarded = 0
        self.forwarded_bytes = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="tun-relay", daemon=True)

    def start(self) -> Relay:
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)

    def _run(self) -> None:
        import select

        a, b = self.fds
        other = {a: b, b: a}
        queue: list[tuple[float, int, int, bytes]] = []
        seq = 0
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = 0.05
            if queue:
                timeout = max(0.0, min(timeout, queue[0][0] - now))
            r, _, _ = select.select([a, b], [], [], timeout)
            now = time.monotonic()
            for fd in r:
                for _ in range(64):
                    try:
                        pkt = os.read(fd, 65536)
                    except (BlockingIOError, OSError):
                        break
                    if self.partitioned:
                        self.dropped += 1
                    else:
                        seq += 1
                        heapq.heappush(queue, (now + self.delay_s, seq, other[fd], pkt))
                    if not _readable(fd):
                        break
            while queue and queue[0][0] <= time.monotonic():
                _, _, dst, pkt = heapq.heappop(queue)
                with contextlib.suppress(OSError):
                    os.write(dst, pkt)
                    self.forwarded += 1
                    self.forwarded_bytes += len(pkt)


def _readable(fd: int) -> bool:
    import select

    r, _, _ = select.select([fd], [], [], 0)
    return bool(r)


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
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError), self.log.open("a") as f:
                f.write(
                    f"\n--- test harness: no exit within {timeout:g}s of SIGTERM; py-spy dump "
                    f"before SIGKILL ---\n{dump_stacks(self.pid)}\n"
                )
            self.kill()
            return None

    def kill(self) -> None:
        for pid in (self.pid, self.popen.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


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
    ready = tmp / f"{name}.ready"
    log = tmp / f"{name}.log"
    ready.unlink(missing_ok=True)
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    cmd = ["ip", "netns", "exec", netns]
    if unshare:
        cmd += ["unshare", "--pid", "--ipc", "--mount", "--fork", "--mount-proc"]
    cmd += [sys.executable, "-m", "kvpush.ops.node", json.dumps(cfg), str(ready)]
    with open(log, "ab") as lf:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=lf, stderr=subprocess.STDOUT, env=full_env)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            p.kill()
            raise RuntimeError(f"{name} did not start in {timeout}s:\n{log.read_text()}")
        time.sleep(0.02)
    info = json.loads(ready.read_text())
    pid = p.pid
    for cand in [p.pid, *_descendants(p.pid)]:
        with contextlib.suppress(OSError), open(f"/proc/{cand}/cmdline", "rb") as f:
            if b"kvpush.ops.node" in f.read():
                pid = cand
    return NsProc(p, pid, info["address"], log)


def run_in_netns(netns: str, *args: str, timeout: float = 120.0) -> Any:
    """Run ``python -m tests.support.faults ARGS`` inside ``netns``; return its JSON output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-m", "tests.support.faults", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if r.returncode != 0:
        raise AssertionError(f"{args[0]} in {netns} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _driver_main(args: list[str]) -> int:  # pragma: no cover - runs inside a namespace
    """``legs P D N BLOCKS PREFIX [P_DELAY_S]`` or ``stats ADDR``: one JSON line on stdout."""
    from dataclasses import asdict

    if args[0] == "legs":
        p, d, n, blocks, prefix = args[1], args[2], int(args[3]), int(args[4]), args[5]
        p_delay = float(args[6]) if len(args) > 6 else 0.0
        items = [(f"{prefix}-{i}", p, d, blocks) for i in range(n)]
        res = run_legs(items, concurrency=4, p_delay_s=p_delay, d_timeout_s=30)
        print(json.dumps([asdict(r) for r in res]))
    elif args[0] == "stats":
        print(json.dumps(snapshot(args[1])))
    else:
        print(f"unknown driver command {args[0]!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["forger"]:
        sys.exit(_forger_main())
    if sys.argv[1:2] in (["legs"], ["stats"]):
        sys.exit(_driver_main(sys.argv[1:]))
    sys.exit(f"usage: {sys.argv[0]} forger | legs ... | stats ADDR")

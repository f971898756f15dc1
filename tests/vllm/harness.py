"""Run vLLM's real push connector as a P or D peer for tests: ``VllmPeer``.

Runs in the project's ``.venv`` (pytest); the peer itself (``peer.py``) runs in the separate
vLLM virtualenv, found via ``KVPUSH_VLLM_PYTHON`` or ``scripts/vllm-venv.sh``. A peer is one
long-lived process (importing vLLM takes 5-40 s here) that serves many commands; the test talks
to it through files in its work directory (see ``peer.py``): ``info.json`` once ready,
``status.json`` every ~0.2 s, ``cmd/<id>.json`` in, ``out/<id>.json`` back, ``wire.jsonl``.

Every wait has a deadline and fails with the peer's status and log tail. ``stop`` always ends
the process: the ``stop`` command, then SIGTERM, then SIGKILL. The peer also asks the kernel for
SIGTERM when this process exits (``PR_SET_PDEATHSIG``), so a crashed test run leaves no engine.

``tp_size=N`` (a P) starts N processes, one per TP rank, as vLLM's multiprocess executor does:
rank 0 is the peer the test talks to (commands, ``info.json``, its listener serves every rank);
ranks 1.. are ``followers`` in lockstep with it over a gloo group (see ``peer.py``'s ``Engine``).
A peer is alive only while every rank is; stopping it stops them all.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.commands.common import ports

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PEER = HERE / "peer.py"
VENV_SCRIPT = ROOT / "scripts" / "vllm-venv.sh"

START_TIMEOUT_S = 240.0  # vLLM import under load on 2 cores; a ready peer answers in seconds
COMMAND_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
STATUS_STALE_S = 60.0  # a status older than this means the engine loop is stuck

# Wire-log record kinds that mean the vLLM peer did something on NIXL with someone.
NIXL_ACTIVITY = frozenset(
    {"recv_notif", "send_notif", "make_prepped_xfer", "transfer", "add_remote_agent", "push_write"}
)

_live: list[VllmPeer] = []


class PeerError(AssertionError):
    """A peer did not start, died, or did not answer in time (a test failure, with context)."""


def vllm_python() -> str:
    """The vLLM venv's python: ``KVPUSH_VLLM_PYTHON``, else what ``scripts/vllm-venv.sh`` prints
    (which builds the venv the first time, a few minutes)."""
    env = os.environ.get("KVPUSH_VLLM_PYTHON")
    if env:
        if not os.access(env, os.X_OK):
            raise PeerError(f"KVPUSH_VLLM_PYTHON={env} is not an executable")
        return env
    p = subprocess.run(
        [str(VENV_SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=1800, check=False
    )
    if p.returncode != 0:
        raise PeerError(f"{VENV_SCRIPT} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout.strip().splitlines()[-1]


def free_port() -> int:
    return ports.free_port()


def peer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPUSH_", "VLLM_"))}
    env.update({"PYTHONUNBUFFERED": "1", "NO_COLOR": "1"})
    return env


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")  # ends in .tmp: the peer ignores it
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent, or (never, with atomic renames) half-written


@dataclass
class VllmPeer:
    """One running ``peer.py`` process; see the module docstring."""

    role: str
    workdir: Path
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    args: tuple[str, ...]
    info: dict[str, Any] = field(default_factory=dict)
    returncode: int | None = None
    followers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # TP ranks 1..
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def launch(
        cls,
        role: str,
        workdir: Path,
        *,
        python: str,
        lease: int = 30,
        num_blocks: int = 16,
        engine_id: str | None = None,
        extra: Sequence[str] = (),
        nice: int = 10,
        tp_size: int = 1,
        port: int = 0,
    ) -> VllmPeer:
        """Start the process (not waiting for it: see ``wait_ready``); at ``tp_size`` > 1, one
        per rank. ``port``: the side channel's (0: a free one; a restart passes the old one)."""
        workdir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        if tp_size > 1:  # every rank is one engine: one engine id, one gloo store
            engine_id = engine_id or f"vllm-{role}-tp{tp_size}-{uuid.uuid4().hex[:8]}"
            extra = [*extra, "--tp-size", str(tp_size), "--dist-port", str(free_port())]
        args = [
            "--role",
            role,
            "--workdir",
            str(workdir),
            "--port",
            str(port),
            "--lease",
            str(lease),
            "--num-blocks",
            str(num_blocks),
            "--parent-pid",
            str(os.getpid()),
            "--nice",
            str(nice),
            *(["--engine-id", engine_id] if engine_id else []),
            *extra,
        ]
        log = workdir / "peer.log"
        # ``--nice``: vLLM's NIXL agent runs a progress thread that spins a whole core (vLLM's
        # own agent configuration); the kvpush processes under test must not starve.
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                [python, str(PEER), *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=peer_env(),
                cwd=str(workdir),
                start_new_session=True,
            )
        peer = cls(role, workdir, port, proc, log, tuple(args))
        _live.append(peer)
        for rank in range(1, tp_size):
            rdir = workdir / f"rank{rank}"
            rdir.mkdir(exist_ok=True)
            with open(rdir / "peer.log", "ab") as f:
                peer.followers.append(
                    subprocess.Popen(
                        [python, str(PEER), *args, "--tp-rank", str(rank)],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=peer_env(),
                        cwd=str(workdir),
                        start_new_session=True,
                    )
                )
        return peer

    @classmethod
    def start(
        cls, role: str, workdir: Path, *, python: str, timeout: float = START_TIMEOUT_S, **kw: Any
    ) -> VllmPeer:
        """Start one peer and wait until it is ready."""
        return start_many([(role, workdir, kw)], python=python, timeout=timeout)[0]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        path = self.workdir / "info.json"
        while time.monotonic() < deadline:
            info = read_json(path)
            if isinstance(info, dict):
                self.info = info
                return self.info
            if self.proc.poll() is not None:
                raise self.error(f"exited with {self.proc.returncode} before it was ready")
            time.sleep(0.1)
        raise self.error(f"not ready within {timeout:g}s")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """End the process whatever its state; returns its exit status (idempotent)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.send({"op": "stop"})
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(15)
        for f in self.followers:  # they stop with the lead's stop; a dead lead leaves them stuck
            try:
                f.wait(10)
            except subprocess.TimeoutExpired:
                f.kill()
                f.wait(15)
        self.returncode = self.proc.returncode
        if self in _live:
            _live.remove(self)
        return self.returncode

    def kill(self) -> None:
        for p in (self.proc, *self.followers):
            if p.poll() is None:
                p.kill()
                p.wait(15)
        self.stop()

    # ------------------------------------------------------------------ identity
    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def engine_id(self) -> str:
        return str(self.info["engine_id"])

    @property
    def agent(self) -> str:
        return str(self.info["agent"])

    # ------------------------------------------------------------------ health
    def status(self) -> dict[str, Any] | None:
        st = read_json(self.workdir / "status.json")
        return st if isinstance(st, dict) else None

    def running(self) -> bool:
        return self.proc.poll() is None

    def why_not_alive(self) -> str | None:
        """None when alive: process running, listener thread alive, no engine error, and the
        engine loop still writing its status. Otherwise what is wrong."""
        st = self.status()
        if st is not None and st.get("engine_error"):
            return f"engine error: {st['engine_error']}"
        if not self.running():
            return f"process exited with {self.proc.returncode}"
        if st is None:
            return "no status.json"
        if not st.get("listener_alive"):
            return "side-channel listener thread is dead"
        if not st.get("writer_alive"):
            return "nixl-push-writer thread is dead"
        age = time.time() - float(st.get("time", 0))
        if age > STATUS_STALE_S:
            return f"status not refreshed for {age:.0f}s (engine loop stuck)"
        return self._why_follower_not_alive()

    def _why_follower_not_alive(self) -> str | None:
        """None when every follower rank (TP > 1) runs with a live writer thread and no engine
        error; otherwise what is wrong with the first that does not."""
        for rank, f in enumerate(self.followers, start=1):
            rst = read_json(self.workdir / f"rank{rank}" / "status.json")
            if isinstance(rst, dict) and rst.get("engine_error"):
                return f"rank {rank}: engine error: {rst['engine_error']}"
            if f.poll() is not None:
                return f"rank {rank} exited with {f.returncode}"
            if not isinstance(rst, dict) or not rst.get("writer_alive"):
                return f"rank {rank}: nixl-push-writer thread is dead (or no status)"
        return None

    def alive(self) -> bool:
        return self.why_not_alive() is None

    def assert_alive(self, what: str = "") -> None:
        why = self.why_not_alive()
        if why is not None:
            raise self.error(f"not alive{' after ' + what if what else ''}: {why}")

    def settle(self, steps: int = 10, min_s: float = 0.5, timeout: float = 60.0) -> None:
        """Let the engine run ``steps`` more steps (and at least ``min_s``); see ``settle_all``."""
        settle_all([self], steps, min_s, timeout)

    # ------------------------------------------------------------------ commands
    def send(self, cmd: dict[str, Any]) -> str:
        cid = f"c{next(self._ids)}-{os.getpid()}"
        write_json_atomic(self.workdir / "cmd" / f"{cid}.json", cmd)
        return cid

    def result(self, cid: str, timeout: float = COMMAND_TIMEOUT_S, suffix: str = "") -> Any:
        """Wait for ``out/<cid><suffix>.json``; fails at once if the peer dies meanwhile."""
        path = self.workdir / "out" / f"{cid}{suffix}.json"
        deadline = time.monotonic() + timeout
        while True:
            out = read_json(path)
            if out is not None:
                return out
            if not self.running():
                out = read_json(path)  # written just before it exited
                if out is not None:
                    return out
                raise self.error(f"exited with {self.proc.returncode} before answering {cid}")
            if time.monotonic() > deadline:
                raise self.error(f"no answer to {cid}{suffix} within {timeout:g}s")
            time.sleep(0.02)

    def command(self, cmd: dict[str, Any], timeout: float = COMMAND_TIMEOUT_S) -> Any:
        return self.result(self.send(cmd), timeout)

    def prefill(self, request_id: str, blocks: Sequence[int], **kw: Any) -> str:
        """Send a prefill command; returns its id (``result(id, suffix=".params")`` gives the
        kv_transfer_params as soon as vLLM finished the request, ``result(id)`` the outcome)."""
        return self.send({"op": "prefill", "request_id": request_id, "blocks": list(blocks), **kw})

    def decode(
        self, request_id: str, params: dict[str, Any], blocks: Sequence[int], **kw: Any
    ) -> str:
        return self.send(
            {
                "op": "decode",
                "request_id": request_id,
                "params": params,
                "blocks": list(blocks),
                **kw,
            }
        )

    # ------------------------------------------------------------------ wire log
    def wire(self, since: int = 0, rank: int = 0) -> list[dict[str, Any]]:
        """Records of ``wire.jsonl`` (of TP ``rank``) from line ``since`` on (a trailing partial
        line is left)."""
        wd = self.workdir if rank == 0 else self.workdir / f"rank{rank}"
        try:
            text = (wd / "wire.jsonl").read_text()
        except FileNotFoundError:
            return []
        lines = text.split("\n")[:-1]  # the last element is "" or a line still being written
        return [json.loads(ln) for ln in lines[since:] if ln]

    def wire_mark(self, rank: int = 0) -> int:
        return len(self.wire(rank=rank))

    def nixl_activity(self, since: int) -> list[dict[str, Any]]:
        return [r for r in self.wire(since) if r.get("kind") in NIXL_ACTIVITY]

    # ------------------------------------------------------------------ diagnostics
    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def listen_state(self) -> str:
        """Who listens on the side-channel port, and how many connections wait in its accept
        queue (``ss``'s Recv-Q): a diagnosis for a listener that stays silent."""
        ss = shutil.which("ss")
        if ss is None:
            return "(ss not installed)"
        p = subprocess.run(
            [ss, "-ltnp", f"sport = :{self.port}"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return (p.stdout + p.stderr).strip()

    def error(self, msg: str) -> PeerError:
        return PeerError(
            f"vLLM {self.role} peer (pid {self.proc.pid}, port {self.port}) {msg}\n"
            f"status: {self.status()}\n--- {self.log} (tail) ---\n{self.log_tail()}"
        )


def request_ids(tag: str) -> tuple[str, str]:
    """P's and D's ids: one base id, two of vLLM's ``-<8 hex>`` suffixes, as a router makes them."""
    base = f"cmpl-{tag}-{uuid.uuid4().hex[:12]}"
    return f"{base}-0000aaaa", f"{base}-1111bbbb"


def router_params(p: VllmPeer, p_request_id: str) -> dict[str, Any]:
    """What a push-mode router hands D before P has finished (no remote_block_ids yet)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.engine_id,
        "remote_request_id": p_request_id,
        "remote_host": p.host,
        "remote_port": p.port,
        "tp_size": 1,
        "pp_size": 1,
        "transfer_mode": "push",
    }


def model_page_args(info: dict[str, Any], num_blocks: int = 16) -> list[str]:
    """``serve-*`` flags for a kvpush endpoint on vLLM's wire at a vLLM peer's *model*
    geometry: every head in its page (from tokens, KV heads and head size), as a kvpush
    endpoint at another TP size than the peer needs -- ``--like`` would copy one rank's page."""
    g = info["geometry"]
    return [
        *("--wire", "vllm", "--compat-hash", info["compat_hash"]),
        *("--vllm-block-size", str(info["block_size"]), "--attn-backend", info["backend"]),
        *("--kv-layout", info["kv_cache_layout"], "--kv-regions", "per-layer"),
        *("--layers", str(len(info["layer_names"])), "--num-blocks", str(num_blocks)),
        *("--block-tokens", str(g["block_size"]), "--kv-heads", str(g["kv_heads"])),
        *("--head-dim", str(g["head_size"]), "--dtype", g["dtype"]),
    ]


def pattern_sha256(info: dict[str, Any], seed: int, blocks: Sequence[int]) -> str:
    """The sha256 a P peer reports for ``prefill(seed=seed, blocks=blocks)``, computed here from
    the written-down definitions (pattern and digest, see ``peer.py``) without vLLM: a check
    of the peer's own digest and fill (float32 only; numpy has no bfloat16)."""
    import hashlib

    import numpy as np

    if info["dtype"] != "float32":
        raise ValueError(f"pattern_sha256 covers float32 only, not {info['dtype']}")
    mod = 1 << 24
    n = int(info["kv_heads"]) * int(info["block_size"]) * 2 * int(info["head_size"])
    ramp = np.arange(n, dtype=np.int64)
    h = hashlib.sha256()
    for layer in range(len(info["layer_names"])):
        for b in blocks:
            base = (seed * 1_000_003 + layer * 65_537 + b * 4_099) % mod
            h.update(((ramp + base) % mod).astype("<f4").tobytes())
    return h.hexdigest()


def start_many(
    specs: Sequence[tuple[str, Path, dict[str, Any]]],
    *,
    python: str,
    timeout: float = START_TIMEOUT_S,
) -> list[VllmPeer]:
    """Start peers in parallel (their vLLM imports overlap) and wait until all are ready; all or
    nothing. A peer whose free port was taken meanwhile (exit 4) is relaunched on another."""
    peers: list[VllmPeer] = []
    try:
        for role, wd, kw in specs:
            peers.append(VllmPeer.launch(role, wd, python=python, **kw))
        for i, (role, wd, kw) in enumerate(specs):
            for attempt in range(1, 4):
                try:
                    peers[i].wait_ready(timeout)
                    break
                except PeerError:
                    if peers[i].proc.poll() != 4 or attempt == 3:
                        raise
                    peers[i].stop()
                    peers[i] = VllmPeer.launch(role, wd / f"retry{attempt}", python=python, **kw)
    except BaseException:
        stop_many(peers, timeout=5)
        raise
    return peers


def settle_all(
    peers: Sequence[VllmPeer], steps: int = 10, min_s: float = 0.5, timeout: float = 60.0
) -> None:
    """Let every engine run ``steps`` more steps (and at least ``min_s``), so that whatever
    reached them meanwhile has been through vLLM's writer thread and engine thread. A peer
    whose process exits stops being waited for (callers then see it in ``why_not_alive``)."""
    targets = [int((p.status() or {}).get("steps", 0)) + steps for p in peers]
    t_min = time.monotonic() + min_s
    deadline = time.monotonic() + timeout
    while True:
        behind = [
            p
            for p, target in zip(peers, targets, strict=True)
            if p.running() and int((p.status() or {}).get("steps", 0)) < target
        ]
        if not behind and time.monotonic() >= t_min:
            return
        if time.monotonic() > deadline:
            raise (behind or list(peers))[0].error(
                f"engine did not make {steps} steps in {timeout:g}s"
            )
        time.sleep(0.05)


def stop_many(peers: Sequence[VllmPeer], timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop peers together: each gets its ``stop`` command first, then ``stop`` waits (and
    escalates) one by one, so their shutdowns overlap."""
    for p in peers:
        if p.running():
            with contextlib.suppress(OSError):
                p.send({"op": "stop"})
    for p in peers:
        p.stop(timeout)


class Untouched:
    """Marks peers' wire logs; ``check`` asserts each stayed alive with no NIXL activity since.

    For tests of commands that must not touch a vLLM peer beyond its side channel: afterwards
    the process, its listener and writer threads live, no engine step raised, and the peer sent
    or received no notification, posted no transfer and loaded no agent."""

    def __init__(self, *peers: VllmPeer) -> None:
        self.peers = peers
        self.marks = [p.wire_mark() for p in peers]

    def check(self, what: str) -> None:
        settle_all(self.peers)  # whatever reached NIXL has been through vLLM's writer and engine
        for peer, mark in zip(self.peers, self.marks, strict=True):
            peer.assert_alive(what)
            activity = peer.nixl_activity(mark)
            assert not activity, f"{what}: vLLM {peer.role} saw NIXL activity: {activity}"


@atexit.register
def _stop_leftovers() -> None:  # a last resort; fixtures stop their peers themselves
    for p in list(_live):
        p.kill()

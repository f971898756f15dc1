"""vLLM peers hurt on purpose: the health checks see it; a kvpush command that hurts one.

A test that asserts "the vLLM peer is alive and received nothing" is only worth something if a
dead listener, a dead engine and a received notification are actually seen. A fresh vLLM D is
hurt with the two faults of VLLM_INTEROP.md section 1, by hand-made messages (not kvpush): a
side-channel message that is not 3 frames kills its listener thread; a NIXL notification in
none of vLLM's three forms kills its engine (``ValueError`` in ``_get_new_notifs``). Another
fresh D meets the kvpush command that would kill its listener (probe of a rank it does not
serve): kvpush refuses to send it, and the listener lives. Each test gets its own engine; the
module starts both at once.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from harness import Untouched, VllmPeer, start_many, stop_many

from tests.conftest import Done

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

# Loads the vLLM agent's metadata into a plain NIXL agent and sends it one foreign notification.
FOREIGN_NOTIFIER = """
import sys, time
from nixl._api import nixl_agent, nixl_agent_config
md = open(sys.argv[1], "rb").read()
agent = nixl_agent("kvpush-test-foreign", nixl_agent_config(backends=["UCX"]))
name = agent.add_remote_agent(md)
agent.send_notif(name, b"hello")
time.sleep(1.0)
print("sent to", name)
"""


@pytest.fixture(scope="module")
def doomed(vllm_py: str, vllm_tmp: Path) -> Iterator[list[VllmPeer]]:
    """Two vLLM D engines no other test shares: each test below kills one."""
    peers = start_many(
        [("D", vllm_tmp / "doomed-0", {}), ("D", vllm_tmp / "doomed-1", {})], python=vllm_py
    )
    try:
        yield peers
    finally:
        stop_many(peers)


@contextlib.contextmanager
def req_socket(port: int) -> Iterator[zmq.Socket[bytes]]:
    """A REQ socket connected to a vLLM listener, closed (nothing left queued) at the end."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        yield s
    finally:
        ctx.destroy(linger=0)


def get_meta(port: int, frames: list[bytes] | None = None, timeout_ms: int = 5000) -> list[bytes]:
    """One REQ round trip to a vLLM listener; ``frames`` defaults to the well-formed request."""
    with req_socket(port) as s:
        s.setsockopt(zmq.RCVTIMEO, timeout_ms)
        s.send_multipart(frames or [msgspec.msgpack.encode((b"get_meta_msg", 0, 0))])
        try:
            return s.recv_multipart()
        except zmq.Again:
            return []


def wait_until_dead(peer: VllmPeer, want: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        why = peer.why_not_alive()
        if why is not None and want in why:
            return why
        time.sleep(0.1)
    raise peer.error(f"still not {want!r} after {timeout:g}s: {peer.why_not_alive()}")


def test_dead_listener_and_dead_engine_are_seen(doomed: list[VllmPeer]) -> None:
    d = doomed[0]
    d.assert_alive("start")
    reply = get_meta(d.port)
    assert len(reply) == 2
    payload = msgspec.msgpack.decode(reply[0])
    assert payload["compatibility_hash"] == d.info["compat_hash"]
    agent_md = msgspec.msgpack.decode(payload["agent_metadata_bytes"])["agent_metadata"]

    # 1. Two frames from a REQ socket: the ROUTER sees 4, the listener's unpacking raises. The
    # socket stays open until the listener is dead: closed after a fixed wait, its frames could
    # still be queued behind the connection's handshake on a loaded host, and be dropped (seen
    # beside a CPU-bound process: the listener never got them and lived).
    with req_socket(d.port) as s:
        s.send_multipart([b"two", b"frames"])
        assert wait_until_dead(d, "listener") == "side-channel listener thread is dead"
        assert s.poll(100) == 0  # and nothing came back
    assert d.running()
    assert get_meta(d.port, timeout_ms=1000) == []  # no handshake with this engine any more

    # 2. A notification vLLM cannot parse: its engine step raises and the process exits 3.
    md_file = d.workdir / "foreign-test-agent.md"
    md_file.write_bytes(agent_md)
    mark = d.wire_mark()
    p = subprocess.run(
        [sys.executable, "-c", FOREIGN_NOTIFIER, str(md_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    why = wait_until_dead(d, "engine error")
    assert "ValueError" in why, why
    d.proc.wait(60)
    assert d.proc.returncode == 3
    st = d.status()
    assert st is not None and st["final"] is True and "ValueError" in st["engine_error"]
    received = [r for r in d.nixl_activity(mark) if r["kind"] == "recv_notif"]
    assert [(r["frm"], r["msg"]) for r in received] == [
        ("kvpush-test-foreign", {"type": "other", "raw": "hello"})
    ]


def test_probe_of_a_rank_vllm_does_not_serve(
    doomed: list[VllmPeer], kvpush_run: Callable[..., Done]
) -> None:
    """vLLM's listener dies on a rank its engine does not serve (a TP=1 engine asked for rank
    0,1: KeyError). kvpush asks another rank only when told the engine's TP size, and only a
    rank below it: otherwise it refuses (usage, exit 2) and the listener lives."""
    d = doomed[1]
    for args in (["--ranks", "0,1"], ["--ranks", "0,1", "--peer-tp", "1"]):
        watch = Untouched(d)
        r = kvpush_run("probe", d.address, *args, "--timeout", "3", timeout=120)
        watch.check("kvpush probe " + " ".join(args))
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.err_lines[0].startswith(f"error: not asking {d.address} for rank 0,1"), r.stderr
        assert "--peer-tp N" in r.err_lines[1]
    r = kvpush_run("probe", d.address, "--ranks", "0,0", "--json", timeout=120)
    assert r.returncode == 0, r.stderr  # the listener still answers

"""Hostile and malformed input at process level (issue 5, test 7).

Property-based fuzzing of the decoders belongs with the protocol's unit tests; here a *live*
P and D take a flood of junk on both carriers -- malformed, oversized and random side-channel
frames (and raw TCP garbage), and malformed, oversized and nonsensical NIXL notifications from a
third process -- while they serve requests. They must count what they reject, never lose a
thread, keep memory bounded and serve a fresh batch afterwards.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq

from tests.support.cluster import cluster_ctx
from tests.support.fault_legs import Result, run_legs
from tests.support.forger import Forger
from tests.support.invariants import check_results, fresh_batch, settle
from tests.support.junk import junk_frames
from tests.support.procs import Proc
from tests.support.procstats import ProcStats
from tests.support.side import counters, failures
from tests.support.waits import wait_for

pytestmark = pytest.mark.integration

MAX_FRAME = 256 * 1024
ROUNDS = 3
PER_ROUND = 2000  # junk frames per endpoint and junk notifications per endpoint, per round


def _flood_side_channel(address: str, n: int, seed: int) -> int:
    """Send ``n`` junk requests on one DEALER socket; return how many replies came back.
    Then one frame over ZMQ's hard limit and 20 connections of raw TCP garbage."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.connect(f"tcp://{address}")
    got = 0
    try:
        for i, frames in enumerate(junk_frames(seed, n, MAX_FRAME)):
            s.send_multipart(frames)
            if i % 32 == 0:
                while s.poll(0):
                    s.recv_multipart()
                    got += 1
        end = time.monotonic() + 5
        while time.monotonic() < end and s.poll(200):
            s.recv_multipart()
            got += 1
    finally:
        s.close(0)
    # Over ZMQ's own hard limit: the connection is dropped, the server carries on.
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(f"tcp://{address}")
    big.send_multipart([b"", b"\0" * (2 * MAX_FRAME + 8192)])
    time.sleep(0.2)
    big.close(0)
    # Not even ZMTP: raw bytes on the TCP port.
    host, port = address.rsplit(":", 1)
    for k in range(20):
        with socket.create_connection((host, int(port)), timeout=2) as raw:
            raw.sendall(bytes((k * 37 + j) % 256 for j in range(4096)))
    return got


def _flood_round(
    forger: Forger, addresses: tuple[str, str], replies: dict[str, int], sent: dict[str, int]
) -> None:
    """One round of junk on both carriers of each endpoint: side-channel floods (one thread
    each) while ``forger`` sends junk notifications; the counts add to ``replies``/``sent``."""
    floods = [
        threading.Thread(
            target=lambda a=a, k=k: replies.__setitem__(
                a, replies.get(a, 0) + _flood_side_channel(a, PER_ROUND, k)
            )
        )
        for k, a in enumerate(addresses)
    ]
    for f in floods:
        f.start()
    for k, a in enumerate(addresses):
        sent[a] = sent.get(a, 0) + forger.junk(a, PER_ROUND, seed=k)
    for f in floods:
        f.join(120)


def _ping_burst(forger: Forger, p: Proc, threads_before: int) -> None:
    """Pings ask the endpoint to handshake back to an address the sender chooses: a burst
    naming 1000 addresses must not start 1000 threads."""
    pings = [
        {"type": "Ping", "seq": i, "reply_host": "127.0.0.1", "reply_port": 1 + i}
        for i in range(1000)
    ]
    forger.send(p.address, pings)
    peak = 0
    for _ in range(20):
        peak = max(peak, ProcStats.of(p.popen.pid).threads)
        time.sleep(0.05)
    assert peak < threads_before + 300, peak
    wait_for(
        lambda: ProcStats.of(p.popen.pid).threads < threads_before + 8,
        20,
        "P's handshake threads to finish",
    )
    # Every Ping named a closed port: its handshake was refused for overload or failed at
    # once with "connection refused" (issue 17: no longer after the side-channel timeout, so
    # fewer pile up to the overload limit).
    tried = failures(p.address).get("handshake_overload", 0) + counters(p.address).get(
        "handshakes_failed", 0
    )
    assert tried >= 900, tried


def _assert_rejected(a: str, replies: int, sent: int) -> None:
    """What the endpoint at ``a`` counted as rejected after the flood."""
    fails = failures(a)
    rejected = sum(fails.get(k, 0) for k in ("malformed_frame", "oversized_frame", "bad_value"))
    # Every junk request was answered with an error (a few are valid vLLM requests).
    n = ROUNDS * PER_ROUND
    assert replies >= n * 0.97 and rejected >= n * 0.83, (a, replies, fails)
    # Ten of the fifteen junk notification kinds are malformed or oversized; the rest are
    # well-formed nonsense (unknown ids), ignored and counted by kind.
    bad_notifs = sum(fails.get(k, 0) for k in ("malformed_notif", "auth_rejected"))
    assert bad_notifs >= sent * 0.6, (a, sent, fails)
    print(a, "rejected:", fails)


@pytest.mark.slow  # ~20 s: in `make test-slow` (CI), keeps `make test` under 10 minutes
def test_junk_flood_on_side_channel_and_notifications(tmp_path: Path) -> None:
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p", max_frame_bytes=MAX_FRAME)
        d = c.start("decode", "d", max_frame_bytes=MAX_FRAME)
        fresh_batch(p.address, [d.address], n=8)
        before = {a.address: ProcStats.of(a.popen.pid) for a in (p, d)}

        # Requests keep flowing during the whole flood.
        flow: list[Result] = []
        stop = threading.Event()

        def serve() -> None:
            i = 0
            while not stop.is_set():
                # One block per request: fill and verify work in place, so no lazily
                # allocated scratch buffer muddles the memory readings below.
                items = [(f"flow-{i}-{k}", p.address, d.address, 1) for k in range(4)]
                flow.extend(run_legs(items, concurrency=4))
                i += 1

        t = threading.Thread(target=serve, name="flow")
        t.start()
        replies: dict[str, int] = {}
        sent: dict[str, int] = {}
        rss: dict[str, list[float]] = {p.address: [], d.address: []}
        forger = Forger(tmp_path)
        try:
            for a in (p.address, d.address):
                forger.connect(a)
            # Identical rounds of junk on both carriers. Memory may step up once to a
            # high-water mark (allocator arenas, ZMQ and UCX buffers), at a round that varies
            # from run to run; a leak would grow it every round.
            for rnd in range(ROUNDS):
                _flood_round(forger, (p.address, d.address), replies, sent)
                if rnd == 0:
                    _ping_burst(forger, p, before[p.address].threads)
                for proc in (p, d):
                    rss[proc.address].append(ProcStats.of(proc.popen.pid).rss_mb)
        finally:
            forger.close()
            stop.set()
            t.join(60)

        assert check_results(flow)["ok"] == len(flow) > 0, "requests failed during the flood"
        for a in (p.address, d.address):
            _assert_rejected(a, replies[a], sent[a])
        fresh_batch(p.address, [d.address], n=16, prefix="after")
        for a in (p.address, d.address):
            settle(a, quarantine_clears=True)
        for proc in (p, d):
            now = ProcStats.of(proc.popen.pid)
            before[proc.address].assert_bounded(now, proc.address, rss_mb=192)
            steps = sorted(b - a for a, b in itertools.pairwise(rss[proc.address]))
            print(proc.address, "RSS after each round (MB):", [round(x) for x in rss[proc.address]])
            # At most one step up between rounds, and no steady growth.
            assert steps[-2] < 16 and steps[-1] < 96, (proc.address, rss[proc.address])

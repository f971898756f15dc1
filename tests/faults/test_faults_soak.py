"""A bounded soak with randomly injected faults (issue 5, test 11). Marked ``slow``.

One P and three Ds at fixed ports serve a continuous mixed load (sizes 1-16 blocks, some
requests with deadlines short enough to abort after their PUSH_REG) for ``SOAK_S`` seconds while
an injector, every couple of seconds, picks one fault at random: SIGKILL a D and restart it at
its address, SIGKILL P and restart it, freeze a D (SIGSTOP) and thaw it, a burst of junk frames
on a side channel, or forged notifications from a third process. Afterwards every request has
ended (ok with every byte verified, or failed with a reason), the pools settle with nothing
quarantined, memory and handles are bounded and every endpoint serves a fresh batch.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from kvpush.commands.common.ports import free_port
from tests.support.cluster import Cluster, cluster_ctx
from tests.support.fault_legs import Result, run_leg
from tests.support.forger import Forger
from tests.support.invariants import check_results, fresh_batch, settle
from tests.support.junk import junk_frames
from tests.support.marks import skip_unless_marker_selected
from tests.support.procs import Proc
from tests.support.procstats import ProcStats

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SOAK_S = float(os.environ.get("KVPUSH_SOAK_S", "40"))


@pytest.fixture(autouse=True)
def _only_when_selected(request: pytest.FixtureRequest) -> None:
    skip_unless_marker_selected(request, "slow")


def _junk_burst(address: str, seed: int) -> None:
    import zmq

    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{address}")
    try:
        for frames in junk_frames(seed, 300, 4 << 20):
            s.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        pass
    finally:
        s.close(0)


def _inject(
    c: Cluster,
    rng: random.Random,
    forger: Forger,
    p: Proc,
    junk_targets: list[str],
    ports: dict[str, int],
) -> tuple[str, Proc]:
    """One fault picked at random; returns its kind and P (a new one after ``kill_p``)."""
    kind = rng.choice(["kill_d", "kill_d", "freeze_d", "freeze_d", "kill_p", "junk", "forge"])
    name = f"d{rng.randrange(3)}"
    if kind == "kill_d":
        c.kill(name)
        time.sleep(rng.uniform(0.1, 1.0))
        c.restart(name)
    elif kind == "freeze_d":
        c.freeze(name)
        time.sleep(rng.uniform(0.5, 3.0))
        c.thaw(name)
    elif kind == "kill_p":
        c.kill("p")
        time.sleep(rng.uniform(0.1, 1.0))
        p = c.restart("p")
    elif kind == "junk":
        _junk_burst(rng.choice(junk_targets), rng.randrange(1000))
    else:
        _forge(forger, p.address, f"soak-0-{rng.randrange(1, 50)}", ports[name], ports["p"])
    return kind, p


def _forge(forger: Forger, p_address: str, transfer_id: str, d_port: int, p_port: int) -> None:
    """A forged PushReg to P from a third process, naming a live transfer's id."""
    forger.connect(p_address)
    forger.send(
        p_address,
        {
            "type": "PushReg",
            "request_id": "soak-forged",
            "transfer_id": transfer_id,
            "decode_engine_id": "x",
            "decode_host": "127.0.0.1",
            "decode_port": d_port,
            "local_block_ids": [[0]],
            "remote_engine_id": "p-soak",
            "remote_host": "127.0.0.1",
            "remote_port": p_port,
        },
    )


def _warnings(log: str, last: int = 25) -> str:
    """An endpoint log's last warnings (a long quarantine says what its blocks wait for)."""
    lines = [ln[:400] for ln in log.splitlines() if " WARNING " in ln or " ERROR " in ln]
    return "\n".join(lines[-last:])


def test_soak_with_random_faults(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("KVPUSH_SOAK_SEED", "11")))
    ports = {n: free_port() for n in ("p", "d0", "d1", "d2")}
    with cluster_ctx(tmp_path) as c:
        p = c.start("prefill", "p", port=ports["p"], engine_id="p-soak")
        ds = [c.start("decode", f"d{i}", port=ports[f"d{i}"]) for i in range(3)]
        d_addrs = [d.address for d in ds]
        fresh_batch(p.address, d_addrs, n=12)
        # Baselines by name: a restarted endpoint is held to its predecessor's numbers.
        base = {n: ProcStats.of(proc.popen.pid) for n, proc in c.procs.items()}

        results: list[Result] = []
        lock = threading.Lock()
        stop = threading.Event()

        def client(k: int) -> None:
            crng = random.Random(k)
            i = 0
            while not stop.is_set():
                i += 1
                deadline = crng.choice([0.0, 0.0, 0.0, crng.uniform(0.005, 0.05)])
                r = run_leg(
                    f"soak-{k}-{i}",
                    p.address,
                    crng.choice(d_addrs),
                    crng.randint(1, 16),
                    deadline_s=deadline,
                    p_delay_s=crng.choice([0.0, 0.0, crng.uniform(0, 0.05)]),
                    d_timeout_s=10,
                    p_timeout_s=3,
                )
                with lock:
                    results.append(r)

        clients = [threading.Thread(target=client, args=(k,), name=f"c{k}") for k in range(4)]
        for t in clients:
            t.start()
        faults: Counter[str] = Counter()
        forger = Forger(tmp_path)
        try:
            end = time.monotonic() + SOAK_S
            while time.monotonic() < end:
                time.sleep(rng.uniform(1.0, 3.0))
                kind, p = _inject(c, rng, forger, p, [p.address, *d_addrs], ports)
                faults[kind] += 1
        finally:
            stop.set()
            forger.close()
            for n in ("d0", "d1", "d2"):
                c.thaw(n)
            for t in clients:
                t.join(60)

        reasons = check_results(results)
        print(f"soak {SOAK_S:.0f}s: faults {dict(faults)}; requests {dict(reasons)}")
        assert reasons["ok"] > 100, reasons
        _serves_and_settles(c)
        for n, proc in c.procs.items():
            base[n].assert_bounded(ProcStats.of(proc.popen.pid), f"{n} after the soak")


def _serves_and_settles(c: Cluster) -> None:
    """After the soak every endpoint serves a fresh batch, then every pool settles with nothing
    quarantined; a pool that does not says what each endpoint last warned about."""
    # P (and Ds) were restarted at the same ports: every pair re-handshakes as needed.
    p = c.procs["p"]
    d_addrs = [c.procs[f"d{i}"].address for i in range(3)]
    # The soak's last requests may still hold blocks: P's finished blocks of requests whose D
    # never registered (a D killed or frozen) until their lease lapses -- with seed 10 that was
    # all of P's pool, and the first fresh request was refused no_free_blocks.
    for a in (p.address, *d_addrs):
        settle(a, timeout_s=15)
    fresh_batch(p.address, d_addrs, n=24, prefix="after-soak")
    for name, proc in c.procs.items():
        try:
            settle(proc.address, timeout_s=15, quarantine_clears=True)
        except AssertionError as e:
            # What each endpoint said about what it waits for (its warnings, the last ones).
            said = {n: _warnings(q.log_text()) for n, q in c.procs.items()}
            raise AssertionError(
                f"{name}: {e}\n" + "\n".join(f"--- {n}:\n{w}" for n, w in said.items())
            ) from None

"""``bench fleet``'s first-request rows: a newly joined D's first request, with and without
``serve-* --prewarm``, beside the same D's steady p50.

Per mode: a registered P and a resident D (both with the mode's flags) and ``joins`` Ds that join
one at a time. The requests are sent by a *router* in this process that runs for the whole
mode: ``drive``'s own ``Driver`` (concurrency 1, verification on) at ``RATE`` requests/s, round
robin over the Ds it knows -- a client that has served the fleet for a while, so the first
request to a new D pays what the fleet pays (the pair's handshakes, the new D's own first
request) and not a new client process's start-up. Each join: the D is started, 3 s pass (the
same in both modes: the registry's join reached the P), then the router learns of it
(``Driver.add_decode``, as a router told by the registry): its first request there is the
*first*, the median of its next ``steady`` there the *steady p50* (the same client). The
router's socket to the new D is opened by that first request (``drive`` opens its sockets at
first use, it cannot open one when it learns of a peer): one loopback connection set-up, the
client's. What a new client pays on a warm pair is measured beside it, once the router let the
D go: a new ``Driver`` in this process (*a new client's first*: its own sockets to P and D) and
a new ``kvpush drive`` process (its interpreter's first calls too): the client's cost, not the
endpoints'. Runs on the scenario's thread (the router on its own); the endpoints are
``fleet_procs.Fleet``'s.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from kvpush.commands.bench.fleet_procs import Fleet, cli, wait_ready
from kvpush.commands.bench.procs import BenchError
from kvpush.commands.bench.stats import median
from kvpush.commands.common.results import DriveConfig, RequestResult
from kvpush.config import Role

POOL = (64, 2, 4096)
BLOCKS = 4
#: After a D is ready, before its first request: the registry's join reached the P.
JOIN_WAIT_S = 3.0
#: The router's pace (requests/s over all its Ds), and its requests per join (far more than a
#: join takes: the router is cancelled once the joins are done).
RATE = 40.0
REQUESTS_PER_JOIN = 3000


def pushes(p: str, d: str, n: int) -> list[float]:
    """Latencies (s) of ``n`` requests P -> D, in order, from one new in-process ``Driver``."""
    from kvpush.commands.drive.driver import DriveHooks, Driver

    got: dict[int, RequestResult] = {}
    lock = threading.Lock()

    def keep(r: RequestResult) -> None:
        with lock:
            got[r.index] = r

    cfg = DriveConfig(prefill=(p,), decode=(d,), requests=n, concurrency=1, blocks=BLOCKS)
    report = Driver(cfg, DriveHooks(on_result=keep)).run()
    bad = [r for r in got.values() if not r.ok]
    if bad or len(got) != n or report.verified != n:
        why = f"{bad[0].reason}: {bad[0].detail}" if bad else f"{report.verified} of {n} verified"
        raise BenchError(f"requests {p} -> {d} failed: {why}")
    return [got[i].latency_s for i in range(n)]


def drive_first(p: str, d: str) -> float:
    """A new ``kvpush drive`` process's one request P -> D (its own latency, not its start)."""
    _, r = cli("drive", "-p", p, "-d", d, "-n", "1", "-c", "1", "--blocks", str(BLOCKS), "--json")
    if r.returncode != 0 or not r.stdout.strip():
        raise BenchError(f"drive {p} -> {d} failed: {r.stderr[-500:]}")
    return float(json.loads(r.stdout)["latency_s"]["p50"])


class Router:
    """A ``Driver`` running for a whole mode; each D's results kept in order."""

    def __init__(self, p: str, d0: str, requests: int) -> None:
        from kvpush.commands.drive.driver import DriveHooks, Driver

        self._lock = threading.Lock()
        self._by_d: dict[str, list[RequestResult]] = {}
        cfg = DriveConfig(prefill=(p,), decode=(d0,), requests=requests, concurrency=1,
                          rate=RATE, blocks=BLOCKS)  # fmt: skip
        self.driver = Driver(cfg, DriveHooks(on_result=self._keep))
        self._thread = threading.Thread(target=self.driver.run, name="bench-router", daemon=True)
        self._thread.start()

    def _keep(self, r: RequestResult) -> None:
        with self._lock:
            self._by_d.setdefault(r.decode, []).append(r)

    def results(self, d: str) -> list[RequestResult]:
        with self._lock:
            return sorted(self._by_d.get(d, []), key=lambda r: r.index)

    def served(self, d: str, n: int, timeout_s: float = 120.0) -> list[RequestResult]:
        """Wait until ``d`` answered ``n`` requests (a failed one ends the wait: an error)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.results(d)
            bad = [r for r in got if not r.ok]
            if bad:
                raise BenchError(f"router request to {d} failed: {bad[0].reason}: {bad[0].detail}")
            if len(got) >= n:
                return got[:n]
            if time.monotonic() > deadline:
                raise BenchError(f"router: {len(got)} of {n} requests to {d} in {timeout_s:g}s")
            time.sleep(0.05)

    def close(self) -> None:
        self.driver.cancel()
        self.driver.cancel()  # no grace: what is in flight is cancelled
        self._thread.join(30)


def first_requests(fl: Fleet, joins: int, steady: int, prewarm: bool) -> dict[str, Any]:
    """``joins`` Ds join a registered P one at a time (see the module); the figures per join."""
    mode = "on" if prewarm else "off"
    extra = ["--prewarm"] if prewarm else []
    pi, d0 = wait_ready(
        [
            fl.serve(Role.PREFILL, f"pw-{mode}-p", POOL, True, extra),
            fl.serve(Role.DECODE, f"pw-{mode}-d", POOL, True, extra),
        ],
        180,
    )
    p = str(pi["address"])
    router = Router(p, str(d0["address"]), REQUESTS_PER_JOIN * (joins + 1))
    out: dict[str, Any] = {"prewarm": prewarm, "first_s": [], "steady_p50_s": []}
    out.update(client_first_s=[], process_first_s=[])
    try:
        router.served(str(d0["address"]), steady)  # the router (and P) warm: a fleet serving
        for j in range(joins):
            (di,) = wait_ready([fl.serve(Role.DECODE, f"pw-{mode}-d{j}", POOL, True, extra)], 180)
            d = str(di["address"])
            time.sleep(JOIN_WAIT_S)
            router.driver.add_decode(d)
            got = router.served(d, 1 + steady)
            router.driver.remove_peer(d)
            out["first_s"].append(got[0].latency_s)
            out["steady_p50_s"].append(median([r.latency_s for r in got[1:]]))
            time.sleep(2 / RATE)  # the router's request in flight there (if any) ends
            out["client_first_s"].append(pushes(p, d, 1)[0])
            out["process_first_s"].append(drive_first(p, d))
            fl.stop(int(di["pid"]))
    finally:
        router.close()
    fl.stop(int(d0["pid"]))
    fl.stop(int(pi["pid"]))
    return out

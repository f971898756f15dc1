"""Simulated registrants for ``bench fleet``'s scale rows: many members of a cluster, one process.

``python -m kvpush.commands.bench.fleet_sim URL CLUSTER MEMBERS PERIOD READY_FILE`` registers
``MEMBERS`` endpoint records in ``CLUSTER`` exactly as an endpoint's registrar lays them out
(``kvpush.fleet.record.registration_writes``), then rewrites each one's load summary every
``PERIOD`` seconds with a load that changed -- a fleet under steady load -- spread evenly over
the period (``kvpush.fleet.record.load_writes``), until ``READY_FILE.stop`` appears, when it
revokes its leases (every key goes at once) and exits. It writes ``READY_FILE`` once every
member is registered.

Light by design, so that a thousand fit beside the real endpoints on a small host: the records
share a few leases (one per ``PER_LEASE`` members, refreshed every TTL/3) instead of one each,
and the writes of one tick go to etcd in transactions of up to ``BATCH`` keys (one request, one
revision; a watcher still gets one event per key). The records are never reachable endpoints
(addresses on 127.0.0.2, a geometry no real bench endpoint shares): nobody contacts or pairs
with them. Runs on its own main thread.
"""

from __future__ import annotations

import json
import random
import sys
import time
import uuid
from pathlib import Path

from msgspec.structs import replace

from kvpush import __version__
from kvpush.config import Role
from kvpush.fleet.etcd import Etcd
from kvpush.fleet.record import (
    EndpointRecord,
    Geometry,
    Load,
    load_writes,
    registration_writes,
)

PER_LEASE = 100
BATCH = 100
LEASE_TTL_S = 30
TICK_S = 0.1
FIRST_PORT = 20000


def member(i: int) -> EndpointRecord:
    role = Role.PREFILL if i % 2 == 0 else Role.DECODE
    inc = uuid.uuid4().hex
    return EndpointRecord(
        role=role,
        engine_id=f"sim-{i}",
        incarnation=inc,
        address=f"127.0.0.2:{FIRST_PORT + i}",
        host="sim",
        pid=100000 + i,
        tp_size=1,
        wire="kvpush",
        geometry=Geometry(
            num_blocks=1024, layers=3, regions=6, block_bytes=4096, dtype="bf16", kv_layout="nhd"
        ),
        compat_hash="sim" + inc[:13],
        kvpush_version=__version__,
        nixl_version="sim",
        started_at=time.time(),
        agent_names=[f"sim-{i}-{inc[:8]}"],
        load=Load(free_blocks=1024, updated_at=time.time()),
    )


def _load(rec: EndpointRecord, rng: random.Random) -> Load:
    old = rec.load
    return Load(
        free_blocks=rng.randrange(0, 1024),
        in_flight=rng.randrange(0, 64),
        pushes_total=old.pushes_total + rng.randrange(1, 100),
        failures_total=old.failures_total,
        updated_at=time.time(),
    )


def main(argv: list[str]) -> int:
    url, cluster, n, period, ready = argv[0], argv[1], int(argv[2]), float(argv[3]), argv[4]
    etcd = Etcd(url, timeout_s=10.0)
    leases = [etcd.grant(LEASE_TTL_S) for _ in range((n + PER_LEASE - 1) // PER_LEASE)]
    stop = Path(ready + ".stop")  # the bench creates it: revoke the leases and exit
    recs = [member(i) for i in range(n)]
    for g, lease in enumerate(leases):
        group = recs[g * PER_LEASE : (g + 1) * PER_LEASE]
        items = [kv for r in group for kv in registration_writes(cluster, r)]
        for i in range(0, len(items), BATCH):
            etcd.put_many(items[i : i + BATCH], lease)
    Path(ready).write_text(json.dumps({"members": n, "leases": len(leases)}))
    rng = random.Random(7)
    t0 = next_refresh = time.monotonic()
    done = 0  # load writes issued (member-periods)
    while not stop.exists():
        now = time.monotonic()
        if now >= next_refresh:
            for lease in leases:
                etcd.refresh(lease)
            next_refresh = now + LEASE_TTL_S / 3
        due = int((now - t0) / period * n) - done  # members whose turn came since last tick
        by_lease: dict[int, list[tuple[str, bytes]]] = {}
        for k in range(done, done + due):
            i = k % n
            load = _load(recs[i], rng)
            recs[i] = replace(recs[i], load=load)
            by_lease.setdefault(i // PER_LEASE, []).extend(load_writes(cluster, recs[i]))
        done += max(0, due)
        for g, items in by_lease.items():
            for i in range(0, len(items), BATCH):
                etcd.put_many(items[i : i + BATCH], leases[g])
        time.sleep(max(0.0, TICK_S - (time.monotonic() - now)))
    for lease in leases:
        etcd.revoke(lease)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

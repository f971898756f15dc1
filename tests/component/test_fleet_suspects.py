"""``kvpush.fleet.suspects``: a registry hint moves nothing until the side channel proves it.

The one seam faked is the endpoint (``Looker``: what it holds, who answers at an address, the
eviction it is asked for); the suspects' own threads and pool run for real. Real side channels
and real endpoints are in ``tests/faults/test_fleet_hints.py``.
"""

from __future__ import annotations

import threading

import pytest

from kvpush.config import Role
from kvpush.fleet.record import EndpointRecord, Geometry
from kvpush.fleet.suspects import Suspects
from kvpush.peers.sighting import Sighting
from kvpush.telemetry.store import Telemetry
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(30)


def record(address: str = "10.0.0.1:5600", incarnation: str = "inc-1", nixl: str = "sidechannel"):
    return EndpointRecord(
        role=Role.PREFILL,
        engine_id="p-1",
        incarnation=incarnation,
        address=address,
        host="node-a",
        pid=1,
        tp_size=1,
        wire="kvpush",
        geometry=Geometry(
            num_blocks=64, layers=2, regions=4, block_bytes=4096, dtype="bfloat16", kv_layout="NHD"
        ),
        compat_hash="h",
        kvpush_version="0.1",
        started_at=0.0,
        agent_names=["p-1#inc"],
        nixl_metadata=nixl,
        nixl_namespace="/nixl/kvpush/default" if nixl == "etcd" else "",
    )


class Endpoint:
    """The fake seam: ``seen`` is who answers now; ``held`` whether the peer is held."""

    def __init__(self, seen: Sighting, held: bool = True) -> None:
        self.seen = seen
        self.held = held
        self.looks = 0
        self.forgotten: list[tuple[str, str | None, str, str]] = []
        self.lock = threading.Lock()

    def holds_peer(self, address: str, incarnation: str | None) -> bool:
        return self.held

    def look_at_peer(self, address: str) -> Sighting:
        with self.lock:
            self.looks += 1
        return self.seen

    def forget_peer(self, address: str, incarnation: str | None, reason: str, why: str) -> None:
        self.forgotten.append((address, incarnation, reason, why))


def run(ep: Endpoint, recheck_s: float = 0.1) -> tuple[Suspects, Telemetry, list[EndpointRecord]]:
    tm = Telemetry(Role.DECODE, "d-1")
    proven: list[EndpointRecord] = []
    s = Suspects(ep, tm, proven.append, recheck_s=recheck_s)
    s.start()
    return s, tm, proven


def counters(tm: Telemetry) -> dict[str, int]:
    return {k: int(v) for k, v in tm.snapshot().counters.items() if k.startswith("registry_")}


def test_a_refused_side_channel_proves_a_leave() -> None:
    ep = Endpoint(Sighting("refused", detail="connection refused"))
    s, tm, proven = run(ep)
    try:
        s.add("left", record(), held=True)
        wait_for(lambda: s.count() == 0, 10, "s.count() == 0")
        assert ep.forgotten == [
            ("10.0.0.1:5600", "inc-1", "peer_left", "registry left; connection refused")
        ]
        assert [r.address for r in proven] == ["10.0.0.1:5600"]
        assert counters(tm) == {
            "registry_hints": 1,
            "registry_hints_proven": 1,
            "registry_hints_refuted": 0,
        }
    finally:
        s.stop()


def test_another_incarnation_answering_proves_a_restart() -> None:
    ep = Endpoint(Sighting("answers", "inc-2", "incarnation inc-2"))
    s, _, _ = run(ep)
    try:
        s.add("restarted", record(), held=True)
        wait_for(lambda: s.count() == 0, 10, "s.count() == 0")
        assert [(f[1], f[2]) for f in ep.forgotten] == [("inc-1", "peer_restarted")]
    finally:
        s.stop()


def test_the_same_incarnation_answering_refutes_the_hint() -> None:
    ep = Endpoint(Sighting("answers", "inc-1", "incarnation inc-1"))
    s, tm, proven = run(ep)
    try:
        s.add("left", record(), held=True)
        wait_for(lambda: s.count() == 0, 10, "s.count() == 0")
        assert ep.forgotten == [] and proven == []
        assert counters(tm)["registry_hints_refuted"] == 1
    finally:
        s.stop()


def test_a_silent_peer_moves_nothing_and_is_looked_at_again_until_it_answers() -> None:
    ep = Endpoint(Sighting("silent", detail="no answer within 2s"))
    s, _, _ = run(ep)
    try:
        s.add("left", record(), held=True)
        wait_for(lambda: ep.looks >= 3, 10, "three looks")  # frozen: nothing done
        assert ep.forgotten == [] and s.count() == 1
        ep.seen = Sighting("answers", "inc-1")  # it resumed
        wait_for(lambda: s.count() == 0, 10, "s.count() == 0")
        assert ep.forgotten == []
    finally:
        s.stop()


def test_registered_again_ends_the_suspicion_and_a_peer_not_held_is_not_looked_at() -> None:
    ep = Endpoint(Sighting("silent"))
    s, _, _ = run(ep, recheck_s=60)
    try:
        s.add("left", record(), held=True)
        wait_for(lambda: ep.looks >= 1, 10, "ep.looks >= 1")
        assert s.clear("10.0.0.1:5600", "inc-2") is False  # another incarnation: still suspect
        assert s.clear("10.0.0.1:5600", "inc-1") is True
        assert s.count() == 0
        # The data path dropped the peer meanwhile: a later hint is not looked at.
        ep.held = False
        before = ep.looks
        s.add("left", record(), held=True)
        wait_for(lambda: s.count() == 0, 10, "s.count() == 0")
        assert ep.looks == before and ep.forgotten == []
    finally:
        s.stop()


def test_a_peer_not_held_with_nixl_keys_in_etcd_is_looked_at_for_them_only() -> None:
    ep = Endpoint(Sighting("refused", detail="refused"), held=False)
    s, tm, proven = run(ep)
    try:
        s.add("left", record(nixl="etcd"), held=False)
        wait_for(lambda: s.count() == 0, 10, "s.count() == 0")
        assert ep.forgotten == []  # nothing held: nothing to drop
        assert [r.nixl_metadata for r in proven] == ["etcd"]  # but its NIXL keys go
        assert counters(tm)["registry_hints"] == 0
    finally:
        s.stop()

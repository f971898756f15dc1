"""Layout v2's pure parts: the records apart and joined, what a registrant writes, who cleans a
departed agent's NIXL keys, and which peers ``--prewarm`` warms."""

from __future__ import annotations

import msgspec

from kvpush.config import Role
from kvpush.fleet.member import nixl_cleaner
from kvpush.fleet.prewarm import why_not
from kvpush.fleet.record import (
    EndpointRecord,
    Load,
    MemberRecord,
    decode_load,
    decode_member,
    encode_load,
    encode_member,
    joined,
    load_key,
    load_writes,
    member_key,
    registration_writes,
)
from tests.support.records import record


def test_membership_and_load_travel_apart_and_join_by_incarnation() -> None:
    rec = record(load=Load(free_blocks=7, updated_at=1.0))
    member = decode_member(encode_member(rec))
    assert type(member) is MemberRecord and b"free_blocks" not in encode_member(rec)
    load = decode_load(encode_load(rec))
    assert joined(member, load) == rec
    assert joined(member, None).load == Load()
    other = decode_load(encode_load(msgspec.structs.replace(rec, incarnation="older")))
    assert joined(member, other).load == Load()  # another incarnation's summary: not joined
    assert isinstance(joined(member, load), EndpointRecord)


def test_what_a_registrant_writes() -> None:
    rec = record("10.0.0.1:5600")
    keys = [k for k, _ in registration_writes("c", rec)]
    # the load first, so that a watcher's join carries it
    assert keys == [load_key("c", rec.address), member_key("c", rec.address)]
    assert keys[1] == "/kvpush/v2/clusters/c/members/10.0.0.1:5600"
    assert [k for k, _ in load_writes("c", rec)] == ["/kvpush/v2/clusters/c/load/10.0.0.1:5600"]


def test_one_member_cleans_a_departed_agents_nixl_keys() -> None:
    def etcd_mode(addr: str) -> EndpointRecord:
        return record(addr, nixl_metadata="etcd", nixl_namespace="/nixl/kvpush/c")

    gone = etcd_mode("10.0.0.1:5600")
    members = {a: etcd_mode(a) for a in ("10.0.0.1:5600", "10.0.0.2:5600", "10.0.0.3:5600")}
    members["10.0.0.0:1"] = record("10.0.0.0:1")  # side-channel mode: never asked
    asked = [a for a, r in members.items() if r.nixl_metadata == "etcd" and a != gone.address]
    cleaners = [a for a in asked if nixl_cleaner(a, gone, members)]
    assert cleaners == ["10.0.0.2:5600"]  # the lowest of the others, and it alone
    # Its own key already gone from its view: it still cleans (its own address counts).
    del members["10.0.0.2:5600"]
    assert nixl_cleaner("10.0.0.2:5600", gone, members)
    assert not nixl_cleaner(
        "10.0.0.3:5600", gone, {**members, "10.0.0.2:5600": etcd_mode("10.0.0.2:5600")}
    )
    assert not nixl_cleaner("10.0.0.2:5600", record("10.0.0.9:1"), members)  # no NIXL keys


def test_prewarm_warms_compatible_peers_of_the_other_role_only() -> None:
    p = record("10.0.0.1:5600", Role.PREFILL)
    d = record("10.0.0.2:5600", Role.DECODE)
    assert why_not(p, d) == "" and why_not(d, p) == ""
    assert why_not(p, record("10.0.0.3:5600", Role.PREFILL)) == "same role"
    assert why_not(p, msgspec.structs.replace(d, leaving=True)) == "leaving"
    assert why_not(p, msgspec.structs.replace(d, wire="vllm")) == "not on kvpush's wire"
    assert why_not(p, msgspec.structs.replace(d, compat_hash="other")).startswith("incompatible")

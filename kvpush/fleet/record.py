"""What an endpoint publishes in etcd, and where: the records (schema 2) and the key layout v2.

Key layout (versioned prefix; keyed by the endpoint's advertised side-channel address, so that an
endpoint restarted at the same address *replaces* its keys, and the new ``incarnation`` tells a
watcher it restarted). Membership and load live apart, both under the endpoint's one lease:

    /kvpush/v2/clusters/<cluster>/members/<host>:<port>  -> MemberRecord (JSON): written at
        registration and when it changes (``leaving``) only
    /kvpush/v2/clusters/<cluster>/load/<host>:<port>     -> LoadRecord (JSON): the load summary,
        rewritten every load period when it changed

so that a watcher of membership alone (every endpoint's own peer watch) never receives a load
write. ``EndpointRecord`` is the two joined, what the tools and views read. The values are JSON
(msgspec), small (a few hundred bytes) and readable with ``etcdctl get``. A reader refuses records
of another ``schema``; layout v1 (``/kvpush/v1/``: one key holding both) is neither read nor
written (docs/fleet.md, "Key layout and versioning"). Declarations and pure functions only: no
I/O, no threads.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, TypeVar

import msgspec
from msgspec import Struct

from kvpush.config import Role

if TYPE_CHECKING:
    from kvpush.config import PoolConfig
    from kvpush.wire.protocol import EndpointMetadata

SCHEMA = 2
ROOT = "/kvpush/v2"
#: The first layout (one key per endpoint, membership and load together): its prefix, only to
#: say that endpoints of an older kvpush are registered there.
V1_ROOT = "/kvpush/v1"
CLUSTER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class Geometry(Struct, frozen=True, kw_only=True):
    """The KV geometry of one rank's pool (what a peer must agree on)."""

    num_blocks: int
    layers: int
    regions: int
    block_bytes: int
    dtype: str
    kv_layout: str
    kv_heads: int = 1
    device: str = "cpu"

    @classmethod
    def of(cls, pool: PoolConfig | EndpointMetadata, mem_type: str) -> Geometry:
        """The geometry of ``pool`` (an endpoint's ``PoolConfig``, or a peer's metadata): every
        field of it, and ``device`` from the pool's NIXL memory type (``device_of``)."""
        return cls(**{f: getattr(pool, f) for f in _POOL_FIELDS}, device=device_of(mem_type))


def device_of(mem_type: str) -> str:
    """A record's ``device`` for a pool in NIXL's memory type ``mem_type``: ``cuda`` for
    ``VRAM``, else ``cpu`` -- one vocabulary whoever wrote the record (the endpoint itself,
    ``fleet`` looking at a listed kvpush endpoint or vLLM engine)."""
    return "cuda" if mem_type == "VRAM" else "cpu"


#: What ``Geometry.of`` reads of a pool (the same names in ``PoolConfig`` and the metadata).
_POOL_FIELDS = tuple(f for f in Geometry.__struct_fields__ if f != "device")


class Load(Struct, frozen=True, kw_only=True):
    """A small load summary, refreshed at a modest period (not per push)."""

    free_blocks: int = 0
    in_flight: int = 0
    pushes_total: int = 0  # ok pushes (P) / requests answered ok (D), cumulative
    failures_total: int = 0
    updated_at: float = 0.0  # unix time of this summary


class MemberRecord(Struct, frozen=True, kw_only=True):
    """The membership key's value: who the endpoint is (written at registration and on change)."""

    schema: int = SCHEMA
    role: Role
    engine_id: str
    incarnation: str
    address: str  # advertised side-channel HOST:PORT (the key)
    host: str  # the machine's name
    pid: int
    tp_size: int
    wire: str  # "kvpush" | "vllm"
    geometry: Geometry
    compat_hash: str
    kvpush_version: str
    nixl_version: str = ""
    metrics_url: str = ""
    started_at: float = 0.0  # unix time
    agent_names: list[str] = []  # one per rank (NIXL agent names)
    nixl_metadata: str = "sidechannel"  # or "etcd": agent metadata published with NIXL's backend
    nixl_namespace: str = ""  # NIXL_ETCD_NAMESPACE used when nixl_metadata == "etcd"
    # Written once, just before a graceful stop deletes the key: the endpoint drains what it
    # holds, so peers let its work finish instead of dropping it as gone (peer_left).
    leaving: bool = False


class EndpointRecord(MemberRecord, frozen=True, kw_only=True):
    """One endpoint as a router or an operator needs it: its membership and its load summary
    (``Load()`` where none was read: a membership-only reader, or no summary yet)."""

    load: Load = Load()


class LoadRecord(Struct, frozen=True, kw_only=True):
    """The load key's value: the summary of one incarnation (a summary left by an older
    incarnation is never joined to a newer one's membership)."""

    schema: int = SCHEMA
    incarnation: str
    load: Load


def check_cluster(name: str) -> str:
    """``name`` if it is a valid cluster name, else ValueError naming the rule."""
    if not CLUSTER_RE.match(name):
        raise ValueError(
            f"invalid cluster name {name!r}: use 1-63 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


def cluster_prefix(cluster: str) -> str:
    """The prefix holding every key of ``cluster``: membership and load (ends with '/')."""
    return f"{ROOT}/clusters/{check_cluster(cluster)}/"


def members_prefix(cluster: str) -> str:
    """The prefix of ``cluster``'s membership keys (what every endpoint's own watch follows)."""
    return cluster_prefix(cluster) + "members/"


def loads_prefix(cluster: str) -> str:
    """The prefix of ``cluster``'s load summaries (followed only by who wants them)."""
    return cluster_prefix(cluster) + "load/"


def v1_prefix(cluster: str) -> str:
    """Where an older kvpush (layout v1) registers the endpoints of ``cluster``."""
    return f"{V1_ROOT}/clusters/{check_cluster(cluster)}/endpoints/"


def member_key(cluster: str, address: str) -> str:
    return members_prefix(cluster) + address


def load_key(cluster: str, address: str) -> str:
    return loads_prefix(cluster) + address


_enc = msgspec.json.Encoder()
_member_dec = msgspec.json.Decoder(MemberRecord)
_load_dec = msgspec.json.Decoder(LoadRecord)
_MEMBER_FIELDS = MemberRecord.__struct_fields__
_Rec = TypeVar("_Rec", MemberRecord, LoadRecord)


def member_of(rec: MemberRecord) -> MemberRecord:
    """The membership part of ``rec`` (an ``EndpointRecord`` without its load)."""
    if type(rec) is MemberRecord:
        return rec
    return MemberRecord(**{f: getattr(rec, f) for f in _MEMBER_FIELDS})


def encode_member(rec: MemberRecord) -> bytes:
    """The membership key's value of ``rec`` (every field but the load summary)."""
    return _enc.encode(member_of(rec))


def encode_load(rec: EndpointRecord) -> bytes:
    """The load key's value of ``rec``: its incarnation and load summary."""
    return _enc.encode(LoadRecord(incarnation=rec.incarnation, load=rec.load))


def decode_member(raw: bytes) -> MemberRecord:
    """The membership record in ``raw``; ValueError when it is not one of this schema."""
    return _decoded(_member_dec, raw, "membership")


def decode_load(raw: bytes) -> LoadRecord:
    """The load record in ``raw``; ValueError when it is not one of this schema."""
    return _decoded(_load_dec, raw, "load")


def _decoded(dec: msgspec.json.Decoder[_Rec], raw: bytes, what: str) -> _Rec:
    """The ``what`` record ``dec`` reads in ``raw``; ValueError when it is not one of this
    schema (``what`` names the key in the message)."""
    try:
        rec = dec.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a kvpush v{SCHEMA} {what} record: {e}") from None
    if rec.schema != SCHEMA:
        raise ValueError(f"{what} record of schema {rec.schema}, this kvpush reads {SCHEMA}")
    return rec


def joined(member: MemberRecord, load: LoadRecord | None) -> EndpointRecord:
    """The endpoint as the views read it: ``member`` with ``load``'s summary when it is of the
    same incarnation (else an empty one)."""
    fields = {f: getattr(member, f) for f in _MEMBER_FIELDS}
    if load is not None and load.incarnation == member.incarnation:
        return EndpointRecord(**fields, load=load.load)
    return EndpointRecord(**fields)


def registration_writes(cluster: str, rec: EndpointRecord) -> list[tuple[str, bytes]]:
    """What an endpoint writes when it registers (one transaction, under its lease): its first
    load summary, then its membership -- in that order, so that a watcher reads one ``join``
    (or ``restart``) that carries the load, not a join and then an update."""
    return [
        (load_key(cluster, rec.address), encode_load(rec)),
        (member_key(cluster, rec.address), encode_member(rec)),
    ]


def load_writes(cluster: str, rec: EndpointRecord) -> list[tuple[str, bytes]]:
    """What it writes when its load summary (``rec.load``) changed: the load key alone."""
    return [(load_key(cluster, rec.address), encode_load(rec))]

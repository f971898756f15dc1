"""What an endpoint publishes in etcd, and where: the record (schema v1) and the key layout.

Key layout (versioned prefix; one key per endpoint, keyed by its advertised side-channel address so
that an endpoint restarted at the same address *replaces* its key, and the new ``incarnation``
tells a watcher it restarted):

    /kvpush/v1/clusters/<cluster>/endpoints/<host>:<port>   -> EndpointRecord (JSON), leased

The value is JSON (msgspec), small (a few hundred bytes) and readable with ``etcdctl get``. A
reader refuses records of another ``schema`` (a later layout lives under ``/kvpush/v2/``).
Declarations and pure functions only: no I/O, no threads.
"""

from __future__ import annotations

import re

import msgspec
from msgspec import Struct

from kvpush.config import Role

SCHEMA = 1
ROOT = "/kvpush/v1"
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


class Load(Struct, frozen=True, kw_only=True):
    """A small load summary, refreshed at a modest period (not per push)."""

    free_blocks: int = 0
    in_flight: int = 0
    pushes_total: int = 0  # ok pushes (P) / requests answered ok (D), cumulative
    failures_total: int = 0
    updated_at: float = 0.0  # unix time of this summary


class EndpointRecord(Struct, frozen=True, kw_only=True):
    """One endpoint as a router or an operator needs it."""

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
    load: Load = Load()
    # Written once, just before a graceful stop deletes the key: the endpoint drains what it
    # holds, so peers let its work finish instead of dropping it as gone (peer_left).
    leaving: bool = False


def check_cluster(name: str) -> str:
    """``name`` if it is a valid cluster name, else ValueError naming the rule."""
    if not CLUSTER_RE.match(name):
        raise ValueError(
            f"invalid cluster name {name!r}: use 1-63 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


def cluster_prefix(cluster: str) -> str:
    """The prefix holding every endpoint key of ``cluster`` (ends with '/')."""
    return f"{ROOT}/clusters/{check_cluster(cluster)}/endpoints/"


def endpoint_key(cluster: str, address: str) -> str:
    return cluster_prefix(cluster) + address


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(EndpointRecord)


def encode(rec: EndpointRecord) -> bytes:
    return _enc.encode(rec)


def decode(raw: bytes) -> EndpointRecord:
    """The record in ``raw``; ValueError when it is not a v1 record."""
    try:
        rec = _dec.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a kvpush v{SCHEMA} endpoint record: {e}") from None
    if rec.schema != SCHEMA:
        raise ValueError(f"endpoint record of schema {rec.schema}, this kvpush reads {SCHEMA}")
    return rec

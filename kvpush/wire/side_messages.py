"""The side-channel messages of kvpush's wire protocol (v1), and the endpoint metadata they carry.

Owns the request and reply structs of the side channel (handshake, stats, prefill and decode
legs, push wait, ping, decline, error) and their unions ``SideRequest`` / ``SideReply``, the
``EndpointMetadata`` a handshake returns and the compatibility fields and hash computed from
it. Declarations and pure functions only (no I/O, no threads); framing, size checks and the
reusable decoders are ``kvpush.wire.protocol``'s, which also keeps the version history.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal, TypeAlias

from msgspec import Meta, Struct

from kvpush.config import Role
from kvpush.wire.fields import (
    MAX_AGENT_METADATA_BYTES,
    Addr,
    DeadlineSeconds,
    NonNeg,
    Port,
    Pos,
    Seconds,
    SmallPos,
    Str1k,
    Str128,
    Str256,
)

MAX_DECLINE_BATCH = 1024  # transfers one DeclineReq may carry beyond its first

# --------------------------------------------------------------------------- metadata / handshake


#: Where an endpoint's KV pool lives, in NIXL's words.
DeviceKind: TypeAlias = Literal["DRAM", "VRAM"]


def device_kind(text: str) -> DeviceKind | None:
    """``text`` as a ``DeviceKind``; None when it names no memory kvpush knows."""
    if text == "DRAM":
        return "DRAM"
    if text == "VRAM":
        return "VRAM"
    return None


class EndpointMetadata(Struct, frozen=True, kw_only=True):
    """What an endpoint tells a peer about itself (never contains NIXL metadata bytes)."""

    protocol_version: int
    kvpush_version: Str128
    engine_id: Str128
    role: Role
    incarnation: Str128
    agent_name: Str256
    host: Str256
    port: Port
    tp_rank: NonNeg
    tp_size: SmallPos
    device_kind: DeviceKind
    device_id: NonNeg
    num_blocks: Pos
    layers: Pos
    regions: Pos
    block_bytes: Pos
    dtype: Str128
    kv_layout: Str128
    region_base_addrs: Annotated[list[Addr], Meta(max_length=1 << 16)]
    backends: Annotated[list[Str128], Meta(max_length=16)]
    nixl_version: Str128 = ""
    auth: bool = False
    kv_heads: Pos = 1  # the model's KV heads; 1: a single head replicated on every rank
    tp_ranks: Annotated[list[NonNeg], Meta(max_length=1 << 12)] = []  # ranks the endpoint serves
    ucx_version: Str128 = ""  # the UCX library NIXL uses ("": not readable, or an older kvpush)
    # A P that takes ``PushRegs`` (several PUSH_REGs in one notification; issue 30). False from
    # an older kvpush, a vLLM engine, a P on vLLM's wire or one run with --no-coalesce.
    takes_push_regs: bool = False

    @property
    def heads_per_rank(self) -> int:
        return 1 if self.kv_heads == 1 else self.kv_heads // max(1, self.tp_size)

    @property
    def model_block_bytes(self) -> int:
        """One region's page of the whole model (all ranks' shares): what both sides share."""
        return self.block_bytes * (self.kv_heads // self.heads_per_rank)


COMPAT_FIELDS: tuple[str, ...] = (
    "protocol_version",
    "dtype",
    "kv_layout",
    "block_bytes",
    "layers",
    "regions",
    "kv_heads",
)


def compat_fields(md: EndpointMetadata) -> dict[str, object]:
    """What must match for P to WRITE into D. ``block_bytes`` is the *model's* page of a region
    (every rank's share together), so endpoints with different TP sizes of one model agree."""
    out: dict[str, object] = {f: getattr(md, f) for f in COMPAT_FIELDS}
    out["block_bytes"] = md.model_block_bytes
    return out


def compat_fields_loose(md: dict[str, object]) -> dict[str, object]:
    """``compat_fields`` of metadata decoded as a plain map (a peer of another version)."""
    out = {f: md.get(f) for f in COMPAT_FIELDS}
    heads, tp, bb = md.get("kv_heads", 1), md.get("tp_size", 1), md.get("block_bytes")
    out["kv_heads"] = heads
    if isinstance(heads, int) and isinstance(tp, int) and isinstance(bb, int) and heads > 1:
        out["block_bytes"] = bb * tp
    return out


def compat_hash(md: EndpointMetadata) -> str:
    """Hash of what must match for P to WRITE into D: protocol, dtype, layout, geometry."""
    items = compat_fields(md)
    text = "|".join(f"{k}={items[k]}" for k in COMPAT_FIELDS)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def compat_differences(
    local: dict[str, object], remote: dict[str, object]
) -> list[tuple[str, object, object]]:
    """(field, local value, remote value) for every compatibility field that differs."""
    return [
        (f, local.get(f), remote.get(f)) for f in COMPAT_FIELDS if local.get(f) != remote.get(f)
    ]


class HandshakeReq(Struct, tag="handshake", frozen=True, kw_only=True):
    """Ask for the peer's metadata. ``full`` asks for NIXL metadata with memory regions."""

    rid: NonNeg = 0
    mode: Literal["notif", "full"] = "notif"
    requester: Str128 = ""
    tp_rank: NonNeg = 0  # which rank of the peer endpoint to describe


class HandshakeRep(Struct, tag="handshake", frozen=True, kw_only=True):
    rid: NonNeg = 0
    compat_hash: Str128
    metadata: Annotated[bytes, Meta(max_length=1 << 20)]  # msgpack(EndpointMetadata)
    agent_metadata: Annotated[bytes, Meta(max_length=MAX_AGENT_METADATA_BYTES)]
    server_clock: float


class StatsReq(Struct, tag="stats", frozen=True, kw_only=True):
    rid: NonNeg = 0


class StatsRep(Struct, tag="stats", frozen=True, kw_only=True):
    rid: NonNeg = 0
    snapshot: dict[str, object]


class PrefillReq(Struct, tag="prefill", frozen=True, kw_only=True):
    """Prefill leg: P fills ``num_blocks`` with the transfer's pattern and marks them finished.

    ``digest``: also return the sha256 of the filled bytes (region by region in region order,
    each region's blocks in the request's block order), what a D must receive."""

    rid: NonNeg = 0
    transfer_id: Str256
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 16)]
    request_id: Str256 = ""
    digest: bool = False
    # The W3C trace context of the caller's span (``drive``, ``leg``), so P's span joins its
    # trace; "" = none. Optional: a peer without them ignores them.
    traceparent: Str128 = ""
    tracestate: Str1k = ""


class PrefillRep(Struct, tag="prefill", frozen=True, kw_only=True):
    rid: NonNeg = 0
    transfer_id: Str256
    outcome: Literal["ok", "failed"]
    reason: Str256 = ""
    latency_s: float = 0.0
    sha256: Str128 = ""
    detail: Str1k = ""
    # On vLLM's wire: the kv_transfer_params a vLLM D needs to pull this request's KV in.
    kv_transfer_params: dict[Str128, str | int | bool | list[list[int]]] = {}


class PushWaitReq(Struct, tag="push_wait", frozen=True, kw_only=True):
    """Ask P how the push of a transfer ended; answered when it ends (or at ``timeout_s``)."""

    rid: NonNeg = 0
    transfer_id: Str256
    timeout_s: Seconds = 60.0


class PushWaitRep(Struct, tag="push_wait", frozen=True, kw_only=True):
    rid: NonNeg = 0
    transfer_id: Str256
    outcome: Literal["ok", "failed", "pending"]
    reason: Str128 = ""
    detail: Str1k = ""
    nbytes: NonNeg = 0
    sha256: Str128 = ""
    # P's phase stamps of the push (time.time() on P: kvpush.telemetry.phases), every rank's
    # latest; empty from a P without them (older kvpush, stamps off).
    phases: Annotated[dict[Str128, float], Meta(max_length=32)] = {}


class DecodeReq(Struct, tag="decode", frozen=True, kw_only=True):
    """Decode leg: D allocates blocks, registers them with P, waits for the push."""

    rid: NonNeg = 0
    transfer_id: Str256
    prefill_host: Str256
    prefill_port: Port
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 16)]
    request_id: Str256 = ""
    deadline_s: DeadlineSeconds = 0.0  # 0 = the endpoint's default
    # vLLM's wire: the kv_transfer_params of a vLLM P (the router contract).
    remote_engine_id: Str256 = ""
    remote_request_id: Str256 = ""
    remote_tp_size: SmallPos = 1
    remote_pp_size: SmallPos = 1
    digest: bool = False  # answer with the sha256 of the received bytes
    # Hold the request this long before it gets blocks (a vLLM request waiting in D's queue);
    # P's lease is heartbeated meanwhile.
    alloc_delay_s: Seconds = 0.0
    # The W3C trace context of the caller's span, as ``PrefillReq`` carries it.
    traceparent: Str128 = ""
    tracestate: Str1k = ""


class DecodeRep(Struct, tag="decode", frozen=True, kw_only=True):
    rid: NonNeg = 0
    transfer_id: Str256
    request_id: Str256 = ""
    outcome: Literal["ok", "failed"]
    reason: Str256 = ""
    detail: Str1k = ""
    latency_s: float = 0.0
    nbytes: NonNeg = 0
    verified: bool | None = None
    sha256: Str128 = ""
    # D's phase stamps of the request (time.time() on D: kvpush.telemetry.phases), as far as
    # it got; empty from a D without them (older kvpush, stamps off).
    phases: Annotated[dict[Str128, float], Meta(max_length=32)] = {}


class PingReq(Struct, tag="ping", frozen=True, kw_only=True):
    """Ask the endpoint to measure NIXL notification round trips to the requester."""

    rid: NonNeg = 0


class ErrorRep(Struct, tag="error", frozen=True, kw_only=True):
    rid: NonNeg = 0
    code: Str128
    message: Str1k
    hint: Str1k = ""


class DeclineReq(Struct, tag="decline", frozen=True, kw_only=True):
    """One side cannot take a transfer: the other frees what it holds for it at once.

    D -> P (D refused the request or failed it before registering: no free blocks,
    incompatible, deadline): P frees the transfer's finished blocks, or frees them the moment
    they finish. P -> D (P refused the prefill, or stops with the registration unserved): D
    fails the request at once with P's reason. Sent over the side channel, so it also reaches a
    peer no NIXL connection was made with; answered with how many entries it ended."""

    rid: NonNeg = 0
    transfer_id: Str256
    request_id: Str256 = ""  # D's request id (P -> D)
    reason: Str128
    detail: Str1k = ""
    origin: Role
    # D -> P: more transfers declined for the same reason (a refusing D under load batches
    # what queued up while the last one was sent, so P frees blocks as fast as D refuses);
    # ``request_id`` and ``detail`` are the first one's.
    also: Annotated[list[Str256], Meta(max_length=MAX_DECLINE_BATCH)] = []


class DeclineRep(Struct, tag="decline", frozen=True, kw_only=True):
    rid: NonNeg = 0
    ended: NonNeg = 0


SideRequest: TypeAlias = (
    HandshakeReq | StatsReq | PrefillReq | DecodeReq | PingReq | PushWaitReq | DeclineReq
)
SideReply: TypeAlias = (
    HandshakeRep | StatsRep | PrefillRep | DecodeRep | ErrorRep | PushWaitRep | DeclineRep
)

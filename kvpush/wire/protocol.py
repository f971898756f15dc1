"""kvpush's wire protocol: every byte that crosses a process boundary is defined here.

Two carriers:
* the **side channel** (ZMQ ROUTER on the server, DEALER/REQ on clients) carries handshakes and
  control requests as frames ``[b"", MAGIC_REQ + envelope]``;
* **NIXL notifications** carry PUSH_REG, completions, heartbeats, failures, cancels and fences as
  ``MAGIC_NOTIF + envelope``.

An envelope is ``msgpack(Envelope)`` whose ``body`` is the msgpack encoding of one tagged struct.
With a shared token the envelope carries an HMAC tag (``kvpush.wire.auth``); without one the tag is
empty. Frames are size-checked *before* any decoding, and decoding goes through reusable typed
decoders with field limits: nothing from the network is ever unpickled.

vLLM's forms (``get_meta_msg``, its two-part answer, ``PUSH_REG:``) live in ``kvpush.wire.vllm``.

History:
  v1 (kvpush 0.1): first version. Later fields are optional with defaults (a v1 peer without them
  still decodes): HandshakeReq.tp_rank, Cancel.decode_tp_rank, Ping.reply_rank, the vLLM-wire
  fields of DecodeReq/DecodeRep/PrefillReq/PrefillRep, PushWaitReq/PushWaitRep.
"""

from __future__ import annotations

import hashlib
import time
from typing import Annotated, Literal, TypeAlias, TypeVar

import msgspec
from msgspec import Meta, Struct

from kvpush import PROTOCOL_VERSION
from kvpush.errors import ProtocolError

MAGIC_REQ = b"KVQ\x01"
MAGIC_REP = b"KVR\x01"
MAGIC_NOTIF = b"KVN\x01"

MAX_FRAME_BYTES = 4 * 1024 * 1024
MAX_NOTIF_BYTES = 64 * 1024
MAX_AGENT_METADATA_BYTES = 2 * 1024 * 1024

Str128 = Annotated[str, Meta(max_length=128)]
Str256 = Annotated[str, Meta(max_length=256)]
Str1k = Annotated[str, Meta(max_length=1024)]
Port = Annotated[int, Meta(ge=0, le=65535)]
NonNeg = Annotated[int, Meta(ge=0)]
Pos = Annotated[int, Meta(ge=1)]
SmallPos = Annotated[int, Meta(ge=1, le=1 << 16)]
BlockId = Annotated[int, Meta(ge=0, lt=1 << 31)]
BlockList = Annotated[list[BlockId], Meta(max_length=1 << 16)]
Groups = Annotated[list[BlockList], Meta(max_length=64)]
Addr = Annotated[int, Meta(ge=0)]


class Envelope(Struct, array_like=True, frozen=True):
    """Carrier of one message: timestamp + nonce for replay protection, body, optional HMAC tag."""

    v: int
    ts: float
    nonce: Annotated[bytes, Meta(max_length=32)]
    body: bytes
    tag: Annotated[bytes, Meta(max_length=64)] = b""


# --------------------------------------------------------------------------- metadata / handshake


class EndpointMetadata(Struct, frozen=True, kw_only=True):
    """What an endpoint tells a peer about itself (never contains NIXL metadata bytes)."""

    protocol_version: int
    kvpush_version: Str128
    engine_id: Str128
    role: Literal["prefill", "decode"]
    incarnation: Str128
    agent_name: Str256
    host: Str256
    port: Port
    tp_rank: NonNeg
    tp_size: SmallPos
    device_kind: Literal["DRAM", "VRAM"]
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
    timeout_s: float = 60.0


class PushWaitRep(Struct, tag="push_wait", frozen=True, kw_only=True):
    rid: NonNeg = 0
    transfer_id: Str256
    outcome: Literal["ok", "failed", "pending"]
    reason: Str128 = ""
    detail: Str1k = ""
    nbytes: NonNeg = 0
    sha256: Str128 = ""


class DecodeReq(Struct, tag="decode", frozen=True, kw_only=True):
    """Decode leg: D allocates blocks, registers them with P, waits for the push."""

    rid: NonNeg = 0
    transfer_id: Str256
    prefill_host: Str256
    prefill_port: Port
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 16)]
    request_id: Str256 = ""
    deadline_s: float = 0.0  # 0 = the endpoint's default
    # vLLM's wire: the kv_transfer_params of a vLLM P (the router contract).
    remote_engine_id: Str256 = ""
    remote_request_id: Str256 = ""
    remote_tp_size: SmallPos = 1
    remote_pp_size: SmallPos = 1
    digest: bool = False  # answer with the sha256 of the received bytes
    # Hold the request this long before it gets blocks (a vLLM request waiting in D's queue);
    # P's lease is heartbeated meanwhile.
    alloc_delay_s: Annotated[float, Meta(ge=0, le=3600)] = 0.0


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
    origin: Literal["prefill", "decode"]


class DeclineRep(Struct, tag="decline", frozen=True, kw_only=True):
    rid: NonNeg = 0
    ended: NonNeg = 0


SideRequest: TypeAlias = (
    HandshakeReq | StatsReq | PrefillReq | DecodeReq | PingReq | PushWaitReq | DeclineReq
)
SideReply: TypeAlias = (
    HandshakeRep | StatsRep | PrefillRep | DecodeRep | ErrorRep | PushWaitRep | DeclineRep
)

# ----------------------------------------------------------------------------------- notifications


class PushReg(Struct, tag="push_reg", frozen=True, kw_only=True):
    """D -> every agent of P: D's blocks for a request are ready to be written into."""

    request_id: Str256
    transfer_id: Str256 = ""
    decode_engine_id: Str128
    decode_host: Str256
    decode_port: Port
    decode_tp_size: SmallPos = 1
    local_block_ids: Groups
    remote_engine_id: Str128
    remote_host: Str256
    remote_port: Port
    remote_tp_size: SmallPos = 1
    remote_pp_size: SmallPos = 1
    decode_incarnation: Str128 = ""
    decode_tp_rank: NonNeg = 0


class Completion(Struct, tag="done", frozen=True, kw_only=True):
    """Attached to P's WRITE: the blocks of ``request_id`` have landed."""

    request_id: Str256
    transfer_id: Str256 = ""
    p_tp_size: SmallPos = 1
    p_tp_rank: NonNeg = 0
    nbytes: NonNeg = 0


class Heartbeat(Struct, tag="hb", frozen=True, kw_only=True):
    """D -> P: D still waits for these transfers; P extends their leases."""

    transfer_ids: Annotated[list[Str256], Meta(max_length=4096)]


class Failure(Struct, tag="fail", frozen=True, kw_only=True):
    """P -> D: P cannot push this request; D fails it at once with the reason."""

    request_id: Str256
    transfer_id: Str256 = ""
    reason: Str128
    detail: Str1k = ""
    may_have_written: bool = False  # True: bytes may still land; D quarantines until a Fence


class Cancel(Struct, tag="cancel", frozen=True, kw_only=True):
    """D -> P: D abandoned this request; P must not WRITE into its blocks, and fences.

    Carries D's side-channel address so that P can acknowledge even before it ever connected
    to D (the common case: D's deadline passes before P finished its blocks)."""

    request_id: Str256
    transfer_id: Str256 = ""
    decode_host: Str256 = ""
    decode_port: Port = 0
    decode_tp_rank: NonNeg = 0


class Fence(Struct, tag="fence", frozen=True, kw_only=True):
    """P -> D, attached to a small WRITE into an abandoned request's (quarantined) block: every
    earlier WRITE of P to D has landed, so D may reuse the blocks of ``request_ids``."""

    fence_id: Str128
    request_ids: Annotated[list[Str256], Meta(max_length=4096)] = []


class Ping(Struct, tag="ping", frozen=True, kw_only=True):
    """Notification round trip probe: the peer answers with ``reply=True`` to ``reply_host:port``
    (handshaking back to it first if needed)."""

    seq: NonNeg
    reply: bool = False
    reply_host: Str256 = ""
    reply_port: Port = 0
    sent_at: float = 0.0
    reply_rank: NonNeg = 0


Notif: TypeAlias = PushReg | Completion | Heartbeat | Failure | Cancel | Fence | Ping

# ------------------------------------------------------------------------------ encoding/decoding

_enc = msgspec.msgpack.Encoder()
_env_dec = msgspec.msgpack.Decoder(Envelope)
_req_dec = msgspec.msgpack.Decoder(SideRequest)  # type: ignore[arg-type]
_rep_dec = msgspec.msgpack.Decoder(SideReply)  # type: ignore[arg-type]
_notif_dec = msgspec.msgpack.Decoder(Notif)  # type: ignore[arg-type]
_md_dec = msgspec.msgpack.Decoder(EndpointMetadata)
_md_loose_dec = msgspec.msgpack.Decoder(dict[str, object])


def encode(obj: object) -> bytes:
    return _enc.encode(obj)


def make_envelope_bytes(
    body: bytes, tag: bytes = b"", ts: float | None = None, nonce: bytes = b""
) -> bytes:
    env = Envelope(
        v=PROTOCOL_VERSION, ts=time.time() if ts is None else ts, nonce=nonce, body=body, tag=tag
    )
    return _enc.encode(env)


def check_size(data: bytes, limit: int, what: str) -> None:
    if len(data) > limit:
        raise ProtocolError(f"{what} of {len(data)} bytes exceeds the {limit}-byte limit")


def decode_envelope(data: bytes, magic: bytes, limit: int, what: str) -> Envelope:
    """Size-check, strip the magic, decode the envelope (body still opaque)."""
    check_size(data, limit, what)
    if not data.startswith(magic):
        raise ProtocolError(f"{what} has no kvpush magic")
    try:
        env = _env_dec.decode(memoryview(data)[len(magic) :])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        # RecursionError: msgspec recurses into (even unknown, skipped) nested values; a few
        # KiB of b"\x91" would otherwise escape as a non-protocol error and kill the thread.
        raise ProtocolError(f"malformed {what} envelope: {e}") from None
    if env.v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{what} uses protocol v{env.v}, this kvpush speaks v{PROTOCOL_VERSION}"
        )
    return env


_T = TypeVar("_T")


def decode_body(dec: msgspec.msgpack.Decoder[_T], body: bytes, what: str) -> _T:
    try:
        return dec.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise ProtocolError(f"malformed {what}: {e}") from None


def decode_request_body(body: bytes) -> SideRequest:
    return decode_body(_req_dec, body, "side-channel request")


def decode_reply_body(body: bytes) -> SideReply:
    return decode_body(_rep_dec, body, "side-channel reply")


def decode_notif_body(body: bytes) -> Notif:
    return decode_body(_notif_dec, body, "notification")


def encode_metadata(md: EndpointMetadata) -> bytes:
    return _enc.encode(md)


def decode_metadata(data: bytes) -> EndpointMetadata:
    check_size(data, 1 << 20, "endpoint metadata")
    return decode_body(_md_dec, data, "endpoint metadata")


def decode_metadata_loose(data: bytes) -> dict[str, object]:
    """Decode metadata as a plain map: used only to name differing fields of an incompatible
    peer (whose metadata may not fit our schema). Never passed to NIXL."""
    check_size(data, 1 << 20, "endpoint metadata")
    out = decode_body(_md_loose_dec, data, "endpoint metadata")
    if not isinstance(out, dict):
        raise ProtocolError("endpoint metadata is not a map")
    return out

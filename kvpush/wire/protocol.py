"""kvpush's wire protocol: every byte that crosses a process boundary is defined from here.

Two carriers:
* the **side channel** (ZMQ ROUTER on the server, DEALER/REQ on clients) carries handshakes and
  control requests as frames ``[b"", MAGIC_REQ + envelope]``;
* **NIXL notifications** carry PUSH_REG, completions, heartbeats, failures, cancels and fences as
  ``MAGIC_NOTIF + envelope``.

An envelope is ``msgpack(Envelope)`` whose ``body`` is the msgpack encoding of one tagged struct.
With a shared token the envelope carries an HMAC tag (``kvpush.wire.auth``); without one the tag is
empty. Frames are size-checked *before* any decoding, and decoding goes through reusable typed
decoders with field limits: nothing from the network is ever unpickled.

The messages are declared in ``kvpush.wire.side_messages`` (side channel, endpoint metadata)
and ``kvpush.wire.notif_messages`` (notifications), their field types and size limits in
``kvpush.wire.fields``; this module frames and decodes them and passes all their names on, so
that every user writes ``protocol.PushReg`` whichever module declares it. Pure; any thread.

vLLM's forms (``get_meta_msg``, its two-part answer, ``PUSH_REG:``) live in ``kvpush.wire.vllm``.

History:
  v1 (kvpush 0.1): first version. Later fields are optional with defaults (a v1 peer without them
  still decodes): HandshakeReq.tp_rank, Cancel.decode_tp_rank, Ping.reply_rank, the vLLM-wire
  fields of DecodeReq/DecodeRep/PrefillReq/PrefillRep, PushWaitReq/PushWaitRep,
  EndpointMetadata.ucx_version, DecodeRep.phases and PushWaitRep.phases (``drive --trace``),
  PrefillReq/DecodeReq.traceparent and .tracestate (OpenTelemetry's W3C context, issue 28).
  PushReg.batch_done and the ``Completions`` notification (issue 30): P sends ``Completions``
  only to a D whose PUSH_REG said ``batch_done``; a D without the field gets ``Completion``s.
  EndpointMetadata.takes_push_regs and the ``PushRegs`` notification (issue 30): D sends several
  PUSH_REGs in one notification only to a P whose metadata says ``takes_push_regs``.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta, Struct

from kvpush import PROTOCOL_VERSION
from kvpush.errors import BadValueError, ProtocolError
from kvpush.wire.fields import (
    MAX_AGENT_METADATA_BYTES,
    MAX_FRAME_BYTES,
    MAX_NOTIF_BYTES,
    Addr,
    BlockId,
    BlockList,
    Groups,
    NonNeg,
    Port,
    Pos,
    SmallPos,
    Str1k,
    Str128,
    Str256,
)
from kvpush.wire.notif_messages import (
    MAX_BATCH_DONE,
    MAX_BATCH_REGS,
    Cancel,
    Completion,
    Completions,
    Done,
    Failure,
    Fence,
    Heartbeat,
    Notif,
    Ping,
    PushReg,
    PushRegs,
    Reg,
    shares,
)
from kvpush.wire.side_messages import (
    COMPAT_FIELDS,
    DeclineRep,
    DeclineReq,
    DecodeRep,
    DecodeReq,
    EndpointMetadata,
    ErrorRep,
    HandshakeRep,
    HandshakeReq,
    PingReq,
    PrefillRep,
    PrefillReq,
    PushWaitRep,
    PushWaitReq,
    SideReply,
    SideRequest,
    StatsRep,
    StatsReq,
    compat_differences,
    compat_fields,
    compat_fields_loose,
    compat_hash,
)

__all__ = [
    "COMPAT_FIELDS",
    "MAGIC_NOTIF",
    "MAGIC_REP",
    "MAGIC_REQ",
    "MAX_AGENT_METADATA_BYTES",
    "MAX_BATCH_DONE",
    "MAX_BATCH_REGS",
    "MAX_FRAME_BYTES",
    "MAX_NOTIF_BYTES",
    "PROTOCOL_VERSION",
    "Addr",
    "BlockId",
    "BlockList",
    "Cancel",
    "Completion",
    "Completions",
    "DeclineRep",
    "DeclineReq",
    "DecodeRep",
    "DecodeReq",
    "Done",
    "EndpointMetadata",
    "Envelope",
    "ErrorRep",
    "Failure",
    "Fence",
    "Groups",
    "HandshakeRep",
    "HandshakeReq",
    "Heartbeat",
    "NonNeg",
    "Notif",
    "Ping",
    "PingReq",
    "Port",
    "Pos",
    "PrefillRep",
    "PrefillReq",
    "PushReg",
    "PushRegs",
    "PushWaitRep",
    "PushWaitReq",
    "Reg",
    "SideReply",
    "SideRequest",
    "SmallPos",
    "StatsRep",
    "StatsReq",
    "Str1k",
    "Str128",
    "Str256",
    "check_size",
    "compat_differences",
    "compat_fields",
    "compat_fields_loose",
    "compat_hash",
    "decode_body",
    "decode_envelope",
    "decode_metadata",
    "decode_metadata_loose",
    "decode_notif_body",
    "decode_reply_body",
    "decode_request_body",
    "encode",
    "encode_metadata",
    "make_envelope_bytes",
    "shares",
]

MAGIC_REQ = b"KVQ\x01"
MAGIC_REP = b"KVR\x01"
MAGIC_NOTIF = b"KVN\x01"


class Envelope(Struct, array_like=True, frozen=True):
    """Carrier of one message: timestamp + nonce for replay protection, body, optional HMAC tag."""

    v: int
    ts: float
    nonce: Annotated[bytes, Meta(max_length=32)]
    body: bytes
    tag: Annotated[bytes, Meta(max_length=64)] = b""


# ------------------------------------------------------------------------------ encoding/decoding

_enc = msgspec.msgpack.Encoder()
_env_dec = msgspec.msgpack.Decoder(Envelope)
_req_dec = msgspec.msgpack.Decoder(SideRequest)
_rep_dec = msgspec.msgpack.Decoder(SideReply)
_notif_dec = msgspec.msgpack.Decoder(Notif)
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
# msgspec's words for a number outside its ``Meta`` bounds (nan fails every bound).
_OUT_OF_RANGE = re.compile(r"Expected `(int|float)` (>=|<=|>|<) ")


def decode_body(dec: msgspec.msgpack.Decoder[_T], body: bytes, what: str) -> _T:
    try:
        return dec.decode(body)
    except msgspec.ValidationError as e:
        if _OUT_OF_RANGE.match(str(e)):
            # Well-formed, but a number out of its range (inf, nan, negative, huge).
            raise BadValueError(f"malformed {what}: {e}") from None
        raise ProtocolError(f"malformed {what}: {e}") from None
    except (msgspec.DecodeError, RecursionError) as e:
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

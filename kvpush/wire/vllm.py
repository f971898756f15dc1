"""vLLM 0.33's wire forms (``NIXL_CONNECTOR_VERSION = 15``), decoded with bounded, typed decoders.

* ``get_meta_msg``: the side-channel request ``msgpack((b"get_meta_msg", pp_rank, tp_rank))`` and
  its two-part answer ``[msgpack(NixlHandshakePayload), msgpack(perf_counter)]``. It is also
  every kvpush client's *first contact*: the one request a vLLM listener survives. A kvpush
  endpoint's answer carries ``KvpushIdentity`` under the extra key ``kvpush``.
* ``NixlAgentMetadata``: every field, decoded leniently for reporting and geometry matching.
* the three notification forms: ``PUSH_REG:`` + msgpack(map) (D -> P), ``"<D request id>:<P tp>"``
  attached to P's WRITE, and ``"HB:" + ",".join(P request ids)`` (D -> P lease renewals).

Nothing here is ever handed to NIXL or unpickled.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from kvpush.errors import ProtocolError
from kvpush.wire.protocol import (
    MAGIC_REQ,
    MAX_NOTIF_BYTES,
    Completion,
    Heartbeat,
    NonNeg,
    PushReg,
    SmallPos,
    Str1k,
    Str128,
    Str256,
    check_size,
    decode_body,
)

PUSH_REG_PREFIX = b"PUSH_REG:"
HB_PREFIX = b"HB:"
GET_META = b"get_meta_msg"

_enc = msgspec.msgpack.Encoder()
_push_reg_dec = msgspec.msgpack.Decoder(dict[str, object])


def is_get_meta(frame: bytes) -> tuple[int, int] | None:
    """Return (pp_rank, tp_rank) if ``frame`` is vLLM's ``msgpack((b"get_meta_msg", pp, tp))``."""
    if len(frame) > 256 or frame.startswith(MAGIC_REQ):
        return None
    try:
        obj = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if (
        isinstance(obj, list)
        and len(obj) == 3
        and obj[0] in (GET_META, GET_META.decode())
        and isinstance(obj[1], int)
        and isinstance(obj[2], int)
    ):
        return obj[1], obj[2]
    return None


def get_meta_request(pp_rank: int = 0, tp_rank: int = 0) -> bytes:
    return _enc.encode((GET_META, pp_rank, tp_rank))


#: ``KvpushIdentity.error`` of an endpoint whose roles have stopped (with ``stopping``): it
#: serves nothing more, and its side channel closes next.
SHUT_DOWN = "shutting down"


class KvpushIdentity(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a kvpush endpoint says who it is in its answer to vLLM's ``get_meta_msg``.

    Every first contact (probe, drive's preflight, every handshake) is a ``get_meta_msg``,
    because that is the one request vLLM's listener survives. A kvpush endpoint answers it in
    vLLM's two-part form with this map under the extra key ``kvpush`` (vLLM's decoder ignores
    unknown keys). With a token set, only ``protocol`` and ``auth=True`` are told.
    """

    protocol: int
    auth: bool = False
    version: Str128 = ""
    wire: Str128 = ""  # "kvpush" | "vllm": which framing the endpoint speaks to its peers
    role: Str128 = ""
    engine_id: Str256 = ""
    incarnation: Str128 = ""
    tp_size: SmallPos = 1
    ranks: Annotated[list[tuple[NonNeg, NonNeg]], Meta(max_length=4096)] = []
    error: Str1k = ""  # the endpoint could not serve the asked rank
    # Draining: it refuses new work (stats and handshakes are still served) and then stops.
    stopping: bool = False

    @property
    def shut_down(self) -> bool:
        """Its roles have stopped: nothing of it may be loaded, no request is served."""
        return self.stopping and self.error == SHUT_DOWN


class HandshakePayload(Struct, frozen=True, omit_defaults=True):
    """vLLM's ``NixlHandshakePayload``; ``kvpush`` is present only in a kvpush endpoint's answer."""

    compatibility_hash: Str256
    agent_metadata_bytes: Annotated[bytes, Meta(max_length=64 << 20)]
    kvpush: KvpushIdentity | None = None


class AgentMetadata(Struct, frozen=True, forbid_unknown_fields=False):
    """vLLM's ``NixlAgentMetadata`` (0.33, connector version 15), every field.

    Decoded leniently (defaults for what an older vLLM leaves out, unknown fields ignored):
    this is for reporting and for matching a peer's geometry; it is never handed to NIXL.
    """

    engine_id: Str256
    agent_metadata: bytes = b""
    kv_caches_base_addr: list[int] = []
    device_id: int = 0
    num_blocks: int = 0
    block_lens: list[int] = []
    block_strides: list[int] | None = None
    kv_cache_layout: str = ""
    block_size: int = 0
    ssm_sizes: list[int] | None = None
    attn_backend_name: str = ""
    physical_blocks_per_logical_kv_block: int | None = None
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = []
    packed_member_layouts: dict[str, tuple[int, int]] = {}


_payload_dec = msgspec.msgpack.Decoder(HandshakePayload)
_md_dec = msgspec.msgpack.Decoder(AgentMetadata)


def decode_payload(frame: bytes) -> HandshakePayload:
    check_size(frame, 64 << 20, "vLLM handshake payload")
    return decode_body(_payload_dec, frame, "vLLM handshake payload")


def decode_agent_metadata(data: bytes) -> AgentMetadata:
    return decode_body(_md_dec, data, "vLLM agent metadata")


_clock_dec = msgspec.msgpack.Decoder(float)


def decode_get_meta_reply(frames: list[bytes]) -> tuple[HandshakePayload, float]:
    """Decode the answer to ``get_meta_msg``: ``[payload, msgpack(perf_counter)]``.

    A leading empty delimiter frame (what a DEALER receives) is skipped. Raises
    ``ProtocolError`` when the answer is not in vLLM's form.
    """
    parts = frames[1:] if frames and frames[0] == b"" else list(frames)
    if len(parts) != 2:
        raise ProtocolError(f"answer has {len(parts)} parts, vLLM's form has 2")
    payload = decode_payload(parts[0])
    clock = decode_body(_clock_dec, parts[1], "clock part")
    return payload, clock


def encode_get_meta_reply(payload: HandshakePayload, clock: float) -> list[bytes]:
    return [_enc.encode(payload), _enc.encode(clock)]


_RANDOM_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def base_request_id(request_id: str) -> str:
    """vLLM's id without its per-request ``-<8 hex>`` suffix: P and D ids share this base."""
    return _RANDOM_SUFFIX_RE.sub("", request_id)


# ------------------------------------------------------------------------------ notifications

#: The keys of vLLM 0.33's PUSH_REG map, in vLLM's order; all but remote_pp_size are required.
PUSH_REG_KEYS: tuple[str, ...] = (
    "request_id",
    "decode_engine_id",
    "decode_host",
    "decode_port",
    "decode_tp_size",
    "local_block_ids",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_tp_size",
    "remote_pp_size",
)


def decode_push_reg(data: bytes) -> PushReg:
    """Decode vLLM's ``b"PUSH_REG:" + msgpack(map)`` into our PushReg (a missing key or a
    wrong type is a ``ProtocolError`` for this one notification, nothing else is dropped)."""
    check_size(data, MAX_NOTIF_BYTES, "PUSH_REG")
    obj = decode_body(_push_reg_dec, data[len(PUSH_REG_PREFIX) :], "PUSH_REG")
    try:
        return msgspec.convert(obj, PushReg)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"malformed PUSH_REG: {e}") from None


def encode_push_reg(reg: PushReg) -> bytes:
    """Our PushReg in vLLM's form: exactly vLLM's keys (kvpush's extras are left out)."""
    m = {
        "request_id": reg.request_id,
        "decode_engine_id": reg.decode_engine_id,
        "decode_host": reg.decode_host,
        "decode_port": reg.decode_port,
        "decode_tp_size": reg.decode_tp_size,
        "local_block_ids": reg.local_block_ids,
        "remote_engine_id": reg.remote_engine_id,
        "remote_host": reg.remote_host,
        "remote_port": reg.remote_port,
        "remote_tp_size": reg.remote_tp_size,
        "remote_pp_size": reg.remote_pp_size,
    }
    return PUSH_REG_PREFIX + _enc.encode(m)


def encode_completion(request_id: str, p_tp_size: int) -> bytes:
    """P's completion notification, attached to its WRITE: ``"<D request id>:<P tp size>"``."""
    return f"{request_id}:{p_tp_size}".encode()


def encode_heartbeat(p_request_ids: list[str]) -> bytes:
    """D's lease renewal: ``"HB:" + ",".join(P request ids)``."""
    return HB_PREFIX + ",".join(p_request_ids).encode()


def decode_notif(data: bytes) -> PushReg | Completion | Heartbeat:
    """One of vLLM's three notification forms, or ``ProtocolError``."""
    if data.startswith(PUSH_REG_PREFIX):
        return decode_push_reg(data)
    check_size(data, MAX_NOTIF_BYTES, "notification")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("notification is not UTF-8: not one of vLLM's forms") from None
    if text.startswith("HB:"):
        ids = [i for i in text[3:].split(",") if i]
        if any(len(i) > 256 for i in ids):
            raise ProtocolError("heartbeat names a request id longer than 256 characters")
        return Heartbeat(transfer_ids=ids)
    rid, sep, tp = text.rpartition(":")
    if not sep or not rid or not tp.isdigit() or len(rid) > 256 or not 0 < int(tp) <= 1 << 16:
        raise ProtocolError(f"notification {text[:64]!r} is not one of vLLM's forms")
    return Completion(request_id=rid, p_tp_size=int(tp))


# ------------------------------------------------------------------------------ our answer


def build_agent_metadata(
    *,
    engine_id: str,
    agent_metadata: bytes,
    base_addrs: list[int],
    device_id: int,
    num_blocks: int,
    block_len: int,
    kv_cache_layout: str,
    block_size: int,
    attn_backend_name: str,
    region_names: list[str] | None,
    mem_type: str,
) -> bytes:
    """``msgpack(NixlAgentMetadata)`` of a uniform pool, every field typed as vLLM decodes it."""
    regions = len(base_addrs)
    md = AgentMetadata(
        engine_id=engine_id,
        agent_metadata=agent_metadata,
        kv_caches_base_addr=list(base_addrs),
        device_id=device_id,
        num_blocks=num_blocks,
        block_lens=[block_len] * regions,
        block_strides=[block_len] * regions,
        kv_cache_layout=kv_cache_layout,
        block_size=block_size,
        ssm_sizes=[0, 0],
        attn_backend_name=attn_backend_name,
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[num_blocks] * regions,
        region_group_ids=[0] * regions,
        region_names=region_names,
        region_mem_types=[mem_type] * regions,
        dcp_size=1,
        pcp_size=1,
        ple_block_len=None,
        region_members=[],
        packed_member_layouts={},
    )
    return _enc.encode(md)

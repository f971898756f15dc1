"""vLLM 0.33's wire forms (``NIXL_CONNECTOR_VERSION = 15``), decoded with bounded, typed decoders.

* ``get_meta_msg``: the side-channel request ``msgpack((b"get_meta_msg", pp_rank, tp_rank))`` and
  its two-part answer ``[msgpack(NixlHandshakePayload), msgpack(perf_counter)]``. It is also
  every kvpush client's *first contact*: the one request a vLLM listener survives. A kvpush
  endpoint's answer carries ``KvpushIdentity`` under the extra key ``kvpush``.
* ``NixlAgentMetadata``: every field, decoded leniently for reporting and geometry matching.
* ``PUSH_REG:`` + msgpack(map) notifications.

Nothing here is ever handed to NIXL or unpickled.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from kvpush.errors import ProtocolError
from kvpush.wire.protocol import (
    MAGIC_REQ,
    MAX_NOTIF_BYTES,
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


def decode_push_reg(data: bytes) -> PushReg:
    """Decode vLLM's ``b"PUSH_REG:" + msgpack(map)`` into our PushReg."""
    check_size(data, MAX_NOTIF_BYTES, "PUSH_REG")
    obj = decode_body(_push_reg_dec, data[len(PUSH_REG_PREFIX) :], "PUSH_REG")
    try:
        return msgspec.convert(obj, PushReg)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"malformed PUSH_REG: {e}") from None

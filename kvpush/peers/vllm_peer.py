"""A vLLM peer's answer to ``get_meta_msg``, checked the way vLLM checks it. Pure.

``--wire vllm`` endpoints learn a peer from vLLM's two-part answer, not from kvpush's
``HandshakeRep``. The checks follow vLLM's own client (``base_worker._nixl_handshake``) in order:
the compatibility hash *before* anything is decoded, then ``NixlAgentMetadata``, then the engine
id, then the geometry a WRITE between the two needs (region count, block lengths and strides,
layout, block size in tokens, attention backend). Every difference is named with both values.
The result is the peer's metadata in kvpush's own ``EndpointMetadata`` shape, so the writer and
the receiver need no second code path.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush import PROTOCOL_VERSION
from kvpush.config import MLA_LAYOUT, Role, VllmWireConfig
from kvpush.errors import (
    HandshakeError,
    IncompatiblePeerError,
    PeerShuttingDownError,
    WrongWireError,
)
from kvpush.wire import protocol, side_messages, vllm


@dataclass(frozen=True)
class PeerHint:
    """What the caller knows of a vLLM peer before its handshake (from PUSH_REG or params)."""

    engine_id: str = ""
    tp_size: int = 1
    # The role the peer must have (None for any, e.g. probe): a peer of another role, or this
    # endpoint itself, fails the handshake before its agent is loaded.
    role: Role | None = None


def check_peer_role(peer: str, hint: PeerHint, role: str, incarnation: str, local_inc: str) -> None:
    """Refuse a peer that is not what the caller needs: this endpoint itself, or an endpoint
    of another role than ``hint.role`` (both named). ``role`` is the peer's own word, as it
    came (a kvpush peer's ``KvpushIdentity.role``); empty values are not known yet."""
    if incarnation and incarnation == local_inc:
        raise HandshakeError(
            peer,
            "it is this endpoint itself",
            f"name a {hint.role or 'peer'} endpoint's address, not this endpoint's own",
        )
    if hint.role and role and role != hint.role:
        raise HandshakeError(
            peer,
            f"it is a {role} endpoint, not a {hint.role} endpoint",
            f"name the side-channel address of a {hint.role} endpoint",
        )


@dataclass(frozen=True)
class VllmPeer:
    metadata: protocol.EndpointMetadata
    agent_metadata: bytes
    block_strides: list[int]


HASH_HINT = (
    "both sides must run the same model, dtype, KV cache dtype, attention backend and vLLM "
    "version; start kvpush with --like HOST:PORT of the peer to take its hash and geometry"
)


def check_vllm_answer(
    peer: str,
    payload: vllm.HandshakePayload,
    local: protocol.EndpointMetadata,
    wire: VllmWireConfig,
    hint: PeerHint,
    peer_role: Role,
) -> VllmPeer:
    """The peer's answer checked in vLLM's order: who answered (a kvpush endpoint says), the
    compatibility hash before anything is decoded, the engine id, then the geometry."""
    kv = payload.kvpush
    if kv is not None and not payload.agent_metadata_bytes:
        if kv.shut_down:  # a kvpush endpoint whose roles have stopped: nothing more to load
            raise PeerShuttingDownError(
                f"{peer}: it is shutting down", "send it to another endpoint"
            )
        if kv.error == "starting":  # its answer says nothing else yet (no wire, no role)
            raise HandshakeError(peer, "starting", "retry shortly: it is still building its ranks")
    if kv is not None:
        _check_identity(peer, kv, local, hint)
    if not payload.compatibility_hash or not payload.agent_metadata_bytes:
        why = kv.error if kv is not None and kv.error else "no metadata in its answer"
        raise HandshakeError(peer, why)
    if payload.compatibility_hash != wire.compat_hash:
        raise IncompatiblePeerError(
            f"{peer} has another vLLM compatibility hash: local {wire.compat_hash}, "
            f"remote {payload.compatibility_hash}",
            [("compatibility_hash", wire.compat_hash, payload.compatibility_hash)],
            HASH_HINT,
        )
    md = vllm.decode_agent_metadata(payload.agent_metadata_bytes)
    if hint.engine_id and md.engine_id != hint.engine_id:
        raise HandshakeError(
            peer,
            f"engine id {md.engine_id!r}, expected {hint.engine_id!r}",
            "check the engine id in kv_transfer_params / PUSH_REG: another engine answers there",
        )
    strides = _check_geometry(peer, md, local, wire, hint)
    mem_type = (md.region_mem_types or ["DRAM"])[0]
    mem = side_messages.device_kind(mem_type)
    if mem is None:
        raise HandshakeError(peer, f"unknown memory type {mem_type!r}")
    # A kvpush peer's own word on its TP size; a vLLM engine's metadata has none (the
    # router's is used).
    tp_size = kv.tp_size if kv is not None and kv.engine_id else max(1, hint.tp_size)
    meta = protocol.EndpointMetadata(
        protocol_version=PROTOCOL_VERSION,
        kvpush_version="vllm",
        engine_id=md.engine_id,
        role=peer_role,
        incarnation="",
        agent_name="",
        host="",
        port=0,
        tp_rank=0,
        tp_size=tp_size,
        device_kind=mem,
        device_id=md.device_id,
        num_blocks=md.num_blocks,
        layers=local.layers,
        regions=len(md.kv_caches_base_addr),
        block_bytes=md.block_lens[0] if md.block_lens else local.block_bytes,
        dtype=local.dtype,
        kv_layout=md.kv_cache_layout,
        region_base_addrs=list(md.kv_caches_base_addr),
        backends=["UCX"],
    )
    return VllmPeer(meta, md.agent_metadata, strides)


def _check_identity(
    peer: str, kv: vllm.KvpushIdentity, local: protocol.EndpointMetadata, hint: PeerHint
) -> None:
    """A kvpush endpoint answered: it must speak vLLM's wire, have the role asked for, not be
    this endpoint, and have the TP size the request claims."""
    if kv.wire != "vllm":
        raise WrongWireError(
            f"{peer} is a kvpush endpoint speaking kvpush's wire, not vLLM's",
            "kvpush",
            "start that endpoint with --wire vllm too, or this one without it",
        )
    check_peer_role(peer, hint, kv.role, kv.incarnation, local.incarnation)
    if kv.engine_id and hint.role and hint.tp_size != kv.tp_size:
        # A kvpush endpoint says its own TP size: a request that claims another is refused
        # before any other rank is asked for (a vLLM engine's own metadata has no TP size).
        raise IncompatiblePeerError(
            f"{peer} has {kv.tp_size} TP rank(s), the request claims {hint.tp_size} "
            "(remote_tp_size)",
            [("tp_size", hint.tp_size, kv.tp_size)],
            "pass the P's own tp_size from its kv_transfer_params",
        )


def _check_geometry(
    peer: str,
    md: vllm.AgentMetadata,
    local: protocol.EndpointMetadata,
    wire: VllmWireConfig,
    hint: PeerHint,
) -> list[int]:
    """What a WRITE between the two needs to match (every difference named with both
    values); the peer's block stride per region."""
    regions = len(md.kv_caches_base_addr)
    strides = list(md.block_strides) if md.block_strides is not None else list(md.block_lens)
    diffs: list[tuple[str, object, object]] = []

    def differ(field: str, ours: object, theirs: object) -> None:
        if ours != theirs:
            diffs.append((field, ours, theirs))

    differ("regions", local.regions, regions)
    differ("block_lens", [_peer_page(local, hint)] * local.regions, list(md.block_lens))
    differ("kv_cache_layout", local.kv_layout, md.kv_cache_layout)
    differ("block_size", wire.block_size, md.block_size)
    differ("attn_backend_name", wire.attn_backend_name, md.attn_backend_name)
    if diffs:
        text = "; ".join(f"{f}: local={a!r} remote={b!r}" for f, a, b in diffs)
        raise IncompatiblePeerError(
            f"{peer} is incompatible: {text}",
            diffs,
            "start kvpush with --like HOST:PORT of the peer to take its geometry",
        )
    if len(strides) != regions or any(s < n for s, n in zip(strides, md.block_lens, strict=True)):
        raise HandshakeError(peer, "block strides shorter than block lengths, or missing")
    if md.num_blocks < 1 or not md.agent_metadata:
        raise HandshakeError(peer, "metadata names no blocks or no NIXL agent")
    return strides


def _peer_page(local: protocol.EndpointMetadata, hint: PeerHint) -> int:
    """The page length a vLLM peer at ``hint.tp_size`` ranks has per region: ours when the TP
    sizes match or the one latent head is replicated (MLA); else the model's page, which our
    ranks split, split over its ranks instead (heads outermost, VLLM_INTEROP.md section 4)."""
    peer_tp = max(1, hint.tp_size)
    if peer_tp == local.tp_size or local.kv_layout.upper() == MLA_LAYOUT:
        return local.block_bytes
    return local.block_bytes * local.tp_size // peer_tp

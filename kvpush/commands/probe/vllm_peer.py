"""Probing a vLLM engine's side channel (or a kvpush endpoint on vLLM's wire) without harming it.

Owns what ``kvpush probe`` does with a peer on vLLM's push wire: it is only ever sent
``get_meta_msg`` on the one connection (the one request vLLM's listener survives), ``count``
times for the round trips; its ``NixlAgentMetadata`` is decoded with kvpush's bounded, typed
decoder, reported by size only and never handed to NIXL; its geometry is compared with a local
one (``vllm_differences``) and the ``kvpush`` command lines that would stand in for it are
suggested. Also the probe's own tiny endpoint for a handshake with it (``tiny_vllm_config``).
Runs on the caller's thread, on the client that ``kvpush.commands.probe.probe.probe`` opened there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvpush.commands.common.like import likeness_of
from kvpush.commands.probe.kvpush_peer import DRAINING, stopped
from kvpush.commands.probe.report import ProbeReport, answered
from kvpush.config import EndpointConfig, PoolConfig, Role
from kvpush.errors import KvpushError, PeerError
from kvpush.wire import vllm

if TYPE_CHECKING:
    from kvpush.transport.client import PeerIdentity, SideChannelClient


def vllm_differences(
    local: dict[str, object], md: vllm.AgentMetadata
) -> list[tuple[str, object, object]]:
    """What differs between a local geometry (``local_compat_fields``) and a vLLM peer's."""
    diffs: list[tuple[str, object, object]] = []
    regions = len(md.kv_caches_base_addr)
    if local.get("regions") != regions:
        diffs.append(("regions", local.get("regions"), regions))
    lens = sorted(set(md.block_lens))
    if [local.get("block_bytes")] != lens:
        diffs.append(("block_bytes", local.get("block_bytes"), lens[0] if len(lens) == 1 else lens))
    if local.get("kv_layout") != md.kv_cache_layout:
        diffs.append(("kv_layout", local.get("kv_layout"), md.kv_cache_layout))
    return diffs


def measure(
    addr: str,
    client: SideChannelClient,
    first: PeerIdentity,
    count: int,
    local: dict[str, object] | None,
) -> ProbeReport:
    """A vLLM side channel: only ever ``get_meta_msg`` on the one connection."""
    samples: list[tuple[float, float, float]] = []
    ident = first
    for _ in range(count):
        ident = client.identify(*first.ranks)
        samples.append((ident.t_send, ident.t_recv, ident.remote_clock))
    payload = ident.payload
    if not payload.agent_metadata_bytes:
        kv = payload.kvpush
        if kv is not None and kv.shut_down:
            raise stopped(addr)
        raise PeerError(
            f"{addr} answered rank {first.ranks[0]},{first.ranks[1]} without metadata"
            + (f": {kv.error}" if kv is not None and kv.error else ""),
            "ask for a rank it serves",
        )
    md = vllm.decode_agent_metadata(payload.agent_metadata_bytes)
    meta: dict[str, object] = msgspec.structs.asdict(md)
    del meta["agent_metadata"]
    meta["agent_metadata_bytes"] = len(md.agent_metadata)
    meta["regions"] = len(md.kv_caches_base_addr)
    meta["kv_caches_base_addr"] = [hex(a) for a in md.kv_caches_base_addr]
    meta["ranks"] = [list(first.ranks)]
    notes = [
        "vLLM side channel: only get_meta_msg was sent; the clock offset compares "
        "perf_counter clocks (meaningful on the same host only)"
    ]
    kv = payload.kvpush
    if kv is not None:
        meta["kvpush"] = msgspec.structs.asdict(kv)
        notes = [f"a kvpush endpoint ({kv.role}) speaking vLLM's push wire"]
        if kv.stopping:
            notes.append(DRAINING)
    suggest: list[str] = []
    try:
        lk = likeness_of(payload, addr)
        suggest = [
            f"kvpush serve-decode --wire vllm --like {addr}   # receive its pushes",
            f"kvpush serve-prefill --wire vllm --like {addr}   # push into it",
            "kvpush " + " ".join(lk.options(Role.DECODE)) + "   # the same, without the peer up",
        ]
    except KvpushError as e:
        notes.append(f"kvpush cannot stand in for it: {e.message}")
    diffs = vllm_differences(local, md) if local is not None else []
    if local is not None:
        notes.append("dtype is not in vLLM's metadata: it is part of the compatibility hash")
    hash_ = payload.compatibility_hash
    return answered(addr, "vllm", hash_, meta, samples, local, diffs, notes=notes, suggest=suggest)


def tiny_vllm_config(address: str, base: EndpointConfig) -> EndpointConfig:
    """The probe's own endpoint for a vLLM peer: its geometry and hash (``--like``), 4 blocks,
    on vLLM's wire, so that the handshake passes the same checks a real deployment's would."""
    from kvpush.commands.common.like import like
    from kvpush.config import Wire

    lk = like(address, timeout_s=base.timeouts.side_channel_s)
    pool = PoolConfig(
        num_blocks=4,
        layers=lk.layers,
        block_bytes=lk.block_bytes,
        device=base.pool.device,
        dtype="uint8",
        kv_layout=lk.kv_layout,
        kv_regions=lk.kv_regions,
    )
    return EndpointConfig(
        role=Role.DECODE,
        host=base.host,
        port=0,
        pool=pool,
        agent=base.agent,
        timeouts=base.timeouts,
        wire=Wire.VLLM,
        vllm=lk.wire,
    )

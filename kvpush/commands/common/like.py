"""``--like HOST:PORT``: the geometry and compatibility hash of a running vLLM peer.

Asks the peer's side channel with ``get_meta_msg`` only (safe for a vLLM listener), decodes its
``NixlAgentMetadata`` and turns it into what a ``--wire vllm`` kvpush endpoint needs to fit that
peer: the region layout (one region per layer with K|V inside, as vLLM allocates on CPU, or
separate K and V regions), block length, layout, block size in tokens, attention backend, layer
names and the compatibility hash. ``command_line`` prints the kvpush command that would match.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.address import format_address, parse_address
from kvpush.config import KvRegions, Role, VllmWireConfig
from kvpush.errors import IncompatiblePeerError, PeerError
from kvpush.transport.client import SideChannelClient
from kvpush.wire import vllm


@dataclass(frozen=True)
class Likeness:
    """A vLLM peer, as the options of a kvpush endpoint that fits it."""

    address: str
    engine_id: str
    wire: VllmWireConfig
    layers: int
    kv_regions: KvRegions
    block_bytes: int
    kv_layout: str
    num_blocks: int  # the peer's; a kvpush endpoint chooses its own

    def options(self, role: Role) -> list[str]:
        opts = [
            f"serve-{role}",
            "--wire",
            "vllm",
            "--layers",
            str(self.layers),
            "--kv-regions",
            self.kv_regions.value,
            "--block-bytes",
            str(self.block_bytes),
            "--kv-layout",
            self.kv_layout,
            "--vllm-block-size",
            str(self.wire.block_size),
            "--attn-backend",
            self.wire.attn_backend_name,
            "--compat-hash",
            self.wire.compat_hash,
        ]
        return opts


def likeness_of(
    payload: vllm.HandshakePayload, address: str, regions_hint: KvRegions | None = None
) -> Likeness:
    """What a vLLM peer's answer says about its geometry (pure)."""
    if not payload.agent_metadata_bytes:
        raise PeerError(
            f"{address} answered without metadata: it is not a vLLM engine serving that rank",
            "point --like at a vLLM engine's side channel (VLLM_NIXL_SIDE_CHANNEL_PORT)",
        )
    md = vllm.decode_agent_metadata(payload.agent_metadata_bytes)
    lens = set(md.block_lens)
    if len(lens) != 1:
        raise IncompatiblePeerError(
            f"{address} has regions of different block lengths {sorted(lens)}: kvpush pools "
            "are uniform",
            [("block_lens", "uniform", list(md.block_lens))],
            "kvpush can stand in for models with one block length per page",
        )
    regions = len(md.kv_caches_base_addr)
    names = tuple(md.region_names) if md.region_names else None
    # vLLM's CPU and block-contiguous layouts keep K|V inside one region per layer; a model's
    # layer names (one per region) say so too.
    split = regions_hint or (
        KvRegions.PER_LAYER
        if names is not None or md.kv_cache_layout.startswith("LB")
        else KvRegions.PER_KV
    )
    layers = regions if split == KvRegions.PER_LAYER else regions // 2
    if split == KvRegions.PER_KV and regions % 2:
        raise IncompatiblePeerError(
            f"{address} has {regions} regions: not K and V per layer",
            [("regions", "even", regions)],
            "use --kv-regions per-layer",
        )
    return Likeness(
        address=address,
        engine_id=md.engine_id,
        wire=VllmWireConfig(
            compat_hash=payload.compatibility_hash,
            block_size=md.block_size,
            attn_backend_name=md.attn_backend_name,
            region_names=names,
            device_id=md.device_id,
        ),
        layers=max(1, layers),
        kv_regions=split,
        block_bytes=next(iter(lens)),
        kv_layout=md.kv_cache_layout,
        num_blocks=md.num_blocks,
    )


def like(address: str, timeout_s: float = 5.0, ranks: tuple[int, int] = (0, 0)) -> Likeness:
    """Ask a running vLLM peer (get_meta_msg only) what a kvpush endpoint must look like."""
    host, port = parse_address(address)
    addr = format_address(host, port)
    with SideChannelClient(host, port, timeout_s=timeout_s) as client:
        ident = client.identify(*ranks)
    kv = ident.kvpush
    if kv is not None and kv.wire != "vllm":
        raise PeerError(
            f"{addr} is a kvpush endpoint on kvpush's wire: there is no vLLM geometry to copy",
            "point --like at a vLLM engine (or a kvpush endpoint started with --wire vllm)",
        )
    return likeness_of(ident.payload, addr)

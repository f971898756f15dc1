"""KV-cache geometry of real models, by name: the one table ``--shape`` options read.

Pure (no torch, no NIXL). A ``Shape`` says how one rank of a model lays out its KV cache in a
paged pool: ``regions`` registered regions (K and V of every layer, or one latent per layer
for MLA), each cut into pages of ``block_tokens`` tokens (``page_bytes`` bytes). A request of
``t`` tokens needs ``ceil(t / block_tokens)`` blocks, and a push of it is one descriptor per
block per region before NIXL merges consecutive ones (``kvpush.memory.descriptors``).

Figures (public model configs): Llama 3 8B has 32 layers, 8 KV heads of dim 128; Llama 3 70B
has 80 layers and 8 KV heads, so one rank at TP 8 holds 1 head; DeepSeek V3 (MLA) caches one
576-wide latent per token per layer (512 compressed KV + 64 RoPE) in 64-token pages, 61 layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvpush.config import DTYPE_SIZES, MLA_LAYOUT, KvRegions, PoolConfig
from kvpush.errors import ConfigError


@dataclass(frozen=True)
class Shape:
    """One rank's paged KV layout. ``layout`` is ``"kv"`` (a K and a V region per layer) or
    ``"latent"`` (one region per layer, MLA)."""

    name: str
    layers: int
    regions: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype: str
    layout: str
    tp: int = 1
    note: str = ""

    def __post_init__(self) -> None:
        if self.layout not in ("kv", "latent"):
            raise ValueError(f"layout must be 'kv' or 'latent', got {self.layout!r}")
        per_layer = 2 if self.layout == "kv" else 1
        if self.regions != self.layers * per_layer:
            raise ValueError(
                f"{self.name}: {self.layout} layout of {self.layers} layers has "
                f"{self.layers * per_layer} regions, not {self.regions}"
            )
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if min(self.layers, self.block_tokens, self.kv_heads, self.head_dim, self.tp) <= 0:
            raise ValueError(f"{self.name}: every dimension must be positive")

    @property
    def regions_per_layer(self) -> int:
        return self.regions // self.layers

    @property
    def page_bytes(self) -> int:
        """Bytes of one block in one region (``PoolConfig.block_bytes``)."""
        return self.block_tokens * self.kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def block_bytes_all_regions(self) -> int:
        return self.regions * self.page_bytes

    def blocks_for(self, tokens: int) -> int:
        if tokens <= 0:
            raise ValueError(f"tokens must be positive, got {tokens}")
        return math.ceil(tokens / self.block_tokens)

    def request_bytes(self, tokens: int) -> int:
        return self.blocks_for(tokens) * self.block_bytes_all_regions

    def descriptors_unmerged(self, tokens: int) -> int:
        """Descriptors of one push before merging: one per block per region."""
        return self.blocks_for(tokens) * self.regions

    def with_layers(self, layers: int) -> Shape:
        """The same pages with fewer (or more) layers: smoke tests of the same geometry."""
        return dataclasses.replace(
            self,
            name=f"{self.name}/L{layers}",
            layers=layers,
            regions=layers * self.regions_per_layer,
        )

    def pool_config(self, num_blocks: int, device: str = "cpu") -> PoolConfig:
        """The endpoint pool of this shape (one region per layer for a latent/MLA shape)."""
        return PoolConfig(
            num_blocks=num_blocks,
            layers=self.layers,
            block_bytes=self.page_bytes,
            device=device,
            dtype=self.dtype,
            kv_heads=self.kv_heads,
            kv_layout="NHD" if self.regions_per_layer == 2 else MLA_LAYOUT,
            kv_regions=KvRegions.PER_KV if self.regions_per_layer == 2 else KvRegions.PER_LAYER,
        )

    def describe(self) -> str:
        return (
            f"{self.name}: {self.layers} layers, {self.regions} regions of "
            f"{_size(self.page_bytes)} pages ({self.block_tokens} tokens x {self.kv_heads} x "
            f"{self.head_dim} {self.dtype}), {_size(self.block_bytes_all_regions)} per block"
        )


def _size(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} B"


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(
            "llama-8b", layers=32, regions=64, block_tokens=16, kv_heads=8, head_dim=128,
            dtype="bfloat16", layout="kv", tp=1,
            note="Llama 3 8B at TP 1: 64 regions of 32 KiB pages",
        ),
        Shape(
            "llama-70b-tp8", layers=80, regions=160, block_tokens=16, kv_heads=1, head_dim=128,
            dtype="bfloat16", layout="kv", tp=8,
            note="one rank of Llama 3 70B at TP 8: 160 regions of 4 KiB pages",
        ),
        Shape(
            "mla", layers=61, regions=61, block_tokens=64, kv_heads=1, head_dim=576,
            dtype="bfloat16", layout="latent", tp=1,
            note="DeepSeek-V3-style MLA: 61 regions of 72 KiB pages (one 576-wide latent)",
        ),
    )
}  # fmt: skip


def get_shape(name: str) -> Shape:
    """The named shape, or ``ConfigError`` naming the known ones (for ``--shape``)."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ConfigError(f"unknown shape {name!r}", f"choose one of {', '.join(SHAPES)}") from None

"""The plan of ``kvpush bench peer``: its geometry, cells, request counts and rounds -- apart so
that the report (``kvpush.commands.bench.peer_report``) and vLLM's side
(``kvpush.commands.bench.peer_vllm.pair``) read it without importing the scenario.

Pure data; any thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpush.config import require_counts


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """A model-like KV layout both sides share: one region per layer holding K|V of each block
    (vLLM's CPU layout), ``block_tokens`` tokens per block."""

    layers: int = 8
    kv_heads: int = 2
    head_size: int = 64
    block_tokens: int = 16
    dtype: str = "float16"

    @property
    def block_bytes(self) -> int:
        """One block of one layer's region: K and V of every head and token."""
        item = 4 if self.dtype == "float32" else 2
        return self.kv_heads * self.block_tokens * 2 * self.head_size * item


@dataclass(frozen=True)
class Cell:
    blocks: int  # per request
    inflight: int  # D keeps this many requests outstanding
    n: int  # requests per round, per system

    @property
    def key(self) -> str:
        return f"b{self.blocks}_i{self.inflight}"


BLOCKS = (1, 16, 256)
INFLIGHT = (1, 16)
#: Requests per round of each cell relative to ``--requests`` (which is the 1-block,
#: 16-in-flight cell's): about the same seconds per cell for vLLM's connector here.
WEIGHT = {(1, 1): 0.1, (1, 16): 1.0, (16, 1): 0.1, (16, 16): 0.67, (256, 1): 0.05, (256, 16): 0.1}
DEFAULT_REQUESTS = 600
QUICK_REQUESTS = 64
DEFAULT_ROUNDS = 3
MIN_REQUESTS = 4


@dataclass(frozen=True)
class PeerPlan:
    quick: bool
    requests: int
    rounds: int
    cells: tuple[Cell, ...]
    geometry: Geometry
    d_blocks: int  # each D's pool: the largest cell's in-flight blocks, and one request more
    p_blocks: int  # each P's: twice that (P finishes requests ahead)

    @property
    def max_len(self) -> int:
        """vLLM's max_model_len: the longest request's prompt, with room to decode."""
        return max(c.blocks for c in self.cells) * self.geometry.block_tokens * 2

    @staticmethod
    def make(quick: bool, requests: int | None = None, rounds: int | None = None) -> PeerPlan:
        req = requests if requests is not None else QUICK_REQUESTS if quick else DEFAULT_REQUESTS
        rnd = rounds if rounds is not None else 1 if quick else DEFAULT_ROUNDS
        require_counts(("--requests", req), ("--rounds", rnd))
        cells = tuple(
            Cell(b, i, max(MIN_REQUESTS, 2 * i, math.ceil(req * WEIGHT[(b, i)])))
            for b in BLOCKS
            for i in INFLIGHT
        )
        d_blocks = max(c.blocks * (c.inflight + 1) for c in cells)
        return PeerPlan(quick, req, rnd, cells, Geometry(), d_blocks, 2 * d_blocks)

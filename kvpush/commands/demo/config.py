"""What a demo runs: ``DemoConfig`` (requests, decoders, TP sizes, a named shape, deadlines) and
``DemoModel`` (the endpoints' KV geometry and the ``serve-*`` options that give it).

Checked when built (typed errors naming the option). Pure data; any thread. Both the demo
(``kvpush.commands.demo.demo``) and its child endpoints (``kvpush.commands.demo.cluster``) read it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from kvpush.config import require_counts


@dataclass(frozen=True)
class DemoModel:
    """The KV geometry of the demo's endpoints. By default a small model: 2 layers x (K, V) x
    256 blocks of 16 tokens x 4 KV heads x 64 x bf16 (8 KiB per region of a block, the whole
    model) = 8 MiB per endpoint, split over its ranks."""

    num_blocks: int = 256
    layers: int = 2
    block_tokens: int = 16
    kv_heads: int = 4
    head_dim: int = 64

    def options(self) -> list[str]:
        """The ``serve-*`` options that give an endpoint this geometry."""
        return [
            "--num-blocks", str(self.num_blocks), "--layers", str(self.layers),
            "--block-tokens", str(self.block_tokens), "--kv-heads", str(self.kv_heads),
            "--head-dim", str(self.head_dim),
        ]  # fmt: skip


@dataclass(frozen=True)
class DemoConfig:
    requests: int = 300
    blocks: int = 4
    decoders: int = 2
    concurrency: int = 8
    extra_decoder: bool = True
    model: DemoModel = DemoModel()
    # Tensor parallelism of P and of every D (their ratio follows VLLM_INTEROP.md section 4).
    p_tp: int = 1
    d_tp: int = 1
    # A named model shape (``kvpush.memory.shapes``) instead of ``model``; the pools then hold
    # just what the requests in flight need.
    shape: str = ""
    timeout_s: float = 30.0
    start_timeout_s: float = 90.0
    python: str = sys.executable
    workdir: str | None = None  # None: a fresh temporary directory

    def __post_init__(self) -> None:
        from kvpush.errors import ConfigError

        require_counts(
            ("--requests", self.requests),
            ("--blocks", self.blocks),
            ("--decoders", self.decoders),
            ("--concurrency", self.concurrency),
        )
        if self.shape:
            from kvpush.memory.shapes import get_shape

            sh = get_shape(self.shape)
            model = DemoModel(
                num_blocks=max(self.blocks * self.concurrency * 2, 16),
                layers=sh.layers,
                block_tokens=sh.block_tokens,
                kv_heads=sh.kv_heads,
                head_dim=sh.head_dim,
            )
            object.__setattr__(self, "model", model)
        heads = self.model.kv_heads
        for flag, tp in (("--tp (P)", self.p_tp), ("--tp (D)", self.d_tp)):
            if tp < 1 or (heads > 1 and heads % tp):
                raise ConfigError(
                    f"{flag} {tp} does not divide the demo model's {heads} KV heads",
                    "use a --tp that divides them (or P,D, e.g. --tp 4,2)",
                )
        if self.p_tp % self.d_tp and self.d_tp % self.p_tp:
            raise ConfigError(
                f"--tp {self.p_tp},{self.d_tp}: P's and D's TP sizes must divide one another",
                "e.g. --tp 4,2 or --tp 2,4",
            )
        if self.blocks * self.concurrency > self.model.num_blocks:
            raise ConfigError(
                f"--blocks {self.blocks} x --concurrency {self.concurrency} exceeds the demo "
                f"pool of {self.model.num_blocks} blocks",
                "lower --blocks or --concurrency",
            )

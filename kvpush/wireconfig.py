"""Two parts of an endpoint's configuration that stand apart (``kvpush.config`` re-exports them):
what a ``--wire vllm`` endpoint tells vLLM peers (``VllmWireConfig``) and where its traces go
(``TracingConfig``). Frozen, validated on construction (``ConfigError`` with a hint); pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpush.errors import ConfigError

_HASH_RE = re.compile(r"^[!-~]{1,256}$")  # vLLM's is 64 hex digits; any printable token is kept


@dataclass(frozen=True)
class VllmWireConfig:
    """What a ``--wire vllm`` endpoint tells vLLM peers beyond the pool's own geometry.

    Taken from a running vLLM peer (``--like HOST:PORT``) or given by flags. ``compat_hash`` is
    the compatibility hash both sides must share (vLLM's handshake client checks it before it
    decodes anything); the rest must match what vLLM validates in a handshake.
    """

    compat_hash: str
    block_size: int = 16  # tokens per block
    attn_backend_name: str = "FLASH_ATTN"
    region_names: tuple[str, ...] | None = None  # vLLM's layer names, or None (not announced)
    device_id: int = 0

    def __post_init__(self) -> None:
        if not _HASH_RE.match(self.compat_hash):
            raise ConfigError(
                f"invalid compatibility hash {self.compat_hash!r}",
                "pass vLLM's hash (64 hex digits) with --compat-hash, or take it from a running "
                "peer with --like HOST:PORT",
            )
        if not self.block_size > 0:
            raise ConfigError(
                f"--vllm-block-size must be positive, got {self.block_size}",
                "pass --vllm-block-size > 0",
            )
        if not re.match(r"^[A-Za-z0-9_]{1,64}$", self.attn_backend_name):
            raise ConfigError(
                f"invalid attention backend name {self.attn_backend_name!r}",
                "use vLLM's name, e.g. FLASH_ATTN or CPU_ATTN",
            )


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry traces (``kvpush.telemetry.tracing``, checked there): off while no URL."""

    endpoint: str = ""  # where spans go: an OTLP/HTTP traces URL
    sample_ratio: float = 1.0  # a trace kvpush starts is kept at this ratio; others follow theirs
    service_name: str = ""  # "": OTEL_SERVICE_NAME, else kvpush-<role>

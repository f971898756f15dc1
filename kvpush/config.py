"""Frozen configuration of an endpoint, grouped by concern, validated on construction.

The CLI turns options, ``KVPUSH_*`` variables and TOML files into these; the library only reads
them. Every invalid value raises ``ConfigError`` with a hint, before any resource is created.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from dataclasses import dataclass, field
from enum import Enum

from kvpush.address import binds_all_interfaces
from kvpush.errors import ConfigError
from kvpush.wireconfig import TracingConfig as TracingConfig
from kvpush.wireconfig import VllmWireConfig as VllmWireConfig


class Role(str, Enum):
    """Which side of the push an endpoint is: P (prefill, pushes) or D (decode, receives).

    A ``str`` whose ``str()`` and format are its value, so logs, JSON, etcd records and the CLI
    read ``prefill`` / ``decode`` as before. A string from outside becomes one with ``Role(s)``
    (``ValueError`` for any other value); ``EndpointConfig`` turns that into a ``ConfigError``.
    """

    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return str(self.value)


DTYPE_SIZES: dict[str, int] = {
    "uint8": 1,
    "int8": 1,
    "fp8": 1,
    "float16": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float32": 4,
    "fp32": 4,
}

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d{1,3})?)$")
_ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


class HandshakeMode(str, Enum):
    """What a handshake loads: notif-only (agent connection) or full (+ remote descriptors)."""

    NOTIF = "notif"
    FULL = "full"


class Wire(str, Enum):
    """Which wire an endpoint speaks to its peers.

    ``kvpush`` (default): kvpush's own framing, authenticated when a token is set, with failure
    notifications, cancels and fences. ``vllm``: vLLM 0.33's push wire exactly (``get_meta_msg``
    answers with NIXL metadata, ``PUSH_REG:`` / ``<id>:<tp>`` / ``HB:`` notifications), so a kvpush
    endpoint stands in for either side of a vLLM push deployment.
    """

    KVPUSH = "kvpush"
    VLLM = "vllm"


class KvRegions(str, Enum):
    """How a layer's K and V lie in memory: two regions per layer, or one holding K|V."""

    PER_KV = "per-kv"  # separate K and V regions (2 per layer)
    PER_LAYER = "per-layer"  # one region per layer with K|V inside (vLLM's CPU layout)


def _positive(name: str, value: float, hint: str = "") -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be positive, got {value}", hint or f"pass {name} > 0")


def require_counts(*counts: tuple[str, int]) -> None:
    """Each ``(flag, value)`` a count of 1 or more; else a ConfigError naming the first that is
    not (the commands' ``--requests``, ``--blocks``, ``--concurrency``...)."""
    for flag, value in counts:
        if value < 1:
            raise ConfigError(f"{flag} must be positive, got {value}", f"pass {flag} 1 or more")


def require_positive(flag: str, value: float, hint: str = "") -> None:
    """``value`` above 0 (NaN is not); else a ConfigError naming ``flag`` (seconds, rates)."""
    if not value > 0:
        raise ConfigError(f"{flag} must be positive, got {value:g}", hint or f"pass {flag} > 0")


#: The field<->flag table, written once: each configuration field -> the CLI option that sets it.
#: Validation messages name the option an operator typed; ``kvpush.commands.common.translate``
#: builds the configuration from the options through these tables (the option's parameter name is
#: the flag without dashes, ``--side-channel-timeout`` -> ``side_channel_timeout``).
POOL_FLAGS: dict[str, str] = {
    "num_blocks": "--num-blocks",
    "layers": "--layers",
    "block_bytes": "--block-bytes",
    "device": "--device",
    "dtype": "--dtype",
    "kv_layout": "--kv-layout",
}
AGENT_FLAGS: dict[str, str] = {
    "backends": "--backends",
    "progress_thread": "--progress-thread",
    "num_threads": "--nixl-threads",
    "idle_poll_max_us": "--idle-poll-max-us",
    "busy_spin_us": "--busy-spin-us",
}
TIMEOUT_FLAGS: dict[str, str] = {
    "side_channel_s": "--side-channel-timeout",
    "handshake_s": "--handshake-timeout",
    "lease_s": "--lease",
    "heartbeat_s": "--heartbeat",
    "request_deadline_s": "--request-deadline",
    "peer_idle_ttl_s": "--peer-idle-ttl",
    "write_base_s": "--write-timeout",
    "write_min_gbps": "--write-min-gbps",
    "fence_s": "--fence-timeout",
    "drain_s": "--drain-timeout",
}
#: ``Timeouts.watchdog_s``'s option (0 = off, so it is kept out of TIMEOUT_FLAGS).
WATCHDOG_FLAG = "--watchdog-timeout"


MLA_LAYOUT = "MLA"  # one latent "head" per token, the same on every rank (DeepSeek-style)


@dataclass(frozen=True)
class PoolConfig:
    """Geometry of one rank's registered KV pool: regions (layers x K/V) x blocks x block_bytes.

    ``block_bytes`` is one rank's page of one region. With tensor parallelism the model's
    ``kv_heads`` are split evenly over ``tp_size`` ranks (heads outermost in a page, so a rank's
    share is a contiguous slice of the model's page), or -- one head only, e.g. an MLA latent --
    replicated on every rank. A page is ``heads_per_rank`` head slices of ``head_bytes`` each.
    """

    num_blocks: int = 1024
    layers: int = 4
    block_bytes: int = 64 * 1024
    device: str = "cpu"
    dtype: str = "bfloat16"
    kv_layout: str = "NHD"
    kv_regions: KvRegions = KvRegions.PER_KV
    kv_heads: int = 1  # the model's KV heads per layer (all ranks together)
    tp_size: int = 1

    def __post_init__(self) -> None:
        _positive("--kv-heads", self.kv_heads)
        _positive("--tp", self.tp_size)
        if self.kv_layout.upper() == MLA_LAYOUT and self.kv_heads != 1:
            raise ConfigError(
                f"--kv-layout {self.kv_layout} has one latent head per token, not {self.kv_heads}",
                "drop --kv-heads for an MLA-style layout",
            )
        if self.kv_heads > 1 and self.kv_heads % self.tp_size:
            raise ConfigError(
                f"--tp {self.tp_size} does not divide --kv-heads {self.kv_heads}",
                "kvpush shards KV heads evenly over the ranks (a single head is replicated); "
                "pick a TP size that divides the model's KV heads",
            )
        if self.block_bytes % self.heads_per_rank:
            raise ConfigError(
                f"--block-bytes {self.block_bytes} is not {self.heads_per_rank} whole heads",
                "give the geometry as --block-tokens, --kv-heads and --head-dim",
            )
        for name in ("num_blocks", "layers", "block_bytes"):
            _positive(POOL_FLAGS[name], getattr(self, name))
        if self.num_blocks > 2**31 - 1:
            raise ConfigError(f"--num-blocks {self.num_blocks} is too large", "use at most 2^31-1")
        if not _DEVICE_RE.match(self.device):
            raise ConfigError(
                f"unknown device {self.device!r}", "use 'cpu', 'cuda' or 'cuda:N' (N = GPU index)"
            )
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(
                f"unknown dtype {self.dtype!r}", f"choose one of {', '.join(sorted(DTYPE_SIZES))}"
            )
        if self.block_bytes % DTYPE_SIZES[self.dtype]:
            raise ConfigError(
                f"--block-bytes {self.block_bytes} is not a multiple of the {self.dtype} size",
                "pick a block size that holds whole elements",
            )

    @property
    def regions(self) -> int:
        """Per layer one region for K and one for V, or one for both (``kv_regions``)."""
        return self.layers * (2 if self.kv_regions == KvRegions.PER_KV else 1)

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole (single-head) page, as vLLM does for MLA."""
        return self.kv_heads == 1

    @property
    def heads_per_rank(self) -> int:
        return 1 if self.replicated else self.kv_heads // self.tp_size

    @property
    def head_bytes(self) -> int:
        return self.block_bytes // self.heads_per_rank

    def first_head(self, rank: int) -> int:
        """The model head a rank's page starts with (0 on every rank when replicated)."""
        return 0 if self.replicated else rank * self.heads_per_rank

    @property
    def total_bytes(self) -> int:
        return self.regions * self.num_blocks * self.block_bytes

    @property
    def bytes_per_block_all_regions(self) -> int:
        return self.regions * self.block_bytes

    @staticmethod
    def from_model(
        *,
        num_blocks: int,
        layers: int,
        block_tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: str,
        device: str = "cpu",
        tp_size: int = 1,
        kv_layout: str = "NHD",
        kv_regions: KvRegions = KvRegions.PER_KV,
    ) -> PoolConfig:
        """Geometry from the model: ``kv_heads`` is the model's total; one rank's page holds
        block_tokens x (its share of the heads) x head_dim elements -- of K or of V in their own
        regions, of both with one region per layer (K|V inside each block, vLLM's CPU layout;
        an MLA latent has no separate V)."""
        _positive("--block-tokens", block_tokens)
        _positive("--kv-heads", kv_heads)
        _positive("--head-dim", head_dim)
        if dtype not in DTYPE_SIZES:
            raise ConfigError(
                f"unknown dtype {dtype!r}", f"choose one of {', '.join(sorted(DTYPE_SIZES))}"
            )
        # A TP size that does not divide the heads is refused by the geometry itself.
        share = kv_heads if kv_heads == 1 else kv_heads // max(1, tp_size)
        both = kv_regions == KvRegions.PER_LAYER and kv_layout.upper() != MLA_LAYOUT
        kv_in_page = 2 if both else 1
        return PoolConfig(
            num_blocks=num_blocks,
            layers=layers,
            block_bytes=block_tokens * share * head_dim * DTYPE_SIZES[dtype] * kv_in_page,
            device=device,
            dtype=dtype,
            kv_layout=kv_layout,
            kv_regions=kv_regions,
            kv_heads=kv_heads,
            tp_size=tp_size,
        )


@dataclass(frozen=True)
class AgentConfig:
    """How the NIXL agent is created and driven.

    NIXL's Python agent starts a progress thread that spins a whole core (its delay is hard-coded
    to 0); on a 2-core host that halves bandwidth (DESIGN.md section 3). kvpush turns it off by
    default and has its own threads poll, spinning while work is pending and backing off to
    ``idle_poll_max_us`` when idle.
    """

    backends: tuple[str, ...] = ("UCX",)
    progress_thread: bool = False
    num_threads: int = 0
    idle_poll_max_us: int = 1000
    busy_spin_us: int = 2000
    # ``--nixl-metadata etcd``: agent metadata published with NIXL's own etcd backend (these
    # become NIXL_ETCD_ENDPOINTS / NIXL_ETCD_NAMESPACE when the agent is created); "" = off.
    etcd_endpoints: str = ""
    etcd_namespace: str = ""
    # --lanes: UCX's lane report is read (kvpush.transport.lanes); serve-*: on by default.
    lanes: bool = False

    def __post_init__(self) -> None:
        if not self.backends:
            raise ConfigError("--backends is empty", "name at least one NIXL backend, e.g. UCX")
        for b in self.backends:
            if not re.match(r"^[A-Za-z0-9_]{1,32}$", b):
                raise ConfigError(f"invalid backend name {b!r}", "e.g. --backends UCX")
        if self.num_threads < 0:
            raise ConfigError(f"{AGENT_FLAGS['num_threads']} must be >= 0", "0 lets NIXL choose")
        _positive(AGENT_FLAGS["idle_poll_max_us"], self.idle_poll_max_us)
        if self.busy_spin_us < 0:
            raise ConfigError(
                f"{AGENT_FLAGS['busy_spin_us']} must be >= 0", "0 disables spinning after activity"
            )


@dataclass(frozen=True)
class Timeouts:
    """Every wait kvpush does has a deadline; these are the knobs."""

    side_channel_s: float = 5.0
    handshake_s: float = 10.0
    lease_s: float = 30.0
    heartbeat_s: float = 5.0
    request_deadline_s: float = 60.0
    peer_idle_ttl_s: float = 600.0
    write_base_s: float = 5.0
    write_min_gbps: float = 0.05  # a WRITE gets base + bytes / (this rate) before it is failed
    fence_s: float = 10.0
    drain_s: float = 10.0
    # The freeze watchdog (kvpush.runtime.watchdog): a watched thread without progress this
    # long is reported; 0 turns it off (so it is not in TIMEOUT_FLAGS, which must be positive).
    watchdog_s: float = 10.0

    def __post_init__(self) -> None:
        for name, flag in TIMEOUT_FLAGS.items():
            _positive(flag, getattr(self, name))
        if not self.watchdog_s >= 0:
            raise ConfigError(
                f"{WATCHDOG_FLAG} must be 0 (off) or positive, got {self.watchdog_s}",
                f"pass {WATCHDOG_FLAG} 10, or 0 to turn the watchdog off",
            )
        if self.heartbeat_s >= self.lease_s:
            raise ConfigError(
                f"heartbeat interval {self.heartbeat_s}s must be shorter than the lease "
                f"{self.lease_s}s",
                "use a heartbeat of at most a third of the lease",
            )

    def write_deadline_s(self, nbytes: int) -> float:
        """Size-aware WRITE deadline: a fixed allowance plus the time at a floor bandwidth."""
        return self.write_base_s + nbytes / (self.write_min_gbps * 1e9)


@dataclass(frozen=True)
class EndpointConfig:
    """Everything one P or D endpoint needs."""

    role: Role
    host: str = "127.0.0.1"
    port: int = 0
    engine_id: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pool: PoolConfig = field(default_factory=PoolConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    handshake_mode: HandshakeMode = HandshakeMode.NOTIF  # D->P; P->D is always full
    wire: Wire = Wire.KVPUSH
    vllm: VllmWireConfig | None = None  # required with wire=vllm
    verify: bool = True
    # Per-request phase stamps (``kvpush.telemetry.phases``): in the answers, for ``drive
    # --trace``, and the ``phase_*`` histograms. Off only to measure what they cost.
    phase_stamps: bool = True
    # --coalesce/--no-coalesce (issue 30). P: pushes ready for the same D rank in one pass of
    # the writer go as one WRITE with one ``Completions`` naming them all (never waiting to fill
    # a batch), to a D whose PUSH_REG says it takes them. D: its PUSH_REGs say so. Off: one
    # WRITE and one ``Completion`` per push, as before (the A/B of ``bench rate``).
    coalesce: bool = True
    tracing: TracingConfig = field(default_factory=TracingConfig)  # OTLP spans of each request
    auth_token: bytes | None = None
    allow_all_interfaces: bool = False
    max_frame_bytes: int = 4 * 1024 * 1024
    max_notif_bytes: int = 64 * 1024
    # The hooks of tests and measurements are no part of it: ``kvpush.instruments``.
    # A peer with this many transport errors in a row is evicted (the next request handshakes
    # afresh); an error saying its agent is gone evicts it at once.
    evict_after_errors: int = 3
    # --prewarm (with --registry): handshake with every compatible peer of the other role as it
    # joins the cluster, in the background (kvpush.fleet.prewarm), not at its first request.
    prewarm: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ConfigError(f"unknown role {self.role!r}", "use prefill or decode") from None
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"invalid port {self.port}", "use 1-65535, or 0 to pick a free port")
        if not self.engine_id:
            object.__setattr__(self, "engine_id", f"{self.role[0]}-{uuid.uuid4().hex[:12]}")
        elif not _ENGINE_ID_RE.match(self.engine_id):
            raise ConfigError(
                f"invalid engine id {self.engine_id!r}",
                "use up to 128 letters, digits and . _ : @ -",
            )
        _positive("--evict-after-errors", self.evict_after_errors)
        _positive("--tp", self.tp_size)
        if self.pool.tp_size != self.tp_size:
            # One geometry: the pool's share of the model's heads follows the endpoint's TP.
            object.__setattr__(self, "pool", dataclasses.replace(self.pool, tp_size=self.tp_size))
        if not (0 <= self.tp_rank < self.tp_size):
            raise ConfigError(
                f"--tp-rank {self.tp_rank} is outside 0..{self.tp_size - 1}",
                "tp rank must be below tp size",
            )
        if binds_all_interfaces(self.host) and not self.allow_all_interfaces:
            raise ConfigError(
                f"refusing to bind the side channel to all interfaces ({self.host})",
                "pass --expose to bind every interface on purpose (and set --auth-token-file)",
            )
        if self.wire == Wire.VLLM:
            self._check_vllm_wire()
        if self.auth_token is not None and len(self.auth_token) < 16:
            raise ConfigError(
                "auth token is shorter than 16 bytes",
                "generate one: head -c 32 /dev/urandom | xxd -p",
            )

    def _check_vllm_wire(self) -> None:
        """``--wire vllm``: a vLLM peer's hash and geometry, no token, regions in 16 bits."""
        if self.vllm is None:
            raise ConfigError(
                "--wire vllm needs the vLLM peer's compatibility hash and geometry",
                "pass --like HOST:PORT of a running vLLM peer, or --compat-hash",
            )
        if self.auth_token is not None:
            raise ConfigError(
                "--wire vllm cannot authenticate: vLLM's push wire has no tokens",
                "drop --auth-token-file, and keep the endpoint on a private network",
            )
        if self.pool.regions > 1 << 16:
            raise ConfigError("too many regions for a vLLM peer", "use fewer --layers")

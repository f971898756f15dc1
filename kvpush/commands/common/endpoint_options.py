"""The options of the endpoint commands (``serve-prefill``, ``serve-decode``), which ``probe``
shares in part: side channel, security, KV geometry, vLLM wire, NIXL, timeouts and output.

Owns their declarations (``ENDPOINT_OPTS``, indexed with the other commands' in
``kvpush.commands.common.options.OPTIONS``) and ``SERVE``, the one list both endpoint commands are
built from (a role set marks role-only options), so ``serve-prefill`` and ``serve-decode`` cannot
drift apart. Defaults of these options are read from the configuration dataclasses
(``PoolConfig``, ``AgentConfig``, ``Timeouts``) through the field<->flag tables of
``kvpush.config``: a default lives in one place too.

Imports and threads as ``kvpush.commands.common.options`` (which imports this): light enough
for typer's completion, run at import time.
"""

from __future__ import annotations

from kvpush.commands.common import complete
from kvpush.commands.common.configfile import config_callback
from kvpush.commands.common.optspec import (
    PANEL_GEOM,
    PANEL_NET,
    PANEL_NIXL,
    PANEL_OUT,
    PANEL_REGISTRY,
    PANEL_SEC,
    PANEL_TIME,
    PANEL_VLLM,
    Entry,
    LogLevel,
    NixlMetadata,
    Opt,
    OutputMode,
    TyperKw,
    param_name,
)
from kvpush.config import (
    AGENT_FLAGS,
    POOL_FLAGS,
    TIMEOUT_FLAGS,
    WATCHDOG_FLAG,
    AgentConfig,
    HandshakeMode,
    KvRegions,
    PoolConfig,
    Role,
    Timeouts,
    Wire,
)
from kvpush.fleet.config import DEFAULT_TTL_S, LEAVE_GRACE_S, LOAD_PERIOD_S


def _pool(name: str) -> object:
    return getattr(PoolConfig, name)


def _pool_opt(name: str, type_: object, help: str, kw: TyperKw | None = None) -> Opt:
    """The option of ``PoolConfig.<name>``: its flag and default from the configuration."""
    return Opt(name, (POOL_FLAGS[name],), type_, help, _pool(name), PANEL_GEOM, kw=kw or {})


def _timeout_opt(fld: str, help: str, seconds: bool = True) -> Opt:
    """The option of ``Timeouts.<fld>``: its flag and default from the configuration."""
    flag = TIMEOUT_FLAGS[fld]
    default = float(getattr(Timeouts, fld))
    return Opt(param_name(flag), (flag,), float, help, default, PANEL_TIME, seconds=seconds)


def _agent(option: str) -> object:
    fld = {param_name(flag): f for f, flag in AGENT_FLAGS.items()}[option]
    value = getattr(AgentConfig, fld, None)
    return value if value is not None else AgentConfig.__dataclass_fields__[fld].default


#: The options of ``serve-*`` (and, in part, ``probe``), in declaration order.
ENDPOINT_OPTS: list[Opt] = [
    Opt("config", ("--config",), str | None,
        "TOML file of settings: keys are option names with underscores (num_blocks = 2048); "
        "tables prefill and decode apply to one role. Options and KVPUSH_* variables win.",
        metavar="FILE", kw={"is_eager": True, "callback": config_callback}),
    Opt("host", ("--host",), str,
        "Side-channel address to bind. Loopback by default; all interfaces (0.0.0.0) also "
        "needs --expose.", "127.0.0.1", PANEL_NET),
    Opt("port", ("--port",), int, "Side-channel port (0 picks a free one).", 5600, PANEL_NET),
    Opt("expose", ("--expose",), bool,
        "Allow binding every interface (--host 0.0.0.0). Pair it with --auth-token-file.",
        False, PANEL_NET),
    Opt("engine_id", ("--engine-id",), str,
        "Engine id announced to peers (generated when empty).", "", PANEL_NET),
    Opt("auth_token_file", ("--auth-token-file",), str | None,
        "File holding a shared secret (>= 16 bytes, mode 600): every side-channel message and "
        "notification is then authenticated with HMAC-SHA256.", None, PANEL_SEC,
        metavar="FILE"),
    _pool_opt("device", str, "Where the KV pool lives: cpu, cuda or cuda:N.",
              kw={"autocompletion": complete.devices}),
    _pool_opt("num_blocks", int, "Blocks in the KV pool."),
    _pool_opt("layers", int, "Layers; each has a K and a V region."),
    Opt("block_bytes", (POOL_FLAGS["block_bytes"],), int | None,
        f"Bytes per block per region (default {_pool('block_bytes')}). Or give the model-like "
        "trio --block-tokens, --kv-heads, --head-dim instead.", None, PANEL_GEOM,
        show_default=False),
    Opt("block_tokens", ("--block-tokens",), int | None,
        "Tokens per block (model-like geometry).", None, PANEL_GEOM),
    Opt("kv_heads", ("--kv-heads",), int | None,
        "The model's KV heads per layer, all ranks together (model-like geometry): each of the "
        "--tp ranks holds kv_heads/tp of them; a single head (MLA's latent) is replicated.",
        None, PANEL_GEOM),
    Opt("tp", ("--tp",), int,
        "Tensor-parallel ranks: each has its own NIXL agent, KV pool (cuda:r with --device "
        "cuda) and writer/receiver, behind this one side channel.", 1, PANEL_GEOM),
    Opt("head_dim", ("--head-dim",), int | None, "Head dimension (model-like geometry).", None,
        PANEL_GEOM),
    _pool_opt("dtype", str, "Element type of the KV cache.",
              kw={"autocompletion": complete.dtypes}),
    _pool_opt("kv_layout", str, "KV cache layout name; peers must agree."),
    Opt("kv_regions", ("--kv-regions",), KvRegions,
        "per-kv: a K and a V region per layer; per-layer: one region per layer with K|V inside "
        "(vLLM's layout on CPU).", _pool("kv_regions"), PANEL_GEOM),
    Opt("wire", ("--wire",), Wire,
        "kvpush: kvpush's own framing (failures, cancels, fences, auth). vllm: vLLM 0.33's push "
        "wire exactly, to stand in for a vLLM P or D (needs --like or --compat-hash).",
        Wire.KVPUSH, PANEL_VLLM),
    Opt("like", ("--like",), str | None,
        "Take the geometry (regions, block length, layout, block size, attention backend, layer "
        "names) and the compatibility hash from this running vLLM peer (--wire vllm).", None,
        PANEL_VLLM, metavar="HOST:PORT"),
    Opt("compat_hash", ("--compat-hash",), str | None,
        "vLLM's compatibility hash both sides must share (--wire vllm; overrides --like's).",
        None, PANEL_VLLM, metavar="HEX"),
    Opt("vllm_block_size", ("--vllm-block-size",), int | None,
        "Tokens per block vLLM announces (--wire vllm without --like; default 16).", None,
        PANEL_VLLM, show_default=False),
    Opt("attn_backend", ("--attn-backend",), str | None,
        "vLLM's attention backend name, e.g. FLASH_ATTN, CPU_ATTN (--wire vllm without --like; "
        "default FLASH_ATTN).", None, PANEL_VLLM, show_default=False),
    Opt("backends", (AGENT_FLAGS["backends"],), str, "Comma-separated NIXL backends to create.",
        ",".join(AgentConfig.backends), PANEL_NIXL),
    Opt("progress_thread", ("--progress-thread/--no-progress-thread",), bool,
        "Start NIXL's own progress thread. Off by default: it spins a whole core even when "
        "idle (its delay is hard-coded to 0), which halves bandwidth on small hosts; kvpush's "
        "threads poll NIXL themselves instead.", _agent("progress_thread"), PANEL_NIXL),
    Opt("nixl_threads", (AGENT_FLAGS["num_threads"],), int,
        "Backend worker threads (0 lets NIXL choose).", _agent("nixl_threads"), PANEL_NIXL),
    Opt("idle_poll_max_us", (AGENT_FLAGS["idle_poll_max_us"],), int,
        "Longest sleep between NIXL polls when idle, in microseconds.",
        _agent("idle_poll_max_us"), PANEL_NIXL),
    Opt("busy_spin_us", (AGENT_FLAGS["busy_spin_us"],), int,
        "Keep polling without sleeping this long after activity, in microseconds.",
        _agent("busy_spin_us"), PANEL_NIXL),
    Opt("handshake", ("--handshake",), HandshakeMode,
        "D->P handshake: notif loads P's agent only (enough to notify it, the default); full "
        "also builds P's descriptor lists, to measure its cost.", HandshakeMode.NOTIF,
        PANEL_NIXL),
    Opt("verify", ("--verify/--no-verify",), bool,
        "Check every landed byte against the transfer's pattern before reporting success.",
        True, PANEL_NIXL),
    _timeout_opt("side_channel_s", "Deadline of one side-channel request."),
    _timeout_opt("handshake_s", "Deadline of one handshake with a peer."),
    _timeout_opt("lease_s", "P keeps a request's finished blocks this long without news."),
    _timeout_opt("heartbeat_s", "D renews the leases of waiting requests this often."),
    _timeout_opt("request_deadline_s", "D fails a request not done by then."),
    _timeout_opt("peer_idle_ttl_s", "Forget (remove) a peer agent idle this long."),
    Opt("evict_after_errors", ("--evict-after-errors",), int,
        "Evict a peer after this many transport errors in a row (failed WRITE or notification; "
        "timeouts only degrade it); the next request handshakes afresh. A disconnect evicts "
        "at once.", 3,
        PANEL_TIME),
    _timeout_opt("write_base_s",
        "Fixed part of a WRITE's deadline; the size-aware part is bytes / --write-min-gbps."),
    _timeout_opt("write_min_gbps", "Slowest bandwidth (GB/s) a WRITE may run at.", seconds=False),
    _timeout_opt("fence_s", "Deadline of a fence after a cancelled WRITE."),
    _timeout_opt("drain_s", "On SIGINT/SIGTERM, wait this long for in-flight pushes."),
    Opt("watchdog_timeout", (WATCHDOG_FLAG,), float,
        "Report a thread (side channel, writer, receiver) that made no progress this long, "
        "with its stack, once per stall; 0: off.", Timeouts.watchdog_s, PANEL_TIME,
        seconds=True),
    Opt("metrics_port", ("--metrics-port",), int,
        "Serve Prometheus /metrics on this port (0: off).", 0, PANEL_OUT),
    Opt("metrics_host", ("--metrics-host",), str, "Address the /metrics server binds.",
        "127.0.0.1", PANEL_OUT),
    Opt("output", ("--output", "-o"), OutputMode | None,
        "live: a refreshing view (default on a terminal); plain: one line per interval "
        "(default otherwise); json: one JSON object per line.", None, PANEL_OUT,
        show_default=False),
    Opt("interval", ("--interval",), float, "Seconds between plain/json telemetry lines.", 1.0,
        PANEL_OUT, seconds=True),
    Opt("log_level", ("--log-level",), LogLevel, "Log level (logs go to stderr).",
        LogLevel.INFO, PANEL_OUT),
    Opt("ready_file", ("--ready-file",), str | None,
        "Once started, write JSON {address, engine_id, incarnation, pid, role} to this file "
        "(atomically), for scripts and tests.", None, PANEL_OUT, metavar="PATH"),
    Opt("registry", ("--registry",), str | None,
        "etcd client URLs of the fleet registry, comma-separated (http://HOST:2379,...). An "
        "endpoint keeps two leased keys there while it serves (its membership and its load "
        "summary); etcd being down never stops it serving.", None, PANEL_REGISTRY,
        metavar="URL[,URL]", show_default=False),
    Opt("cluster", ("--cluster",), str, "The cluster's name in the registry.", "default",
        PANEL_REGISTRY),
    Opt("registry_ttl", ("--registry-ttl",), int,
        "Lease TTL of the endpoint's keys, in seconds (refreshed every TTL/3): a process that "
        "dies or freezes drops out of the registry within it.", DEFAULT_TTL_S, PANEL_REGISTRY,
        seconds=True),
    Opt("registry_load_period", ("--registry-load-period",), float,
        "How often the load summary (free blocks, in flight) is re-read; it is written to its "
        "own key when it changed, and at least every 5 periods. It reaches only the watchers "
        "of load (fleet watch, routers), never the endpoints (docs/fleet.md, sizing).",
        LOAD_PERIOD_S, PANEL_REGISTRY, seconds=True),
    Opt("registry_leave_grace", ("--registry-leave-grace",), float,
        "At a graceful stop the key goes first; the endpoint then serves on this long, so that "
        "routers and drives following the registry stop sending before intake stops (0: "
        "drain at once).", LEAVE_GRACE_S, PANEL_REGISTRY, seconds=True),
    Opt("nixl_metadata", ("--nixl-metadata",), NixlMetadata,
        "sidechannel: peers get a NIXL agent's metadata in the handshake reply. etcd: every "
        "agent publishes it with NIXL's own etcd backend in the registry's etcd (namespace "
        "/nixl/kvpush/CLUSTER) and peers load it from there; kvpush deletes the NIXL keys of "
        "an endpoint whose registration lapsed (NIXL writes them without a lease). Needs "
        "--registry on an etcd without auth or TLS.", NixlMetadata.SIDECHANNEL,
        PANEL_REGISTRY),
    Opt("prewarm", ("--prewarm",), bool,
        "Handshake with every compatible peer of the other role as it joins the cluster (and "
        "with those registered at start), in the background, a few at a time, so that the "
        "first request to or from it pays no handshake; a failed warm-up is tried again with "
        "back-off (prewarms_failed). Needs --registry.", False, PANEL_REGISTRY),
    Opt("advertise", ("--advertise",), str | None,
        "The host peers and routers reach this endpoint by (the registry key's address); "
        "needed when --host binds all interfaces.", None, PANEL_REGISTRY, metavar="HOST",
        show_default=False),
    Opt("registry_user", ("--registry-user",), str | None,
        "etcd user (with --registry-password-file).", None, PANEL_REGISTRY, show_default=False),
    Opt("registry_password_file", ("--registry-password-file",), str | None,
        "File holding the etcd user's password (no access for other users; never logged).",
        None, PANEL_REGISTRY, metavar="FILE", show_default=False),
    Opt("registry_ca", ("--registry-ca",), str | None,
        "CA bundle to verify etcd's TLS certificate (https:// URLs).", None, PANEL_REGISTRY,
        metavar="FILE", show_default=False),
    Opt("registry_cert", ("--registry-cert",), str | None,
        "TLS client certificate for etcd (with --registry-key).", None, PANEL_REGISTRY,
        metavar="FILE", show_default=False),
    Opt("registry_key", ("--registry-key",), str | None,
        "TLS client key for etcd (with --registry-cert).", None, PANEL_REGISTRY,
        metavar="FILE", show_default=False),
]  # fmt: skip

#: The options of each endpoint command, in help order.
_SERVE_ORDER = (
    "config", "host", "port", "expose", "engine_id", "auth_token_file", "device", "num_blocks",
    "layers", "block_bytes", "block_tokens", "kv_heads", "head_dim", "tp", "dtype", "kv_layout",
    "backends", "progress_thread", "nixl_threads", "idle_poll_max_us", "busy_spin_us", "handshake",
    "verify", "side_channel_timeout", "handshake_timeout", "lease", "heartbeat",
    "request_deadline", "peer_idle_ttl", "write_timeout", "write_min_gbps", "fence_timeout",
    "drain_timeout", "metrics_port", "metrics_host", "output", "interval", "log_level",
    "ready_file", "kv_regions", "wire", "like", "compat_hash", "vllm_block_size", "attn_backend",
    "registry", "cluster", "registry_ttl", "registry_load_period", "registry_leave_grace",
    "advertise", "nixl_metadata", "prewarm", "registry_user", "registry_password_file",
    "registry_ca", "registry_cert", "registry_key", "evict_after_errors", "watchdog_timeout",
)  # fmt: skip
#: The options only one role takes (every other one both do).
_ROLE_ONLY: dict[str, Role] = {
    "handshake": Role.DECODE, "verify": Role.DECODE, "request_deadline": Role.DECODE,
    "write_timeout": Role.PREFILL, "write_min_gbps": Role.PREFILL,
}  # fmt: skip
#: Each endpoint command's options, in help order, with the roles that take them.
SERVE: list[tuple[str, frozenset[Role]]] = [
    (k, frozenset({_ROLE_ONLY[k]} if k in _ROLE_ONLY else Role)) for k in _SERVE_ORDER
]
SERVE_PORT = {Role.PREFILL: 5600, Role.DECODE: 5601}


def serve_entries(role: Role) -> list[Entry]:
    return [
        ("port", SERVE_PORT[role]) if key == "port" else key
        for key, roles in SERVE
        if role in roles
    ]

"""Options, ``KVPUSH_*`` variables and TOML files -> the library's frozen configuration.

Owns the declaration of every option shared by several commands (as ``Annotated`` aliases, so
``serve-prefill``, ``serve-decode`` and ``probe`` stay consistent), the ``--config FILE.toml``
loader and the translation of parsed values into ``EndpointConfig`` / ``PoolConfig`` /
``AgentConfig`` / ``Timeouts``. Precedence: command line > ``KVPUSH_<OPTION>`` > config file >
built-in default (click's own order, with the file loaded into ``ctx.default_map``).

Nothing here imports torch, nixl or zmq: typer re-runs the program on every Tab press.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from kvpush.config import (
    AgentConfig,
    EndpointConfig,
    HandshakeMode,
    PoolConfig,
    Role,
    Timeouts,
    WriterMode,
)
from kvpush.errors import ConfigError

ENV_PREFIX = "KVPUSH_"

PANEL_NET = "Side channel"
PANEL_GEOM = "KV geometry"
PANEL_NIXL = "NIXL"
PANEL_TIME = "Timeouts (seconds)"
PANEL_OUT = "Output"
PANEL_SEC = "Security"


class OutputMode(str, Enum):
    LIVE = "live"
    PLAIN = "plain"
    JSON = "json"


class LogLevel(str, Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


def envvar(long_opt: str) -> str:
    """``--num-blocks`` -> ``KVPUSH_NUM_BLOCKS``."""
    return ENV_PREFIX + long_opt.lstrip("-").split("/")[0].replace("-", "_").upper()


def opt(decls: str, help: str, panel: str | None = None, **kw: Any) -> Any:
    """A typer option whose environment variable is derived from its long name."""
    names = decls.split(",")
    long_name = next(n for n in names if n.startswith("--"))
    return typer.Option(
        *names,
        help=help,
        envvar=envvar(long_name),
        show_envvar=True,
        rich_help_panel=panel,
        **kw,
    )


# ---------------------------------------------------------------------------- the --config file


def _toml_load(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError(
                "reading --config needs Python 3.11+ (tomllib) or the tomli package",
                "pip install tomli, or pass the settings as options",
            ) from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(
            f"cannot read config file {path}: {e.strerror}", "check the path and its permissions"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            f"config file {path} is not valid TOML: {e}", "see https://toml.io for the syntax"
        ) from None
    return data


def _known_keys(ctx: typer.Context) -> set[str]:
    """Option names of every command that reads --config (a file may be shared by P and D)."""
    root = ctx.find_root().command
    keys: set[str] = set()
    for cmd in getattr(root, "commands", {}).values():
        if any(p.name == "config" for p in cmd.params):
            keys.update(p.name for p in cmd.params if p.name)
    return keys


SECTION_FOR = {"serve-prefill": "prefill", "serve-decode": "decode"}


def config_values(
    data: Mapping[str, Any], path: str, command: str, own: set[str], known: set[str]
) -> dict[str, Any]:
    """Flatten a parsed config file into ``{param_name: value}`` for ``command``.

    Top-level keys apply to every command; a ``[prefill]`` or ``[decode]`` table applies to
    ``serve-prefill`` / ``serve-decode`` only. Keys are option names with underscores (dashes are
    accepted too). A key no command knows is an error; a key another command knows is skipped.
    """
    out: dict[str, Any] = {}
    base = Path(path).resolve().parent
    section = SECTION_FOR.get(command)
    items: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in ("prefill", "decode"):
                raise ConfigError(
                    f"unknown table [{key}] in config file {path}",
                    "use top-level keys, or the tables [prefill] and [decode]",
                )
            if key == section:
                items.extend(value.items())
            continue
        items.append((key, value))
    for raw_key, value in items:
        key = raw_key.replace("-", "_")
        if key == "config":
            raise ConfigError(f"config file {path} sets 'config'", "config files do not nest")
        if key not in known:
            raise ConfigError(
                f"unknown key {raw_key!r} in config file {path}",
                "keys are option names with underscores, e.g. num_blocks = 1024",
            )
        if key not in own:
            continue
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        if key.endswith("_file") and isinstance(value, str) and not os.path.isabs(value):
            value = str(base / value)
        out[key] = value
    return out


def config_callback(ctx: typer.Context, param: Any, value: str | None) -> str | None:
    """Eager callback of ``--config``: load the file into ``ctx.default_map``."""
    if not value or ctx.resilient_parsing:
        return value
    data = _toml_load(value)
    own = {p.name for p in ctx.command.params if p.name}
    values = config_values(data, value, ctx.info_name or "", own, _known_keys(ctx) | own)
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return value


# ------------------------------------------------------------------------- shared option types

ConfigOpt = Annotated[
    str | None,
    opt(
        "--config",
        "TOML file of settings: keys are option names with underscores (num_blocks = 2048); "
        "tables prefill and decode apply to one role. Options and KVPUSH_* variables win.",
        None,
        is_eager=True,
        callback=config_callback,
        metavar="FILE",
    ),
]
HostOpt = Annotated[
    str,
    opt(
        "--host",
        "Side-channel address to bind. Loopback by default; all interfaces (0.0.0.0) also "
        "needs --expose.",
        PANEL_NET,
    ),
]
ExposeOpt = Annotated[
    bool,
    opt(
        "--expose",
        "Allow binding every interface (--host 0.0.0.0). Pair it with --auth-token-file.",
        PANEL_NET,
    ),
]
EngineIdOpt = Annotated[
    str, opt("--engine-id", "Engine id announced to peers (generated when empty).", PANEL_NET)
]
AuthTokenOpt = Annotated[
    str | None,
    opt(
        "--auth-token-file",
        "File holding a shared secret (>= 16 bytes, mode 600): every side-channel message and "
        "notification is then authenticated with HMAC-SHA256.",
        PANEL_SEC,
        metavar="FILE",
    ),
]
DeviceOpt = Annotated[
    str, opt("--device", "Where the KV pool lives: cpu, cuda or cuda:N.", PANEL_GEOM)
]
NumBlocksOpt = Annotated[int, opt("--num-blocks", "Blocks in the KV pool.", PANEL_GEOM)]
LayersOpt = Annotated[int, opt("--layers", "Layers; each has a K and a V region.", PANEL_GEOM)]
BlockBytesOpt = Annotated[
    int | None,
    opt(
        "--block-bytes",
        "Bytes per block per region (default 65536). Or give the model-like trio "
        "--block-tokens, --kv-heads, --head-dim instead.",
        PANEL_GEOM,
        show_default=False,
    ),
]
BlockTokensOpt = Annotated[
    int | None, opt("--block-tokens", "Tokens per block (model-like geometry).", PANEL_GEOM)
]
KvHeadsOpt = Annotated[
    int | None, opt("--kv-heads", "KV heads per layer (model-like geometry).", PANEL_GEOM)
]
HeadDimOpt = Annotated[
    int | None, opt("--head-dim", "Head dimension (model-like geometry).", PANEL_GEOM)
]
DtypeOpt = Annotated[str, opt("--dtype", "Element type of the KV cache.", PANEL_GEOM)]
KvLayoutOpt = Annotated[
    str, opt("--kv-layout", "KV cache layout name; peers must agree.", PANEL_GEOM)
]
BackendsOpt = Annotated[
    str, opt("--backends", "Comma-separated NIXL backends to create.", PANEL_NIXL)
]
ProgressThreadOpt = Annotated[
    bool,
    opt(
        "--progress-thread/--no-progress-thread",
        "Start NIXL's own progress thread. Off by default: it spins a whole core even when "
        "idle (its delay is hard-coded to 0), which halves bandwidth on small hosts; kvpush's "
        "threads poll NIXL themselves instead.",
        PANEL_NIXL,
    ),
]
NixlThreadsOpt = Annotated[
    int, opt("--nixl-threads", "Backend worker threads (0 lets NIXL choose).", PANEL_NIXL)
]
IdlePollOpt = Annotated[
    int,
    opt(
        "--idle-poll-max-us",
        "Longest sleep between NIXL polls when idle, in microseconds.",
        PANEL_NIXL,
    ),
]
BusySpinOpt = Annotated[
    int,
    opt(
        "--busy-spin-us",
        "Keep polling without sleeping this long after activity, in microseconds.",
        PANEL_NIXL,
    ),
]
SideChannelTimeoutOpt = Annotated[
    float, opt("--side-channel-timeout", "Deadline of one side-channel request.", PANEL_TIME)
]
HandshakeTimeoutOpt = Annotated[
    float, opt("--handshake-timeout", "Deadline of one handshake with a peer.", PANEL_TIME)
]
LeaseOpt = Annotated[
    float,
    opt("--lease", "P keeps a request's finished blocks this long without news.", PANEL_TIME),
]
HeartbeatOpt = Annotated[
    float,
    opt("--heartbeat", "D renews the leases of waiting requests this often.", PANEL_TIME),
]
RequestDeadlineOpt = Annotated[
    float, opt("--request-deadline", "D fails a request not done by then.", PANEL_TIME)
]
PeerIdleTtlOpt = Annotated[
    float, opt("--peer-idle-ttl", "Forget (remove) a peer agent idle this long.", PANEL_TIME)
]
WriteTimeoutOpt = Annotated[
    float,
    opt(
        "--write-timeout",
        "Fixed part of a WRITE's deadline; the size-aware part is bytes / --write-min-gbps.",
        PANEL_TIME,
    ),
]
WriteMinGbpsOpt = Annotated[
    float,
    opt("--write-min-gbps", "Slowest bandwidth (GB/s) a WRITE may run at.", PANEL_TIME),
]
FenceTimeoutOpt = Annotated[
    float,
    opt("--fence-timeout", "Deadline of a fence after a cancelled WRITE.", PANEL_TIME),
]
DrainTimeoutOpt = Annotated[
    float,
    opt("--drain-timeout", "On SIGINT/SIGTERM, wait this long for in-flight pushes.", PANEL_TIME),
]
HandshakeModeOpt = Annotated[
    HandshakeMode,
    opt(
        "--handshake",
        "D->P handshake: notif loads P's agent only (enough to notify it, the default); full "
        "also builds P's descriptor lists, to measure its cost.",
        PANEL_NIXL,
    ),
]
WriterModeOpt = Annotated[
    WriterMode,
    opt(
        "--writer",
        "deferred (default): the writer never waits for a P->D handshake. blocking: the "
        "writer waits, reproducing the old head-of-line behaviour; for comparison only.",
        PANEL_NIXL,
    ),
]
VerifyOpt = Annotated[
    bool,
    opt(
        "--verify/--no-verify",
        "Check every landed byte against the transfer's pattern before reporting success.",
        PANEL_NIXL,
    ),
]
MetricsPortOpt = Annotated[
    int,
    opt(
        "--metrics-port",
        "Serve Prometheus /metrics on this port (0: off).",
        PANEL_OUT,
    ),
]
MetricsHostOpt = Annotated[
    str, opt("--metrics-host", "Address the /metrics server binds.", PANEL_OUT)
]
OutputOpt = Annotated[
    OutputMode | None,
    opt(
        "--output,-o",
        "live: a refreshing view (default on a terminal); plain: one line per interval "
        "(default otherwise); json: one JSON object per line.",
        PANEL_OUT,
        show_default=False,
    ),
]
IntervalOpt = Annotated[
    float, opt("--interval", "Seconds between plain/json telemetry lines.", PANEL_OUT)
]
LogLevelOpt = Annotated[LogLevel, opt("--log-level", "Log level (logs go to stderr).", PANEL_OUT)]
ReadyFileOpt = Annotated[
    str | None,
    opt(
        "--ready-file",
        "Once started, write JSON {address, engine_id, incarnation, pid, role} to this file "
        "(atomically), for scripts and tests.",
        PANEL_OUT,
        metavar="PATH",
    ),
]


# ------------------------------------------------------------------------------ translation


def _require_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be positive, got {value:g}", f"pass {name} > 0")


def pool_config(p: Mapping[str, Any], num_blocks: int | None = None) -> PoolConfig:
    """PoolConfig from parsed options (``num_blocks`` overrides the option, for probes)."""
    model = {
        "--block-tokens": p.get("block_tokens"),
        "--kv-heads": p.get("kv_heads"),
        "--head-dim": p.get("head_dim"),
    }
    blocks = p["num_blocks"] if num_blocks is None else num_blocks
    given = [k for k, v in model.items() if v is not None]
    if given:
        if p.get("block_bytes") is not None:
            raise ConfigError(
                f"--block-bytes and {given[0]} both set the block size",
                "give either --block-bytes or --block-tokens/--kv-heads/--head-dim",
            )
        missing = [k for k, v in model.items() if v is None]
        if missing:
            raise ConfigError(
                f"{given[0]} needs {' and '.join(missing)} too",
                "model-like geometry takes --block-tokens, --kv-heads and --head-dim together",
            )
        pool = PoolConfig.from_model(
            num_blocks=blocks,
            layers=p["layers"],
            block_tokens=int(model["--block-tokens"] or 0),
            kv_heads=int(model["--kv-heads"] or 0),
            head_dim=int(model["--head-dim"] or 0),
            dtype=p["dtype"],
            device=p["device"],
        )
        return PoolConfig(
            num_blocks=pool.num_blocks,
            layers=pool.layers,
            block_bytes=pool.block_bytes,
            device=pool.device,
            dtype=pool.dtype,
            kv_layout=p.get("kv_layout") or pool.kv_layout,
        )
    bb = p.get("block_bytes")
    return PoolConfig(
        num_blocks=blocks,
        layers=p["layers"],
        block_bytes=PoolConfig.block_bytes if bb is None else bb,
        device=p["device"],
        dtype=p["dtype"],
        kv_layout=p.get("kv_layout") or PoolConfig.kv_layout,
    )


def agent_config(p: Mapping[str, Any]) -> AgentConfig:
    backends = tuple(b.strip() for b in str(p["backends"]).split(",") if b.strip())
    return AgentConfig(
        backends=backends,
        progress_thread=bool(p["progress_thread"]),
        num_threads=p["nixl_threads"],
        idle_poll_max_us=p["idle_poll_max_us"],
        busy_spin_us=p["busy_spin_us"],
    )


# option name -> Timeouts field
TIMEOUT_FIELDS: dict[str, str] = {
    "side_channel_timeout": "side_channel_s",
    "handshake_timeout": "handshake_s",
    "lease": "lease_s",
    "heartbeat": "heartbeat_s",
    "request_deadline": "request_deadline_s",
    "peer_idle_ttl": "peer_idle_ttl_s",
    "write_timeout": "write_base_s",
    "write_min_gbps": "write_min_gbps",
    "fence_timeout": "fence_s",
    "drain_timeout": "drain_s",
}


def timeouts(p: Mapping[str, Any]) -> Timeouts:
    values: dict[str, float] = {}
    for name, fld in TIMEOUT_FIELDS.items():
        if name in p:
            _require_positive("--" + name.replace("_", "-"), p[name])
            values[fld] = float(p[name])
    return Timeouts(**values)


def auth_token(path: str | None) -> bytes | None:
    if not path:
        return None
    from kvpush.wire.auth import load_token_file

    return load_token_file(path)


def endpoint_config(role: Role, p: Mapping[str, Any]) -> EndpointConfig:
    """The endpoint's frozen config from the parsed options of serve-prefill / serve-decode."""
    return EndpointConfig(
        role=role,
        host=p["host"],
        port=p["port"],
        engine_id=p.get("engine_id") or "",
        pool=pool_config(p),
        agent=agent_config(p),
        timeouts=timeouts(p),
        handshake_mode=p.get("handshake") or HandshakeMode.NOTIF,
        writer_mode=p.get("writer") or WriterMode.DEFERRED,
        verify=bool(p.get("verify", True)),
        auth_token=auth_token(p.get("auth_token_file")),
        allow_all_interfaces=bool(p.get("expose", False)),
    )


@dataclass(frozen=True)
class ServeOptions:
    """What the run loop needs beyond the endpoint's config."""

    output: OutputMode | None
    interval_s: float
    log_level: LogLevel
    ready_file: str | None
    metrics_host: str
    metrics_port: int

    @staticmethod
    def from_params(p: Mapping[str, Any]) -> ServeOptions:
        _require_positive("--interval", p["interval"])
        if not (0 <= p["metrics_port"] <= 65535):
            raise ConfigError(
                f"invalid port {p['metrics_port']}", "use 1-65535 for --metrics-port, or 0 for off"
            )
        return ServeOptions(
            output=p["output"],
            interval_s=float(p["interval"]),
            log_level=p["log_level"],
            ready_file=p["ready_file"],
            metrics_host=p["metrics_host"],
            metrics_port=p["metrics_port"],
        )


def parse_ranks(text: str) -> tuple[int, int]:
    """``PP,TP`` -> (pp, tp): the rank a get_meta_msg asks for."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"invalid --ranks {text!r}", "use PP,TP with two ranks, e.g. --ranks 0,1")
    return int(parts[0]), int(parts[1])

"""Every option and argument of the ``kvpush`` CLI, declared once, and the commands built from them.

Owns ``OPTIONS`` (one ``Opt`` per option: flags, type, default, help, help panel; every option
gets its ``KVPUSH_<OPTION>`` variable from its long flag) and ``signature`` / ``register``,
which give a command function an ``inspect.Signature`` made of table entries. typer reads that
signature like a hand-written one, so ``serve-prefill`` and ``serve-decode`` are built from the
same declarations and cannot drift apart. Defaults of the endpoint options are read from the
configuration dataclasses (``PoolConfig``, ``AgentConfig``, ``Timeouts``) through the
field<->flag tables of ``kvpush.config``: a default lives in one place too.

Imports typer and the configuration only (no torch, nixl or zmq: typer re-runs the program on
every Tab press). Runs on the main thread at import time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from kvpush.cli.configfile import config_callback
from kvpush.config import (
    AGENT_FLAGS,
    POOL_FLAGS,
    TIMEOUT_FLAGS,
    AgentConfig,
    HandshakeMode,
    KvRegions,
    PoolConfig,
    Timeouts,
    Wire,
    WriterMode,
)

ENV_PREFIX = "KVPUSH_"

PANEL_NET = "Side channel"
PANEL_GEOM = "KV geometry"
PANEL_NIXL = "NIXL"
PANEL_TIME = "Timeouts (seconds)"
PANEL_OUT = "Output"
PANEL_SEC = "Security"
PANEL_VLLM = "vLLM wire"


class OutputMode(str, Enum):
    LIVE = "live"
    PLAIN = "plain"
    JSON = "json"


class LogLevel(str, Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


def param_name(flag: str) -> str:
    """``--side-channel-timeout`` -> ``side_channel_timeout``."""
    return flag.lstrip("-").split("/")[0].replace("-", "_")


def envvar(long_opt: str) -> str:
    """``--num-blocks`` -> ``KVPUSH_NUM_BLOCKS``."""
    return ENV_PREFIX + param_name(long_opt).upper()


REQUIRED: Any = ...


@dataclass(frozen=True)
class Opt:
    """One option (or, with ``argument=True``, one positional argument) of the CLI."""

    name: str  # the parameter name the command receives
    decls: tuple[str, ...]
    type: Any
    help: str
    default: Any = None
    panel: str | None = None
    metavar: str | None = None
    show_default: bool | str = True
    seconds: bool = False  # its value is a duration (the man page says SECONDS)
    env: bool = True
    argument: bool = False
    kw: Mapping[str, Any] = field(default_factory=dict)
    key: str = ""  # the table key when two commands give one flag two meanings

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.name)

    @property
    def long(self) -> str:
        return next((d for d in self.decls if d.startswith("--")), self.decls[0])

    @property
    def envvar(self) -> str | None:
        return envvar(self.long) if self.env and not self.argument else None

    def info(self, extra: Mapping[str, Any] | None = None) -> Any:
        kw = {**self.kw, **(extra or {})}
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        if self.argument:
            return typer.Argument(help=self.help, show_default=self.show_default, **kw)
        return typer.Option(
            *self.decls,
            help=self.help,
            envvar=self.envvar,
            show_envvar=self.envvar is not None,
            rich_help_panel=self.panel,
            show_default=self.show_default,
            **kw,
        )

    def parameter(
        self, default: Any = None, extra: Mapping[str, Any] | None = None
    ) -> inspect.Parameter:
        value = self.default if default is None else default
        return inspect.Parameter(
            self.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if value is REQUIRED else value,
            annotation=Annotated[self.type, self.info(extra)],
        )


def _pool(name: str) -> Any:
    return getattr(PoolConfig, name)


def _timeout(option: str) -> float:
    fld = {param_name(flag): f for f, flag in TIMEOUT_FLAGS.items()}[option]
    return float(getattr(Timeouts, fld))


def _agent(option: str) -> Any:
    fld = {param_name(flag): f for f, flag in AGENT_FLAGS.items()}[option]
    value = getattr(AgentConfig, fld, None)
    return value if value is not None else AgentConfig.__dataclass_fields__[fld].default


_OPTS: list[Opt] = [
    # --------------------------------------------------------------------- root
    Opt("version", ("--version",), bool, "Print the version and exit.", False, env=False,
        kw={"is_eager": True}),
    Opt("debug", ("--debug",), bool, "Show a traceback with errors.", False),
    # --------------------------------------------------------------------- serve-*, probe
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
    Opt("device", (POOL_FLAGS["device"],), str, "Where the KV pool lives: cpu, cuda or cuda:N.",
        _pool("device"), PANEL_GEOM),
    Opt("num_blocks", (POOL_FLAGS["num_blocks"],), int, "Blocks in the KV pool.",
        _pool("num_blocks"), PANEL_GEOM),
    Opt("layers", (POOL_FLAGS["layers"],), int, "Layers; each has a K and a V region.",
        _pool("layers"), PANEL_GEOM),
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
    Opt("dtype", (POOL_FLAGS["dtype"],), str, "Element type of the KV cache.", _pool("dtype"),
        PANEL_GEOM),
    Opt("kv_layout", (POOL_FLAGS["kv_layout"],), str, "KV cache layout name; peers must agree.",
        _pool("kv_layout"), PANEL_GEOM),
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
        ",".join(_agent("backends")), PANEL_NIXL),
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
    Opt("writer", ("--writer",), WriterMode,
        "deferred (default): the writer never waits for a P->D handshake. blocking: the "
        "writer waits, reproducing the old head-of-line behaviour; for comparison only.",
        WriterMode.DEFERRED, PANEL_NIXL),
    Opt("handshake", ("--handshake",), HandshakeMode,
        "D->P handshake: notif loads P's agent only (enough to notify it, the default); full "
        "also builds P's descriptor lists, to measure its cost.", HandshakeMode.NOTIF,
        PANEL_NIXL),
    Opt("verify", ("--verify/--no-verify",), bool,
        "Check every landed byte against the transfer's pattern before reporting success.",
        True, PANEL_NIXL),
    Opt("side_channel_timeout", (TIMEOUT_FLAGS["side_channel_s"],), float,
        "Deadline of one side-channel request.", _timeout("side_channel_timeout"), PANEL_TIME,
        seconds=True),
    Opt("handshake_timeout", (TIMEOUT_FLAGS["handshake_s"],), float,
        "Deadline of one handshake with a peer.", _timeout("handshake_timeout"), PANEL_TIME,
        seconds=True),
    Opt("lease", (TIMEOUT_FLAGS["lease_s"],), float,
        "P keeps a request's finished blocks this long without news.", _timeout("lease"),
        PANEL_TIME, seconds=True),
    Opt("heartbeat", (TIMEOUT_FLAGS["heartbeat_s"],), float,
        "D renews the leases of waiting requests this often.", _timeout("heartbeat"),
        PANEL_TIME, seconds=True),
    Opt("request_deadline", (TIMEOUT_FLAGS["request_deadline_s"],), float,
        "D fails a request not done by then.", _timeout("request_deadline"), PANEL_TIME,
        seconds=True),
    Opt("peer_idle_ttl", (TIMEOUT_FLAGS["peer_idle_ttl_s"],), float,
        "Forget (remove) a peer agent idle this long.", _timeout("peer_idle_ttl"), PANEL_TIME,
        seconds=True),
    Opt("write_timeout", (TIMEOUT_FLAGS["write_base_s"],), float,
        "Fixed part of a WRITE's deadline; the size-aware part is bytes / --write-min-gbps.",
        _timeout("write_timeout"), PANEL_TIME, seconds=True),
    Opt("write_min_gbps", (TIMEOUT_FLAGS["write_min_gbps"],), float,
        "Slowest bandwidth (GB/s) a WRITE may run at.", _timeout("write_min_gbps"), PANEL_TIME),
    Opt("fence_timeout", (TIMEOUT_FLAGS["fence_s"],), float,
        "Deadline of a fence after a cancelled WRITE.", _timeout("fence_timeout"), PANEL_TIME,
        seconds=True),
    Opt("drain_timeout", (TIMEOUT_FLAGS["drain_s"],), float,
        "On SIGINT/SIGTERM, wait this long for in-flight pushes.", _timeout("drain_timeout"),
        PANEL_TIME, seconds=True),
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
    # --------------------------------------------------------------------- probe
    Opt("address", ("address",), str, "The peer's side channel, HOST:PORT.", REQUIRED,
        argument=True),
    Opt("count", ("--count", "-c"), int, "Round trips to measure (RTT, clock offset).", 5),
    Opt("timeout", ("--timeout",), float, "Seconds to wait per request.", 3.0,
        seconds=True, key="probe.timeout"),
    Opt("handshake", ("--handshake",), HandshakeMode | None,
        "Also do a real NIXL handshake of this mode from a tiny local endpoint and time its "
        "phases.", None, show_default=False, key="probe.handshake"),
    Opt("ping", ("--ping",), int, "Measure this many NIXL notification round trips.", 0),
    Opt("stats", ("--stats",), bool, "Show the peer's live telemetry.", False),
    Opt("json_out", ("--json",), bool, "One JSON object on stdout.", False, key="probe.json"),
    Opt("ranks", ("--ranks",), str,
        "The peer's (pp, tp) rank to ask for, as PP,TP (vLLM serves one per rank).", "0,0"),
    Opt("peer_tp", ("--peer-tp",), int | None,
        "The vLLM peer's TP size (tp_size of its kv_transfer_params): needed to ask it for a "
        "rank other than 0,0, since vLLM's listener dies on a rank it does not serve.", None,
        show_default=False),
    # --------------------------------------------------------------------- drive, demo
    Opt("prefill", ("--prefill", "-p"), list[str],
        "A prefill endpoint HOST:PORT (repeatable). With --request-id: the one kvpush P "
        "(--wire vllm) that fills a request for a vLLM D.", None, metavar="HOST:PORT",
        show_default=False),
    Opt("decode", ("--decode", "-d"), list[str],
        "A decode endpoint HOST:PORT (repeatable). With --kv-transfer-params: the one kvpush D "
        "that receives a vLLM P's push.", None, metavar="HOST:PORT", show_default=False),
    Opt("requests", ("--requests", "-n"), int, "Requests to send.", 100),
    Opt("concurrency", ("--concurrency", "-c"), int, "Requests in flight at once.", 8),
    Opt("rate", ("--rate",), float | None, "Start at most this many requests per second.", None,
        show_default=False),
    Opt("blocks", ("--blocks",), int, "Blocks per request.", 4),
    Opt("blocks", ("--blocks",), int,
        "Blocks per request (default 4). With --request-id (required): the blocks P fills. With "
        "--kv-transfer-params: the blocks D allocates, by default as many as P holds "
        "(remote_block_ids); vLLM refuses any other count.", 4, show_default=False,
        key="drive.blocks"),
    Opt("timeout", ("--timeout",), float,
        "Seconds a request may take before it fails. A vLLM leg: D's wait for the push once it "
        "has blocks, or P's wait for a D to take it.", 30.0, seconds=True, key="drive.timeout"),
    Opt("kv_transfer_params", ("--kv-transfer-params",), str | None,
        "Drive the decode leg of one request a vLLM P holds, as a router would: the "
        "kv_transfer_params its request_finished returned (a JSON object, a file holding it, or "
        "- for stdin; a whole response with a kv_transfer_params key also works). The one "
        "--decode allocates, registers with that P, waits for its push and reports outcome, "
        "bytes and sha256.", None, PANEL_VLLM, metavar="FILE|JSON", show_default=False),
    Opt("request_id", ("--request-id",), str | None,
        "Drive the prefill leg of one request for a vLLM D: the one --prefill (a kvpush P, "
        "--wire vllm) fills --blocks blocks for this request id, prints at once the "
        "kv_transfer_params to hand the vLLM D (one JSON line), then waits for the push (or "
        "its lease) and reports outcome and sha256.", None, PANEL_VLLM, metavar="ID",
        show_default=False),
    Opt("alloc_delay", ("--alloc-delay",), float,
        "With --kv-transfer-params: D holds the request this long before it gets blocks, as a "
        "request queued in a vLLM D would, heartbeating P's lease meanwhile (longer than P's "
        "lease shows the heartbeats work).", 0.0, PANEL_VLLM, seconds=True),
    Opt("json_out", ("--json",), bool,
        "One JSON summary on stdout (--request-id: the kv_transfer_params line first).", False,
        key="drive.json"),
    Opt("shape", ("--shape",), str | None,
        "A real model's KV geometry: llama-8b, llama-70b-tp8 (one rank of TP 8) or mla. drive "
        "checks that the endpoints have it (and sizes --tokens in its blocks); demo starts its "
        "endpoints with it.", None, show_default=False),
    Opt("tokens", ("--tokens",), int | None,
        "Tokens per request (with --shape): --blocks becomes ceil(tokens / the shape's block "
        "tokens).", None, show_default=False),
    Opt("requests", ("--requests", "-n"), int, "Requests to drive.", 300, key="demo.requests"),
    Opt("decoders", ("--decoders",), int, "Decode endpoints at start.", 2),
    Opt("tp_shape", ("--tp",), str,
        "Tensor-parallel ranks of P and of each D: N for both, or P,D (e.g. 4,2 or 1,4; the "
        "demo model has 4 KV heads, so 1, 2 or 4).", "1", key="demo.tp", metavar="N|P,D"),
    Opt("live", ("--live/--no-live",), bool | None,
        "Show P's live telemetry while driving (default: when stderr is a terminal).", None,
        show_default=False),
    Opt("json_out", ("--json",), bool, "One JSON report on stdout.", False, key="demo.json"),
    Opt("keep_logs", ("--keep-logs",), bool,
        "Keep the endpoints' logs (kept anyway on failure).", False),
    # --------------------------------------------------------------------- bench, completion
    Opt("scenario", ("scenario",), str,
        "hol (head-of-line behind a slow new peer, deferred vs blocking writer), handshake "
        "(notif-only vs full), bandwidth (push GB/s vs raw NIXL, process_vm_writev, memcpy), "
        "rate (small pushes/s vs raw NIXL), scale (many new peers at once), tp (N ranks vs N "
        "x one rank), model (real model shapes, block ids contiguous, shuffled and after "
        "churn, vs raw NIXL), or all.", REQUIRED,
        argument=True, show_default=False),
    Opt("quick", ("--quick",), bool, "Short smoke version (what CI runs); figures are rough.",
        False),
    Opt("json_out", ("--json",), bool,
        "Print each scenario's full result as one JSON line instead of tables.", False,
        key="bench.json"),
    Opt("out_dir", ("--out-dir",), Path | None,
        "Where results (<scenario>.json), charts (.svg) and worker logs go. "
        "[default: ./bench-out]", None, kw={"file_okay": False}),
    Opt("shell", ("shell",), Shell, "The shell to print a completion script for.", REQUIRED,
        argument=True),
]  # fmt: skip

#: key -> option. The key is the parameter name, or ``command.param`` where two commands give
#: the same flag different meanings (probe's --timeout is per request, drive's per transfer).
OPTIONS: dict[str, Opt] = {o.key: o for o in _OPTS}
assert len(OPTIONS) == len(_OPTS), "two options share a key"


Entry = str | tuple[str, Any]


def signature(
    entries: Sequence[Entry],
    *,
    ctx: bool = True,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> inspect.Signature:
    """A command signature of table entries (``key`` or ``(key, default)``), in order;
    ``extra`` adds typer keywords to some (a callback that lives with its command)."""
    params = []
    if ctx:
        params.append(
            inspect.Parameter(
                "ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context
            )
        )
    for e in entries:
        key, default = (e, None) if isinstance(e, str) else e
        params.append(OPTIONS[key].parameter(default, (extra or {}).get(key)))
    return inspect.Signature(params)


def options_of(entries: Sequence[Entry]) -> list[Opt]:
    return [OPTIONS[e if isinstance(e, str) else e[0]] for e in entries]


def register(
    app: typer.Typer,
    name: str | None,
    body: Callable[..., Any],
    entries: Sequence[Entry],
    doc: str,
    *,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Register ``body(ctx=..., **params)`` as command ``name`` of ``app`` (None: the root
    callback); the help is ``doc`` with each paragraph joined into one line."""

    def command(**params: Any) -> Any:
        return body(**params)

    command.__signature__ = signature(entries, extra=extra)  # type: ignore[attr-defined]
    command.__name__ = (name or "root").replace("-", "_")
    paras = inspect.cleandoc(doc).split("\n\n")
    command.__doc__ = "\n\n".join(" ".join(p.split()) for p in paras)
    if name is None:
        app.callback()(command)
    else:
        app.command(name)(command)


#: The options of each endpoint command, in help order; a role set marks role-only options.
SERVE: list[tuple[str, frozenset[str]]] = [
    (k, frozenset(r.split())) for k, r in (
        ("config", "prefill decode"), ("host", "prefill decode"), ("port", "prefill decode"),
        ("expose", "prefill decode"), ("engine_id", "prefill decode"),
        ("auth_token_file", "prefill decode"), ("device", "prefill decode"),
        ("num_blocks", "prefill decode"), ("layers", "prefill decode"),
        ("block_bytes", "prefill decode"), ("block_tokens", "prefill decode"),
        ("kv_heads", "prefill decode"), ("head_dim", "prefill decode"),
        ("tp", "prefill decode"), ("dtype", "prefill decode"), ("kv_layout", "prefill decode"),
        ("backends", "prefill decode"), ("progress_thread", "prefill decode"),
        ("nixl_threads", "prefill decode"), ("idle_poll_max_us", "prefill decode"),
        ("busy_spin_us", "prefill decode"), ("writer", "prefill"), ("handshake", "decode"),
        ("verify", "decode"), ("side_channel_timeout", "prefill decode"),
        ("handshake_timeout", "prefill decode"), ("lease", "prefill decode"),
        ("heartbeat", "prefill decode"), ("request_deadline", "decode"),
        ("peer_idle_ttl", "prefill decode"), ("write_timeout", "prefill"),
        ("write_min_gbps", "prefill"), ("fence_timeout", "prefill decode"),
        ("drain_timeout", "prefill decode"), ("metrics_port", "prefill decode"),
        ("metrics_host", "prefill decode"), ("output", "prefill decode"),
        ("interval", "prefill decode"), ("log_level", "prefill decode"),
        ("ready_file", "prefill decode"), ("kv_regions", "prefill decode"),
        ("wire", "prefill decode"), ("like", "prefill decode"),
        ("compat_hash", "prefill decode"), ("vllm_block_size", "prefill decode"),
        ("attn_backend", "prefill decode"),
    )
]  # fmt: skip
SERVE_PORT = {"prefill": 5600, "decode": 5601}


def serve_entries(role: str) -> list[Entry]:
    return [
        ("port", SERVE_PORT[role]) if key == "port" else key
        for key, roles in SERVE
        if role in roles
    ]


#: The geometry options probe compares with the peer when given.
GEOMETRY = ("layers", "block_bytes", "block_tokens", "kv_heads", "head_dim", "dtype", "kv_layout")

PROBE: list[Entry] = [
    "address", "count", "probe.timeout", "probe.handshake", "ping", "stats", "probe.json",
    "ranks", "peer_tp", "config", "auth_token_file", "device", *GEOMETRY, "kv_regions",
    "backends", "progress_thread",
]  # fmt: skip
DRIVE: list[Entry] = [
    "prefill", "decode", "requests", "concurrency", "rate", "drive.blocks", "shape", "tokens",
    "drive.timeout", "drive.json", "kv_transfer_params", "request_id", "alloc_delay",
    "auth_token_file",
]  # fmt: skip
DEMO: list[Entry] = [
    "demo.requests", "blocks", "decoders", "demo.tp", "shape", "concurrency", "live",
    "demo.json", "keep_logs",
]  # fmt: skip
BENCH: list[Entry] = ["scenario", "quick", "bench.json", "out_dir"]
COMPLETION: list[Entry] = ["shell"]
ROOT: list[Entry] = ["version", "debug"]

#: Parameters whose value is a duration (the man page names them SECONDS).
SECONDS = frozenset(o.name for o in _OPTS if o.seconds)

"""Parsed option values -> the library's frozen configuration (``EndpointConfig`` and its parts).

Owns the one translation of CLI values into ``PoolConfig`` / ``AgentConfig`` / ``Timeouts`` /
``EndpointConfig`` and the run loop's ``ServeOptions``. The config fields are found through the
field<->flag tables of ``kvpush.config`` (a field's option is its flag's parameter name), so no
name is written here a second time. Validation errors come from the config dataclasses, which
name the option; the few checks only the CLI can make (``--interval``, ``--metrics-port``) are
here. Pure functions over a ``{param: value}`` mapping; no torch, nixl or zmq.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, TypedDict, TypeVar

from kvpush.address import binds_all_interfaces
from kvpush.commands.common.options import LogLevel, OutputMode, param_name
from kvpush.config import (
    AGENT_FLAGS,
    TIMEOUT_FLAGS,
    WATCHDOG_FLAG,
    AgentConfig,
    EndpointConfig,
    HandshakeMode,
    KvRegions,
    PoolConfig,
    Role,
    Timeouts,
    VllmWireConfig,
    Wire,
    require_positive,
)
from kvpush.errors import ConfigError

if TYPE_CHECKING:
    from kvpush.fleet.config import RegistryConfig

MODEL_LIKE = ("--block-tokens", "--kv-heads", "--head-dim")

#: Parsed option values, ``{param: value}`` (typer's ``ctx.params``): each value has its option's
#: type, which the readers below narrow to at the point of use.
Params = Mapping[str, object]

_T = TypeVar("_T")
_E = TypeVar("_E", bound=Enum)


def _mistyped(name: str, value: object, kind: str) -> TypeError:
    return TypeError(f"option {name}: {value!r} is not {kind}")


def _need(p: Params, name: str, kind: type[_T]) -> _T:
    """The value of option ``name``, of its type ``kind``."""
    v = p[name]
    if isinstance(v, kind):
        return v
    raise _mistyped(name, v, kind.__name__)


def _maybe(p: Params, name: str, kind: type[_T]) -> _T | None:
    """The value of option ``name`` (None when absent or unset), of its type ``kind``."""
    v = p.get(name)
    if v is None or isinstance(v, kind):
        return v
    raise _mistyped(name, v, kind.__name__)


def _number(p: Params, name: str) -> float | None:
    """The value of a numeric option (an int or a float; None when absent or unset)."""
    v = p.get(name)
    if v is None or isinstance(v, int | float):
        return v
    raise _mistyped(name, v, "a number")


def number(p: Params, name: str) -> float:
    """The value of a numeric option (an int or a float) that is set (``--timeout``)."""
    v = _number(p, name)
    if v is None:
        raise _mistyped(name, v, "a number")
    return v


def _member(p: Params, name: str, kind: type[_E]) -> _E | None:
    """The value of an enum option (its value's text reads as the member; None when unset)."""
    v = p.get(name)
    return None if v is None or v == "" else v if isinstance(v, kind) else kind(v)


def pool_config(p: Params, num_blocks: int | None = None) -> PoolConfig:
    """PoolConfig from parsed options (``num_blocks`` overrides the option, for probes)."""
    model = {flag: _maybe(p, param_name(flag), int) for flag in MODEL_LIKE}
    blocks = _need(p, "num_blocks", int) if num_blocks is None else num_blocks
    layout = _maybe(p, "kv_layout", str) or PoolConfig.kv_layout
    regions = _member(p, "kv_regions", KvRegions) or PoolConfig.kv_regions
    tp = _need(p, "tp", int) if "tp" in p else 1
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
        return PoolConfig.from_model(
            num_blocks=blocks,
            layers=_need(p, "layers", int),
            block_tokens=int(model["--block-tokens"] or 0),
            kv_heads=int(model["--kv-heads"] or 0),
            head_dim=int(model["--head-dim"] or 0),
            dtype=_need(p, "dtype", str),
            device=_need(p, "device", str),
            tp_size=tp,
            kv_layout=layout,
            kv_regions=regions,
        )
    bb = _maybe(p, "block_bytes", int)
    return PoolConfig(
        num_blocks=blocks,
        layers=_need(p, "layers", int),
        block_bytes=PoolConfig.block_bytes if bb is None else bb,
        device=_need(p, "device", str),
        dtype=_need(p, "dtype", str),
        kv_layout=layout,
        kv_regions=regions,
        tp_size=tp,
    )


_VLLM_HASH = re.compile(r"^[0-9a-fA-F]{64}$")


def vllm_wire(p: Params, pool: PoolConfig) -> tuple[VllmWireConfig | None, PoolConfig]:
    """``--wire vllm``: the vLLM wire config (and the pool reshaped by ``--like``)."""
    wire = _member(p, "wire", Wire) or Wire.KVPUSH
    like_addr = _maybe(p, "like", str)
    given = [f for f in ("compat_hash", "vllm_block_size", "attn_backend") if p.get(f)]
    if wire != Wire.VLLM:
        if like_addr or given:
            flag = "--like" if like_addr else "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag} needs --wire vllm", "add --wire vllm, or drop the option")
        return None, pool
    given_hash = str(p.get("compat_hash") or "")
    if given_hash and not _VLLM_HASH.match(given_hash):
        # The same words as the config's check of any hash (``VllmWireConfig``): a hash given
        # by hand is vLLM's sha256, 64 hex digits (one taken with --like is the peer's own).
        raise ConfigError(
            f"invalid compatibility hash {given_hash!r}",
            "pass vLLM's hash (64 hex digits) with --compat-hash, or take it from a running "
            "peer with --like HOST:PORT",
        )
    if like_addr:
        from kvpush.commands.common.like import like

        lk = like(like_addr)
        pool = replace(
            pool,
            layers=lk.layers,
            kv_regions=lk.kv_regions,
            block_bytes=lk.block_bytes,
            kv_layout=lk.kv_layout,
        )
        cfg = lk.wire
    elif not p.get("compat_hash"):
        raise ConfigError(
            "--wire vllm needs the vLLM peer's compatibility hash",
            "pass --like HOST:PORT of a running vLLM peer, or --compat-hash HEX",
        )
    else:
        cfg = VllmWireConfig(compat_hash=str(p["compat_hash"]))
    given_backend = p.get("attn_backend")
    return replace(
        cfg,
        compat_hash=str(p["compat_hash"]).lower() if p.get("compat_hash") else cfg.compat_hash,
        block_size=_maybe(p, "vllm_block_size", int) or cfg.block_size,
        attn_backend_name=str(given_backend) if given_backend else cfg.attn_backend_name,
    ), pool


def backends(text: str) -> tuple[str, ...]:
    return tuple(b.strip() for b in str(text).split(",") if b.strip())


class _AgentValues(TypedDict, total=False):
    """The ``AgentConfig`` fields the options set (an option not given keeps the default)."""

    backends: tuple[str, ...]
    progress_thread: bool
    num_threads: int
    idle_poll_max_us: int
    busy_spin_us: int
    etcd_endpoints: str
    etcd_namespace: str


def agent_config(p: Params) -> AgentConfig:
    opt = {fld: param_name(flag) for fld, flag in AGENT_FLAGS.items()}
    values: _AgentValues = {}
    if opt["backends"] in p:
        values["backends"] = backends(str(p[opt["backends"]]))
    if opt["progress_thread"] in p:
        values["progress_thread"] = bool(p[opt["progress_thread"]])
    if opt["num_threads"] in p:
        values["num_threads"] = _need(p, opt["num_threads"], int)
    if opt["idle_poll_max_us"] in p:
        values["idle_poll_max_us"] = _need(p, opt["idle_poll_max_us"], int)
    if opt["busy_spin_us"] in p:
        values["busy_spin_us"] = _need(p, opt["busy_spin_us"], int)
    etcd = nixl_etcd(p)
    if etcd:
        values["etcd_endpoints"] = etcd["etcd_endpoints"]
        values["etcd_namespace"] = etcd["etcd_namespace"]
    return AgentConfig(**values)


def nixl_etcd(p: Params) -> dict[str, str]:
    """``--nixl-metadata etcd``: the NIXL etcd settings of the agent config ({} when off)."""
    mode = p.get("nixl_metadata")
    if str(getattr(mode, "value", mode) or "sidechannel") != "etcd":
        return {}
    from kvpush.fleet.config import parse_urls
    from kvpush.fleet.record import check_cluster

    hint = "use --nixl-metadata sidechannel (the default), or a private etcd without auth/TLS"
    if not p.get("registry"):
        raise ConfigError("--nixl-metadata etcd needs --registry", "add --registry URL")
    urls = parse_urls(str(p["registry"]))
    secured = [f for f in ("registry_user", "registry_cert", "registry_ca") if p.get(f)]
    if secured or any(u.startswith("https://") for u in urls):
        raise ConfigError(
            "--nixl-metadata etcd: NIXL's etcd backend takes no credentials and no TLS", hint
        )
    if (p.get("wire") or Wire.KVPUSH) != Wire.KVPUSH:
        raise ConfigError(
            "--nixl-metadata etcd works on kvpush's wire only", "drop --wire vllm or the option"
        )
    try:
        cluster = check_cluster(str(p.get("cluster") or "default"))
    except ValueError as e:
        raise ConfigError(f"--cluster: {e}", "e.g. --cluster prod-a") from None
    return {"etcd_endpoints": ",".join(urls), "etcd_namespace": f"/nixl/kvpush/{cluster}"}


def timeouts(p: Params) -> Timeouts:
    values: dict[str, float] = {}
    for fld, flag in TIMEOUT_FLAGS.items():
        name = param_name(flag)
        if name in p:
            value = number(p, name)
            require_positive(flag, value)
            values[fld] = float(value)
    if param_name(WATCHDOG_FLAG) in p:
        values["watchdog_s"] = float(number(p, param_name(WATCHDOG_FLAG)))
    return Timeouts(**values)


def auth_token(path: str | None) -> bytes | None:
    if not path:
        return None
    from kvpush.wire.auth import load_token_file

    return load_token_file(path)


def bare_host(host: str) -> str:
    """``[::1]`` -> ``::1``: addresses are formatted with brackets later, exactly once."""
    h = host.strip()
    return h[1:-1] if h.startswith("[") and h.endswith("]") else h


def check_ready_file(path: str) -> None:
    """Refuse a ``--ready-file`` that could never be written, before anything starts."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConfigError(
            f"--ready-file {path}: directory {directory} does not exist",
            "create the directory first, or give a path in an existing one",
        )
    if os.path.isdir(path):
        raise ConfigError(f"--ready-file {path} is a directory", "give a file path")
    if not os.access(directory, os.W_OK):
        raise ConfigError(
            f"--ready-file {path}: directory {directory} is not writable",
            "choose a directory this user may write to",
        )


def endpoint_config(role: Role, p: Params) -> EndpointConfig:
    """The endpoint's frozen config from the parsed options of serve-prefill / serve-decode."""
    vllm, pool = vllm_wire(p, pool_config(p))
    return EndpointConfig(
        role=role,
        tp_size=pool.tp_size,
        host=bare_host(_need(p, "host", str)),
        port=_need(p, "port", int),
        engine_id=_maybe(p, "engine_id", str) or "",
        pool=pool,
        wire=_member(p, "wire", Wire) or Wire.KVPUSH,
        vllm=vllm,
        agent=agent_config(p),
        timeouts=timeouts(p),
        handshake_mode=_member(p, "handshake", HandshakeMode) or HandshakeMode.NOTIF,
        # A vLLM P's bytes follow no kvpush pattern: on vLLM's wire D reports digests instead.
        verify=bool(p.get("verify", True)) and vllm is None,
        auth_token=auth_token(_maybe(p, "auth_token_file", str)),
        allow_all_interfaces=bool(p.get("expose", False)),
        evict_after_errors=_maybe(p, "evict_after_errors", int) or 3,
        prewarm=bool(p.get("prewarm", False)),
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
    registry: RegistryConfig | None = None

    @staticmethod
    def from_params(p: Params) -> ServeOptions:
        interval = number(p, "interval")
        require_positive("--interval", interval)
        ready_file = _maybe(p, "ready_file", str)
        if ready_file:
            check_ready_file(ready_file)
        metrics_port = _need(p, "metrics_port", int)
        if not (0 <= metrics_port <= 65535):
            raise ConfigError(
                f"invalid port {metrics_port}", "use 1-65535 for --metrics-port, or 0 for off"
            )
        log_level = _member(p, "log_level", LogLevel)
        if log_level is None:
            raise _mistyped("log_level", log_level, LogLevel.__name__)
        return ServeOptions(
            output=_member(p, "output", OutputMode),
            interval_s=float(interval),
            log_level=log_level,
            ready_file=ready_file,
            metrics_host=_need(p, "metrics_host", str),
            metrics_port=metrics_port,
            registry=registry_config(p),
        )


def registry_config(p: Params) -> RegistryConfig | None:
    """``--registry`` and its companions -> RegistryConfig (None without ``--registry``).
    Files are read and checked here, before the endpoint allocates anything."""
    from kvpush.fleet.config import check_file, read_password_file

    urls = p.get("registry")
    if not urls:
        given = [
            f for f in ("advertise", "registry_user", "registry_password_file", "registry_ca",
                        "registry_cert", "registry_key", "prewarm") if p.get(f)
        ]  # fmt: skip
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag} needs --registry", "add --registry URL, or drop the option")
        return None
    from kvpush.fleet.config import LEAVE_GRACE_S, LOAD_PERIOD_S, RegistryConfig

    # A user without a password file (or a certificate without its key) is refused by the
    # config's own ``Access`` check, with the flags in its hint.
    pw_file = _maybe(p, "registry_password_file", str)
    user = _maybe(p, "registry_user", str)
    advertise = _maybe(p, "advertise", str) or None
    leave_grace = _number(p, "registry_leave_grace")
    if advertise is None and binds_all_interfaces(str(p.get("host", ""))):
        raise ConfigError(
            f"--registry with --host {p.get('host')} needs --advertise HOST",
            "peers cannot reach the all-interfaces address: give the address they reach "
            "this machine by (--advertise 10.0.0.7)",
        )
    return RegistryConfig(
        urls=str(urls),
        cluster=str(p.get("cluster") or "default"),
        ttl_s=_maybe(p, "registry_ttl", int) or 10,
        load_period_s=float(_number(p, "registry_load_period") or LOAD_PERIOD_S),
        leave_grace_s=float(LEAVE_GRACE_S if leave_grace is None else leave_grace),
        advertise=advertise,
        user=user or None,
        password=read_password_file(pw_file) if pw_file else None,
        ca_cert=check_file("--registry-ca", _maybe(p, "registry_ca", str)),
        cert=check_file("--registry-cert", _maybe(p, "registry_cert", str)),
        key=check_file("--registry-key", _maybe(p, "registry_key", str)),
    )


def parse_ranks(text: str) -> tuple[int, int]:
    """``PP,TP`` -> (pp, tp): the rank a get_meta_msg asks for."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"invalid --ranks {text!r}", "use PP,TP with two ranks, e.g. --ranks 0,1")
    return int(parts[0]), int(parts[1])

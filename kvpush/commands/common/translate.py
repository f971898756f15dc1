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
from typing import TYPE_CHECKING, Any

from kvpush.address import binds_all_interfaces
from kvpush.commands.common.options import LogLevel, OutputMode, param_name
from kvpush.config import (
    AGENT_FLAGS,
    TIMEOUT_FLAGS,
    WATCHDOG_FLAG,
    AgentConfig,
    EndpointConfig,
    HandshakeMode,
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


def pool_config(p: Mapping[str, Any], num_blocks: int | None = None) -> PoolConfig:
    """PoolConfig from parsed options (``num_blocks`` overrides the option, for probes)."""
    model = {flag: p.get(param_name(flag)) for flag in MODEL_LIKE}
    blocks = p["num_blocks"] if num_blocks is None else num_blocks
    layout = p.get("kv_layout") or PoolConfig.kv_layout
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
            layers=p["layers"],
            block_tokens=int(model["--block-tokens"] or 0),
            kv_heads=int(model["--kv-heads"] or 0),
            head_dim=int(model["--head-dim"] or 0),
            dtype=p["dtype"],
            device=p["device"],
            tp_size=int(p.get("tp", 1)),
            kv_layout=layout,
            kv_regions=p.get("kv_regions") or PoolConfig.kv_regions,
        )
    bb = p.get("block_bytes")
    return PoolConfig(
        num_blocks=blocks,
        layers=p["layers"],
        block_bytes=PoolConfig.block_bytes if bb is None else bb,
        device=p["device"],
        dtype=p["dtype"],
        kv_layout=layout,
        kv_regions=p.get("kv_regions") or PoolConfig.kv_regions,
        tp_size=int(p.get("tp", 1)),
    )


_VLLM_HASH = re.compile(r"^[0-9a-fA-F]{64}$")


def vllm_wire(p: Mapping[str, Any], pool: PoolConfig) -> tuple[VllmWireConfig | None, PoolConfig]:
    """``--wire vllm``: the vLLM wire config (and the pool reshaped by ``--like``)."""
    wire = p.get("wire") or Wire.KVPUSH
    like_addr = p.get("like")
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
    overrides: dict[str, Any] = {}
    if p.get("compat_hash"):
        overrides["compat_hash"] = str(p["compat_hash"]).lower()
    if p.get("vllm_block_size"):
        overrides["block_size"] = int(p["vllm_block_size"])
    if p.get("attn_backend"):
        overrides["attn_backend_name"] = str(p["attn_backend"])
    return replace(cfg, **overrides), pool


def backends(text: str) -> tuple[str, ...]:
    return tuple(b.strip() for b in str(text).split(",") if b.strip())


def agent_config(p: Mapping[str, Any]) -> AgentConfig:
    values: dict[str, Any] = {
        fld: p[param_name(flag)] for fld, flag in AGENT_FLAGS.items() if param_name(flag) in p
    }
    if "backends" in values:
        values["backends"] = backends(values["backends"])
    if "progress_thread" in values:
        values["progress_thread"] = bool(values["progress_thread"])
    values.update(nixl_etcd(p))
    return AgentConfig(**values)


def nixl_etcd(p: Mapping[str, Any]) -> dict[str, str]:
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


def timeouts(p: Mapping[str, Any]) -> Timeouts:
    values: dict[str, float] = {}
    for fld, flag in TIMEOUT_FLAGS.items():
        name = param_name(flag)
        if name in p:
            require_positive(flag, p[name])
            values[fld] = float(p[name])
    if param_name(WATCHDOG_FLAG) in p:
        values["watchdog_s"] = float(p[param_name(WATCHDOG_FLAG)])
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


def endpoint_config(role: Role, p: Mapping[str, Any]) -> EndpointConfig:
    """The endpoint's frozen config from the parsed options of serve-prefill / serve-decode."""
    vllm, pool = vllm_wire(p, pool_config(p))
    return EndpointConfig(
        role=role,
        tp_size=pool.tp_size,
        host=bare_host(p["host"]),
        port=p["port"],
        engine_id=p.get("engine_id") or "",
        pool=pool,
        wire=p.get("wire") or Wire.KVPUSH,
        vllm=vllm,
        agent=agent_config(p),
        timeouts=timeouts(p),
        handshake_mode=p.get("handshake") or HandshakeMode.NOTIF,
        # A vLLM P's bytes follow no kvpush pattern: on vLLM's wire D reports digests instead.
        verify=bool(p.get("verify", True)) and vllm is None,
        auth_token=auth_token(p.get("auth_token_file")),
        allow_all_interfaces=bool(p.get("expose", False)),
        evict_after_errors=int(p.get("evict_after_errors") or 3),
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
    def from_params(p: Mapping[str, Any]) -> ServeOptions:
        require_positive("--interval", p["interval"])
        if p["ready_file"]:
            check_ready_file(p["ready_file"])
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
            registry=registry_config(p),
        )


def registry_config(p: Mapping[str, Any]) -> RegistryConfig | None:
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
    pw_file = p.get("registry_password_file")
    user = p.get("registry_user")
    advertise = p.get("advertise") or None
    if advertise is None and binds_all_interfaces(str(p.get("host", ""))):
        raise ConfigError(
            f"--registry with --host {p.get('host')} needs --advertise HOST",
            "peers cannot reach the all-interfaces address: give the address they reach "
            "this machine by (--advertise 10.0.0.7)",
        )
    return RegistryConfig(
        urls=str(urls),
        cluster=str(p.get("cluster") or "default"),
        ttl_s=int(p.get("registry_ttl") or 10),
        load_period_s=float(p.get("registry_load_period") or LOAD_PERIOD_S),
        leave_grace_s=float(
            LEAVE_GRACE_S if p.get("registry_leave_grace") is None else p["registry_leave_grace"]
        ),
        advertise=advertise,
        user=user or None,
        password=read_password_file(pw_file) if pw_file else None,
        ca_cert=check_file("--registry-ca", p.get("registry_ca")),
        cert=check_file("--registry-cert", p.get("registry_cert")),
        key=check_file("--registry-key", p.get("registry_key")),
    )


def parse_ranks(text: str) -> tuple[int, int]:
    """``PP,TP`` -> (pp, tp): the rank a get_meta_msg asks for."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"invalid --ranks {text!r}", "use PP,TP with two ranks, e.g. --ranks 0,1")
    return int(parts[0]), int(parts[1])

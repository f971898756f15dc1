"""``kvpush probe ADDRESS``: who is this peer, is it healthy, is it compatible with us?

Options -> ``kvpush.commands.probe.probe`` (side-channel identity, RTT, clock offset, compatibility)
and, for ``--handshake`` / ``--ping``, a tiny local decode endpoint that times a real NIXL handshake
-> the report printed for a person (``view``) or as one JSON object. Exit status: 0
healthy, 3 answered but not ready or incompatible, 69 unreachable. Runs on the main thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import TYPE_CHECKING, Annotated

import typer

from kvpush.address import format_address, parse_address
from kvpush.commands.common import options, stdio, translate
from kvpush.commands.common.optspec import option
from kvpush.config import AgentConfig, HandshakeMode, PoolConfig, Role, require_positive
from kvpush.errors import (
    ConfigError,
    ExitStatus,
    IncompatiblePeerError,
    KvpushError,
    PeerShuttingDownError,
    PeerUnreachableError,
)

if TYPE_CHECKING:
    from kvpush.commands.common.translate import Params
    from kvpush.commands.probe.report import ProbeReport
    from kvpush.config import EndpointConfig

DOC = """Ask a peer who it is, whether it is healthy and whether it is compatible with us.

Reports engine id, role, incarnation, versions, geometry, device and compatibility hash,
the side-channel RTT (min/median) and clock offset. Given local geometry options (or
KVPUSH_* variables, or --config), names each field that differs. Exit status: 0 healthy,
3 answered but not ready, incompatible or not a side channel at all (e.g. HTTP), 69
unreachable (connection refused, timed out, a name that resolves to nothing). With --json,
exactly one JSON object on stdout, errors included."""


def register(app: typer.Typer) -> None:
    options.register(app, "probe", probe, DOC, options.PROBE)


def _given(ctx: typer.Context, name: str) -> bool:
    src = ctx.get_parameter_source(name)
    return src is not None and src.name != "DEFAULT"


def error_object(address: str, e: KvpushError) -> dict[str, object]:
    """The one JSON object ``probe --json`` prints when the probe ends in an error."""
    with contextlib.suppress(ConfigError):
        address = format_address(*parse_address(address))
    if isinstance(e, PeerUnreachableError):
        status = "unreachable"
    elif isinstance(e, IncompatiblePeerError):
        status = "incompatible"
    elif isinstance(e, PeerShuttingDownError):
        status = "shutting_down"
    elif e.exit_status == ExitStatus.NOT_READY:
        status = "not_a_side_channel" if getattr(e, "found", "") else "not_ready"
    elif e.exit_status == ExitStatus.USAGE:
        status = "usage"
    else:
        status = "error"
    return {
        "address": address,
        "status": status,
        "found": getattr(e, "found", None),
        "error": e.message,
        "hint": e.hint or None,
        "exit_status": int(e.exit_status),
    }


def probe(
    ctx: typer.Context,
    address: Annotated[str, typer.Argument(help="The peer's side channel, HOST:PORT.")],
    count: Annotated[
        int, option("--count", "-c", help="Round trips to measure (RTT, clock offset).")
    ] = 5,
    timeout: Annotated[
        float,
        option("--timeout", help="Seconds to wait per request.", scope="probe", seconds=True),
    ] = 3.0,
    handshake: Annotated[
        HandshakeMode | None,
        option(
            "--handshake",
            help="Also do a real NIXL handshake of this mode from a tiny local endpoint and "
            "time its phases.",
            scope="probe",
            show_default=False,
        ),
    ] = None,
    ping: Annotated[
        int, option("--ping", help="Measure this many NIXL notification round trips.")
    ] = 0,
    stats: Annotated[bool, option("--stats", help="Show the peer's live telemetry.")] = False,
    lanes: Annotated[
        bool,
        option(
            "--lanes",
            help="Also push a few verified blocks with the peer (a kvpush D: from a tiny P "
            "of the probe's; a kvpush P: into a tiny D of the probe's) and report which lane "
            "carries them, from UCX's own report: the WRITE's and the notification's "
            "transports, device, locality, descriptors per push, post time per descriptor, "
            "flags (tcp_on_one_host, post_dominates) and the evidence. Not for a vLLM engine: "
            "kvpush cannot start its push.",
            scope="probe",
        ),
    ] = False,
    json_out: Annotated[
        bool, option("--json", help="One JSON object on stdout.", scope="probe")
    ] = False,
    ranks: Annotated[
        str,
        option(
            "--ranks",
            help="The peer's (pp, tp) rank to ask for, as PP,TP (vLLM serves one per rank).",
        ),
    ] = "0,0",
    peer_tp: Annotated[
        int | None,
        option(
            "--peer-tp",
            help="The vLLM peer's TP size (tp_size of its kv_transfer_params): needed to ask "
            "it for a rank other than 0,0, since vLLM's listener dies on a rank it does not "
            "serve.",
            show_default=False,
        ),
    ] = None,
    **endpoint: object,  # options.PROBE: the local geometry, NIXL and security options
) -> None:
    try:
        _probe(ctx, **ctx.params)
    except KvpushError as e:
        if json_out:
            stdio.out(json.dumps(error_object(address, e)))
        raise


def _probe(
    ctx: typer.Context,
    address: str,
    count: int,
    timeout: float,
    handshake: HandshakeMode | None,
    ping: int,
    stats: bool,
    lanes: bool,
    json_out: bool,
    ranks: str,
    peer_tp: int | None,
    auth_token_file: str | None,
    backends: str,
    progress_thread: bool,
    **geometry: object,
) -> None:
    from kvpush.commands.probe import probe as core
    from kvpush.commands.probe.report import local_compat_fields

    p = ctx.params
    if lanes:  # before anything loads UCX (its version is read below): its log to a file
        from kvpush.transport import lanes as lane_report

        lane_report.prepare(True)
    token = translate.auth_token(auth_token_file)
    given = [n for n in options.GEOMETRY if _given(ctx, n)]
    local_pool = translate.pool_config(p, num_blocks=4) if given else None
    local = local_compat_fields(local_pool) if local_pool is not None else None
    if ping < 0:
        raise ConfigError(f"--ping must be >= 0, got {ping}", "pass --ping N with N >= 1")
    require_positive("--timeout", timeout)
    asked = translate.parse_ranks(ranks)
    report = core.probe(
        address,
        count=count,
        timeout_s=timeout,
        local=local,
        token=token,
        ranks=asked,
        stats=stats,
        peer_tp=peer_tp,
    )
    if ping > 0 and report.kind == "vllm":
        raise ConfigError(
            f"not pinging {report.address}: NIXL pings are kvpush notifications, and any "
            "notification but vLLM's three forms kills a vLLM engine's main thread",
            "drop --ping for a vLLM peer (--handshake times a real handshake with it)",
        )
    if lanes and report.kind == "vllm":
        from kvpush.commands.probe.lanes import refuse_vllm

        raise refuse_vllm(report.address)
    agent = AgentConfig(backends=translate.backends(backends), progress_thread=progress_thread)
    if handshake is not None or ping > 0:
        if report.differences:
            report.notes.append("incompatible peer: --handshake/--ping skipped")
        else:
            report = _with_handshake(
                report, p, agent, local_pool, token, (handshake, ping, asked[1])
            )
    if lanes:
        if report.differences:
            report.notes.append("incompatible peer: --lanes skipped")
        else:
            report = _with_lanes(report, p, agent, local_pool, token, timeout)
    _print(report, json_out)


def _tiny_base(p: Params, agent: AgentConfig, role: Role) -> EndpointConfig:
    """The probe's tiny local endpoint before it takes the peer's geometry."""
    from kvpush.config import EndpointConfig, Timeouts

    timeout = translate.number(p, "timeout")
    return EndpointConfig(
        role=role,
        agent=agent,
        timeouts=Timeouts(side_channel_s=timeout, handshake_s=max(timeout, 1.0)),
        pool=translate.pool_config(p, num_blocks=4),
    )


def _with_lanes(
    report: ProbeReport,
    p: Params,
    agent: AgentConfig,
    local_pool: PoolConfig | None,
    token: bytes | None,
    timeout_s: float,
) -> ProbeReport:
    """``report`` with the lanes of a few real pushes with the (kvpush) peer."""
    from kvpush.commands.probe import kvpush_peer as probe_kvpush
    from kvpush.commands.probe.lanes import lane_probe

    base = _tiny_base(p, agent, Role.DECODE)
    cfg = probe_kvpush.tiny_local_config(report.metadata, local_pool, token, base)
    role = str(report.metadata.get("role") or "")
    rows = lane_probe(report.address, role, cfg, token, timeout_s)
    return dataclasses.replace(report, lanes=rows)


def _with_handshake(
    report: ProbeReport,
    p: Params,
    agent: AgentConfig,
    local_pool: PoolConfig | None,
    token: bytes | None,
    asked: tuple[HandshakeMode | None, int, int],
) -> ProbeReport:
    """``report`` with the timings of a real NIXL handshake (``--handshake``) and notification
    pings (``--ping``) from a tiny local decode endpoint."""
    from kvpush.commands.probe import kvpush_peer as probe_kvpush
    from kvpush.commands.probe import probe as core
    from kvpush.commands.probe import vllm_peer as probe_vllm

    handshake, ping, rank = asked
    base = _tiny_base(p, agent, Role.DECODE)
    if report.kind == "vllm":
        # Loads the peer's agent (and, full, its descriptors); sends it nothing.
        cfg = probe_vllm.tiny_vllm_config(report.address, base)
    else:
        cfg = probe_kvpush.tiny_local_config(report.metadata, local_pool, token, base)
    hp = core.handshake_probe(report.address, cfg, handshake, ping, rank=rank)
    return dataclasses.replace(
        report,
        handshake_mode=hp.mode if handshake is not None else None,
        handshake_timings_s=hp.timings_s if handshake is not None else None,
        ping_s=hp.ping_s if ping > 0 else None,
    )


def _print(report: ProbeReport, json_out: bool) -> None:
    if json_out:
        stdio.out(json.dumps(report.to_dict(), default=str))
    else:
        from rich.console import Console

        from kvpush.commands.probe.view import probe_report, probe_stats

        con = Console()
        con.print(probe_report(report), soft_wrap=True)
        extra = probe_stats(report)
        if extra is not None:
            con.print()
            con.print(extra)
    raise typer.Exit(int(report.exit_status))

"""The ``kvpush`` command line: options -> frozen config -> one core call -> exit status.

Owns the typer app and the mapping of typed errors to ``error:``/``hint:`` lines and exit
statuses (``run``). Commands import the engine lazily, inside their bodies: importing this module
must stay cheap (typer re-runs the program on every Tab press), so torch, nixl and zmq are never
imported at module level here (``tests/test_cli_import.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import traceback
from enum import Enum
from typing import Annotated, Any

import typer

from kvpush import PROTOCOL_VERSION, __version__
from kvpush.cli import bench_cmd
from kvpush.cli import settings as s
from kvpush.config import HandshakeMode, WriterMode
from kvpush.errors import ConfigError, ExitStatus, KvpushError

HELP = (
    "Push KV-cache blocks from a prefill endpoint (P) into a decode endpoint's (D) memory over "
    "NIXL, as disaggregated LLM inference does in push mode; watch, probe and load-test it."
)
EPILOG = (
    "Exit status: 0 ok, 1 error, 2 usage, 3 peer answered but not ready or incompatible, "
    "69 peer unreachable, 130 interrupted. Every option of a command can also be set with "
    "KVPUSH_<OPTION> (e.g. KVPUSH_NUM_BLOCKS=2048)."
)

app = typer.Typer(
    name="kvpush",
    help=HELP,
    epilog=EPILOG,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _reflow(f: Any) -> Any:
    """Join the lines of each docstring paragraph (typer's rich help keeps single newlines)."""
    doc = inspect.cleandoc(f.__doc__ or "")
    f.__doc__ = "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))
    return f


class _State:
    debug = False


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvpush {__version__} (protocol v{PROTOCOL_VERSION})")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            envvar="KVPUSH_DEBUG",
            show_envvar=True,
            help="Show a traceback with errors.",
        ),
    ] = False,
) -> None:
    """Push KV-cache blocks from prefill to decode endpoints over NIXL."""
    _State.debug = debug


# ------------------------------------------------------------------------------- serve-*


@app.command("serve-prefill")
@_reflow
def serve_prefill(
    ctx: typer.Context,
    config: s.ConfigOpt = None,
    host: s.HostOpt = "127.0.0.1",
    port: Annotated[
        int, s.opt("--port", "Side-channel port (0 picks a free one).", s.PANEL_NET)
    ] = 5600,
    expose: s.ExposeOpt = False,
    engine_id: s.EngineIdOpt = "",
    auth_token_file: s.AuthTokenOpt = None,
    device: s.DeviceOpt = "cpu",
    num_blocks: s.NumBlocksOpt = 1024,
    layers: s.LayersOpt = 4,
    block_bytes: s.BlockBytesOpt = None,
    block_tokens: s.BlockTokensOpt = None,
    kv_heads: s.KvHeadsOpt = None,
    head_dim: s.HeadDimOpt = None,
    dtype: s.DtypeOpt = "bfloat16",
    kv_layout: s.KvLayoutOpt = "NHD",
    backends: s.BackendsOpt = "UCX",
    progress_thread: s.ProgressThreadOpt = False,
    nixl_threads: s.NixlThreadsOpt = 0,
    idle_poll_max_us: s.IdlePollOpt = 1000,
    busy_spin_us: s.BusySpinOpt = 2000,
    writer: s.WriterModeOpt = WriterMode.DEFERRED,
    side_channel_timeout: s.SideChannelTimeoutOpt = 5.0,
    handshake_timeout: s.HandshakeTimeoutOpt = 10.0,
    lease: s.LeaseOpt = 30.0,
    heartbeat: s.HeartbeatOpt = 5.0,
    peer_idle_ttl: s.PeerIdleTtlOpt = 600.0,
    write_timeout: s.WriteTimeoutOpt = 5.0,
    write_min_gbps: s.WriteMinGbpsOpt = 0.05,
    fence_timeout: s.FenceTimeoutOpt = 10.0,
    drain_timeout: s.DrainTimeoutOpt = 10.0,
    metrics_port: s.MetricsPortOpt = 0,
    metrics_host: s.MetricsHostOpt = "127.0.0.1",
    output: s.OutputOpt = None,
    interval: s.IntervalOpt = 1.0,
    log_level: s.LogLevelOpt = s.LogLevel.INFO,
    ready_file: s.ReadyFileOpt = None,
) -> None:
    """Run a prefill endpoint (P): fill blocks on request and push them to decode endpoints.

    P marks a request's blocks finished, matches them with D's PUSH_REG registration (either
    may arrive first), handshakes with a new D in the background and WRITEs the blocks into D's
    memory with a completion notification. SIGINT/SIGTERM drain and exit 0; a second signal
    exits at once (130).
    """
    _serve("prefill", ctx.params)


@app.command("serve-decode")
@_reflow
def serve_decode(
    ctx: typer.Context,
    config: s.ConfigOpt = None,
    host: s.HostOpt = "127.0.0.1",
    port: Annotated[
        int, s.opt("--port", "Side-channel port (0 picks a free one).", s.PANEL_NET)
    ] = 5601,
    expose: s.ExposeOpt = False,
    engine_id: s.EngineIdOpt = "",
    auth_token_file: s.AuthTokenOpt = None,
    device: s.DeviceOpt = "cpu",
    num_blocks: s.NumBlocksOpt = 1024,
    layers: s.LayersOpt = 4,
    block_bytes: s.BlockBytesOpt = None,
    block_tokens: s.BlockTokensOpt = None,
    kv_heads: s.KvHeadsOpt = None,
    head_dim: s.HeadDimOpt = None,
    dtype: s.DtypeOpt = "bfloat16",
    kv_layout: s.KvLayoutOpt = "NHD",
    backends: s.BackendsOpt = "UCX",
    progress_thread: s.ProgressThreadOpt = False,
    nixl_threads: s.NixlThreadsOpt = 0,
    idle_poll_max_us: s.IdlePollOpt = 1000,
    busy_spin_us: s.BusySpinOpt = 2000,
    handshake: s.HandshakeModeOpt = HandshakeMode.NOTIF,
    verify: s.VerifyOpt = True,
    side_channel_timeout: s.SideChannelTimeoutOpt = 5.0,
    handshake_timeout: s.HandshakeTimeoutOpt = 10.0,
    lease: s.LeaseOpt = 30.0,
    heartbeat: s.HeartbeatOpt = 5.0,
    request_deadline: s.RequestDeadlineOpt = 60.0,
    peer_idle_ttl: s.PeerIdleTtlOpt = 600.0,
    fence_timeout: s.FenceTimeoutOpt = 10.0,
    drain_timeout: s.DrainTimeoutOpt = 10.0,
    metrics_port: s.MetricsPortOpt = 0,
    metrics_host: s.MetricsHostOpt = "127.0.0.1",
    output: s.OutputOpt = None,
    interval: s.IntervalOpt = 1.0,
    log_level: s.LogLevelOpt = s.LogLevel.INFO,
    ready_file: s.ReadyFileOpt = None,
) -> None:
    """Run a decode endpoint (D): allocate blocks on request and receive P's push into them.

    D allocates blocks, handshakes with P (notification-only by default: D only ever notifies
    P), sends PUSH_REG, counts completion notifications, verifies the bytes and answers the
    request. SIGINT/SIGTERM drain and exit 0; a second signal exits at once (130).
    """
    _serve("decode", ctx.params)


def _serve(role: Any, params: dict[str, Any]) -> None:
    from kvpush.cli.serve import serve

    cfg = s.endpoint_config(role, params)
    opts = s.ServeOptions.from_params(params)
    raise typer.Exit(serve(cfg, opts))


# ---------------------------------------------------------------------------------- probe

GEOMETRY_PARAMS = (
    "layers",
    "block_bytes",
    "block_tokens",
    "kv_heads",
    "head_dim",
    "dtype",
    "kv_layout",
)


@app.command()
@_reflow
def probe(
    ctx: typer.Context,
    address: Annotated[str, typer.Argument(help="The peer's side channel, HOST:PORT.")],
    count: Annotated[
        int, typer.Option("--count", "-c", help="Round trips to measure (RTT, clock offset).")
    ] = 5,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait per request.")] = 3.0,
    handshake: Annotated[
        HandshakeMode | None,
        typer.Option(
            "--handshake",
            help="Also do a real NIXL handshake of this mode from a tiny local endpoint and "
            "time its phases.",
            show_default=False,
        ),
    ] = None,
    ping: Annotated[
        int, typer.Option("--ping", help="Measure this many NIXL notification round trips.")
    ] = 0,
    stats: Annotated[bool, typer.Option("--stats", help="Show the peer's live telemetry.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    ranks: Annotated[
        str,
        typer.Option(
            "--ranks",
            help="The peer's (pp, tp) rank to ask for, as PP,TP (vLLM serves one per rank).",
        ),
    ] = "0,0",
    config: s.ConfigOpt = None,
    auth_token_file: s.AuthTokenOpt = None,
    device: s.DeviceOpt = "cpu",
    layers: s.LayersOpt = 4,
    block_bytes: s.BlockBytesOpt = None,
    block_tokens: s.BlockTokensOpt = None,
    kv_heads: s.KvHeadsOpt = None,
    head_dim: s.HeadDimOpt = None,
    dtype: s.DtypeOpt = "bfloat16",
    kv_layout: s.KvLayoutOpt = "NHD",
    backends: s.BackendsOpt = "UCX",
    progress_thread: s.ProgressThreadOpt = False,
) -> None:
    """Ask a peer who it is, whether it is healthy and whether it is compatible with us.

    Reports engine id, role, incarnation, versions, geometry, device and compatibility hash,
    the side-channel RTT (min/median) and clock offset. Given local geometry options (or
    KVPUSH_* variables, or --config), names each field that differs. Exit status: 0 healthy,
    3 answered but not ready or incompatible, 69 unreachable.
    """
    from kvpush.config import AgentConfig, EndpointConfig, Timeouts
    from kvpush.ops import probe as core

    p = ctx.params
    token = s.auth_token(auth_token_file)
    given = [n for n in GEOMETRY_PARAMS if _given(ctx, n)]
    local_pool = s.pool_config(p, num_blocks=4) if given else None
    local = core.local_compat_fields(local_pool) if local_pool is not None else None
    if ping < 0:
        raise ConfigError(f"--ping must be >= 0, got {ping}", "pass --ping N with N >= 1")
    if not timeout > 0:
        raise ConfigError(f"--timeout must be positive, got {timeout:g}", "pass --timeout > 0")
    report = core.probe(
        address,
        count=count,
        timeout_s=timeout,
        local=local,
        token=token,
        ranks=s.parse_ranks(ranks),
        stats=stats,
    )
    if handshake is not None or ping > 0:
        if report.kind != "kvpush":
            report.notes.append("--handshake/--ping need a kvpush peer: skipped")
        elif report.differences:
            report.notes.append("incompatible peer: --handshake/--ping skipped")
        else:
            base = EndpointConfig(
                role="decode",
                agent=AgentConfig(
                    backends=tuple(b.strip() for b in backends.split(",") if b.strip()),
                    progress_thread=progress_thread,
                ),
                timeouts=Timeouts(side_channel_s=timeout, handshake_s=max(timeout, 1.0)),
                pool=s.pool_config(p, num_blocks=4),
            )
            cfg = core.tiny_local_config(report.metadata, local_pool, token, base)
            hp = core.handshake_probe(report.address, cfg, handshake, ping)
            report = dataclasses.replace(
                report,
                handshake_mode=hp.mode if handshake is not None else None,
                handshake_timings_s=hp.timings_s if handshake is not None else None,
                ping_s=hp.ping_s if ping > 0 else None,
            )
    if json_out:
        typer.echo(json.dumps(report.to_dict(), default=str))
    else:
        _print_probe(report)
    raise typer.Exit(int(report.exit_status))


def _given(ctx: typer.Context, name: str) -> bool:
    src = ctx.get_parameter_source(name)
    return src is not None and src.name != "DEFAULT"


class _Rows:
    """Label/value lines, printed without table padding (no trailing blanks in pipes)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, Any]] = []

    def add_row(self, label: str, value: Any) -> None:
        self.rows.append((label, value))

    def print(self, con: Any) -> None:
        from rich.text import Text

        width = max((len(k) for k, _ in self.rows), default=0)
        for k, v in self.rows:
            value = v if isinstance(v, Text) else Text(str(v))
            con.print(Text.assemble((k.ljust(width), "dim"), "  ", value), soft_wrap=True)


def _ibytes(n: int) -> str:
    """Binary units for geometry (block sizes are powers of two): 4 KiB, 512 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def _print_probe(r: Any) -> None:
    from rich.console import Console

    from kvpush.cli.render import fmt_ms

    con = Console()
    md = r.metadata
    status = "healthy" if not r.differences else "INCOMPATIBLE"
    con.print(f"[bold]{r.kind} endpoint at {r.address}[/bold]: {status}", highlight=False)
    t = _Rows()

    def row(k: str, v: object) -> None:
        t.add_row(k, str(v))

    if r.kind == "kvpush":
        row("role", md.get("role"))
        row("engine id", md.get("engine_id"))
        row("incarnation", md.get("incarnation"))
        row("agent", md.get("agent_name"))
        row(
            "versions",
            f"kvpush {md.get('kvpush_version')} · protocol v{md.get('protocol_version')} · "
            f"nixl {md.get('nixl_version') or '?'}",
        )
        row("device", f"{md.get('device_kind')} (id {md.get('device_id')})")
        try:
            total = _ibytes(int(md["num_blocks"]) * int(md["regions"]) * int(md["block_bytes"]))
            row(
                "geometry",
                f"{md['num_blocks']} blocks × {md['regions']} regions ({md['layers']} layers × "
                f"K/V) × {_ibytes(int(md['block_bytes']))}, {md.get('dtype')}, "
                f"{md.get('kv_layout')}: {total}",
            )
        except (KeyError, TypeError, ValueError):
            row("geometry", "?")
        row("tp", f"rank {md.get('tp_rank')} of {md.get('tp_size')}")
        row("backends", ",".join(md.get("backends") or []))
        row("auth", "on" if md.get("auth") else "off")
    else:
        for k, v in md.items():
            if k in ("agent_metadata_bytes", "ranks", "regions", "kv_caches_base_addr"):
                continue
            row(k, v)
        row("regions", f"{md.get('regions')}: base addresses {md.get('kv_caches_base_addr')}")
        row("agent metadata", f"{md.get('agent_metadata_bytes')} bytes (not loaded)")
        row("rank", f"pp {md['ranks'][0][0]}, tp {md['ranks'][0][1]}")
    row("compat hash", r.compat_hash)
    rtt = r.rtt
    row(
        "rtt",
        f"min {fmt_ms(rtt.min_s)} ms · median {fmt_ms(rtt.median_s)} ms "
        f"({len(rtt.samples_s)} samples)",
    )
    row("clock offset", f"{rtt.clock_offset_s * 1e3:+.3f} ms")
    if r.differences:
        row("compatible", "NO")
        for f, local, remote in r.differences:
            row("", f"{f}: local {local}, remote {remote}")
    elif r.compat_checked:
        row("compatible", "yes")
    elif r.kind == "kvpush":
        row("compatible", "protocol yes; geometry not checked (give --block-bytes, --layers...)")
    if r.handshake_timings_s is not None:
        phases = " · ".join(
            f"{k.removesuffix('_s')} {fmt_ms(v)} ms" for k, v in r.handshake_timings_s.items()
        )
        row(f"handshake ({r.handshake_mode})", phases)
    if r.ping_s:
        pings = sorted(r.ping_s)
        row(
            "nixl ping",
            f"min {fmt_ms(pings[0])} ms · median {fmt_ms(pings[len(pings) // 2])} ms · "
            f"max {fmt_ms(pings[-1])} ms ({len(pings)} round trips)",
        )
    for n in r.notes:
        row("note", n)
    t.print(con)
    if r.stats is not None:
        from kvpush.cli.render import render_live
        from kvpush.telemetry.snapshot import snapshot_from_dict

        con.print()
        con.print(render_live(snapshot_from_dict(r.stats)))


# ---------------------------------------------------------------------------------- drive


@app.command()
@_reflow
def drive(
    prefill: Annotated[
        list[str],
        typer.Option("--prefill", "-p", help="A prefill endpoint HOST:PORT (repeatable)."),
    ],
    decode: Annotated[
        list[str],
        typer.Option("--decode", "-d", help="A decode endpoint HOST:PORT (repeatable)."),
    ],
    requests: Annotated[int, typer.Option("--requests", "-n", help="Requests to send.")] = 100,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", help="Requests in flight at once.")
    ] = 8,
    rate: Annotated[
        float | None,
        typer.Option(
            "--rate", help="Start at most this many requests per second.", show_default=False
        ),
    ] = None,
    blocks: Annotated[int, typer.Option("--blocks", help="Blocks per request.")] = 4,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds a request may take before it fails.")
    ] = 30.0,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON summary on stdout.")] = False,
    auth_token_file: s.AuthTokenOpt = None,
) -> None:
    """Act as the router: send both legs of N requests to running P and D endpoints.

    For each request the decode leg goes to the next D (round robin) and the prefill leg to the
    next P, both in flight together. Ends with ok/failed counts, failures by reason, latency
    percentiles, throughput and whether every byte verified. Exit status 0 when all requests
    succeeded and verified, 1 otherwise.
    """
    from kvpush.ops.driver import DriveConfig, Driver

    cfg = DriveConfig(
        prefill=tuple(prefill),
        decode=tuple(decode),
        requests=requests,
        concurrency=concurrency,
        rate=rate,
        blocks=blocks,
        timeout_s=timeout,
        auth_token=s.auth_token(auth_token_file),
    )
    show_progress = not json_out and sys.stderr.isatty()
    if show_progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            task = bar.add_task("requests", total=requests)
            report = Driver(cfg, on_result=lambda r: bar.advance(task)).run()
    else:
        report = Driver(cfg).run()
    if json_out:
        typer.echo(json.dumps(report.to_dict()))
    else:
        _print_drive(report)
    raise typer.Exit(0 if report.all_verified else 1)


def _print_drive(r: Any, title: str = "drive") -> None:
    from rich.console import Console
    from rich.text import Text

    from kvpush.cli.render import fmt_bytes, fmt_ms

    con = Console()
    t = _Rows()
    t.add_row("requests", f"{r.requests}: {r.ok} ok, {r.failed} failed")
    for reason, n in r.failures_by_reason.items():
        t.add_row("", f"{n} × {reason}")
    for line in r.first_failures:
        t.add_row("", f"e.g. {line}")
    lat = r.latency_s
    t.add_row(
        "latency",
        f"p50 {fmt_ms(lat['p50'])} ms · p90 {fmt_ms(lat['p90'])} ms · "
        f"p99 {fmt_ms(lat['p99'])} ms · max {fmt_ms(lat['max'])} ms",
    )
    t.add_row("throughput", f"{r.requests_per_s:.1f} requests/s · {r.gb_per_s:.3f} GB/s")
    t.add_row("bytes", f"{fmt_bytes(r.bytes_total)} in {r.elapsed_s:.2f} s")
    t.add_row("by decode", " · ".join(f"{a} {n}" for a, n in r.by_decode.items()))
    t.add_row(
        "all bytes verified",
        Text.from_markup(
            "[green]yes[/green]" if r.all_verified else f"[red]no[/red] ({r.verified}/{r.requests})"
        ),
    )
    con.print(f"[bold]{title} summary[/bold]")
    t.print(con)


# ----------------------------------------------------------------------------------- demo


@app.command()
@_reflow
def demo(
    requests: Annotated[int, typer.Option("--requests", "-n", help="Requests to drive.")] = 300,
    blocks: Annotated[int, typer.Option("--blocks", help="Blocks per request.")] = 4,
    decoders: Annotated[int, typer.Option("--decoders", help="Decode endpoints at start.")] = 2,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", help="Requests in flight at once.")
    ] = 8,
    live: Annotated[
        bool | None,
        typer.Option(
            "--live/--no-live",
            help="Show P's live telemetry while driving (default: when stderr is a terminal).",
            show_default=False,
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON report on stdout.")] = False,
    keep_logs: Annotated[
        bool, typer.Option("--keep-logs", help="Keep the endpoints' logs (kept anyway on failure).")
    ] = False,
) -> None:
    """Start one P and two D endpoints on loopback, push a few hundred requests through them.

    The endpoints run as separate processes. Midway a third D starts and joins the rotation
    (its first push needs a new handshake, which must not stall the others). Every byte is
    verified; the endpoints are stopped with SIGTERM. Exit status 0 when everything succeeded.
    """
    from kvpush.ops.demo import Demo, DemoConfig

    cfg = DemoConfig(requests=requests, blocks=blocks, decoders=decoders, concurrency=concurrency)
    show_live = (sys.stderr.isatty() and not json_out) if live is None else live
    d = Demo(cfg)
    try:
        _demo_run(d, show_live, quiet=json_out)
        report = d.finish(keep_logs=True if keep_logs else None)
    except BaseException:
        d.abort()
        raise
    if json_out:
        typer.echo(json.dumps(report.to_dict()))
    else:
        _print_demo(report)
    raise typer.Exit(0 if report.ok else 1)


def _demo_run(d: Any, show_live: bool, quiet: bool) -> None:
    import time

    from rich.console import Console, Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    con = Console(stderr=True)
    if not quiet:
        con.print(
            f"demo: starting 1 prefill and {d.cfg.decoders} decode endpoints "
            f"(work dir {d.workdir})",
            highlight=False,
        )
    d.start()
    d.start_driving()

    def view() -> Group:
        done, _ok, failed, ndec = d.progress()
        head = Table.grid(padding=(0, 2))
        head.add_row(
            Text("demo", style="bold"),
            ProgressBar(total=d.cfg.requests, completed=done, width=40),
            Text(f"{done}/{d.cfg.requests} requests · {failed} failed · {ndec} decoders"),
        )
        parts: list[Any] = [head, *[Text(e, style="dim") for e in d.events[-4:]], Text()]
        snap = d.prefill_stats()
        if snap is not None:
            from kvpush.cli.render import render_live
            from kvpush.telemetry.snapshot import snapshot_from_dict

            parts.append(render_live(snapshot_from_dict(snap)))
        return Group(*parts)

    if show_live:
        from rich.live import Live

        with Live(view(), console=con, refresh_per_second=4) as lv:
            while not d.done(0.25):
                lv.update(view())
            lv.update(view())
        return
    seen = 0
    last = 0.0
    while not d.done(0.2):
        if quiet:
            continue
        for e in d.events[seen:]:
            con.print(f"demo: {e}", highlight=False)
        seen = len(d.events)
        if time.monotonic() - last > 2.0:
            done, _ok, failed, ndec = d.progress()
            con.print(
                f"demo: {done}/{d.cfg.requests} requests, {failed} failed, {ndec} decoders",
                highlight=False,
            )
            last = time.monotonic()


def _print_demo(r: Any) -> None:
    from rich.console import Console

    con = Console()
    _print_drive(r.drive, title="demo")
    for c in r.children:
        state = "exited 0" if c["returncode"] == 0 else f"exited {c['returncode']}"
        extra = " (joined mid-run)" if c["extra"] else ""
        con.print(
            f"  {c['name']:<4} {c['role']:<8} {c['address']:<22} {c['requests']:>5} requests, "
            f"{state}{extra}",
            highlight=False,
        )
    for e in r.events:
        con.print(f"  [dim]{e}[/dim]", highlight=False)
    if r.kept_logs:
        con.print(f"  logs kept in {r.workdir}", highlight=False)
    con.print("[green]demo ok[/green]" if r.ok else "[red]demo FAILED[/red]")


# ---------------------------------------------------------------------------------- bench

app.command("bench")(_reflow(bench_cmd.bench))


# ----------------------------------------------------------------------------- completion


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


@app.command()
@_reflow
def completion(
    shell: Annotated[Shell, typer.Argument(help="The shell to print a completion script for.")],
) -> None:
    """Print a shell completion script.

    bash: kvpush completion bash > ~/.local/share/bash-completion/completions/kvpush;
    zsh: kvpush completion zsh > "${fpath[1]}/_kvpush";
    fish: kvpush completion fish > ~/.config/fish/completions/kvpush.fish.
    """
    from kvpush.cli.gendocs import completion_script

    typer.echo(completion_script(shell.value), nl=False)


# ------------------------------------------------------------------------------ entry point


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return the exit status (typed errors -> error/hint on stderr)."""
    try:
        app(args=argv, prog_name="kvpush")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except KvpushError as e:
        if _State.debug:
            traceback.print_exc()
        sys.stderr.write(f"error: {_one_line(e.message)}\n")
        if e.hint:
            sys.stderr.write(f"hint: {_one_line(e.hint)}\n")
        return int(e.exit_status)
    except KeyboardInterrupt:
        return int(ExitStatus.INTERRUPTED)
    except Exception as e:
        if _State.debug:
            traceback.print_exc()
        sys.stderr.write(f"error: internal error: {type(e).__name__}: {_one_line(str(e))}\n")
        sys.stderr.write("hint: rerun with --debug for a traceback, and report it\n")
        return int(ExitStatus.ERROR)
    return int(ExitStatus.OK)


def run() -> None:
    """Console-script entry point (``kvpush = "kvpush.cli.main:run"``)."""
    sys.exit(main())

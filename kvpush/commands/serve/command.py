"""``kvpush serve-prefill`` / ``serve-decode``: both commands, and the run loop of an endpoint.

The two commands are built from the one option table (``options.serve_entries(role)``); their
body translates the options (``translate``) and calls ``serve``.

Lifecycle (uvicorn's shape): install signal handlers -> open the endpoint
(``kvpush.endpoint.open_endpoint``; raises typed errors) -> optional Prometheus exporter
(with ``/healthz`` and ``/readyz``) -> optional fleet membership (``--registry``:
``kvpush.fleet.member``, its own threads) -> ready file -> main loop (render telemetry, watch
for a thread failure) -> ordered shutdown: the registry key goes first (routers stop sending),
``endpoint.stop()`` drains under ``--drain-timeout``, then the exporter stops and the ready
file is removed (traces still queued leave before the process: ``tracing.finish``). SIGINT,
SIGTERM and SIGHUP only set a flag (``StopFlag``); a second one exits
at once (130). A stdout whose reader went away (``| head -1``) ends the telemetry lines with one
warning on stderr; the endpoint goes on serving and logging to stderr.

Output: ``live`` draws a rich view on stderr, on the same console as the log handler (log lines
scroll above the view); ``plain`` and ``json`` print one telemetry line per ``--interval`` to
stdout and log to stderr. Runs on the main thread; the endpoint owns its own threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from kvpush import logsafe
from kvpush.commands.common import options, quickexit, stdio, translate
from kvpush.commands.common.options import LogLevel, OutputMode
from kvpush.commands.common.optspec import PANEL_NIXL, PANEL_OUT, option
from kvpush.commands.common.translate import ServeOptions
from kvpush.config import EndpointConfig, Role
from kvpush.errors import ExitStatus, KvpushError
from kvpush.runtime.heap import freeze_startup_heap
from kvpush.runtime.signals import StopFlag
from kvpush.telemetry import tracing

if TYPE_CHECKING:
    from kvpush.decode.group import DecodeGroup
    from kvpush.decode.role import DecodeRole
    from kvpush.endpoint.core import Endpoint
    from kvpush.fleet.member import Membership
    from kvpush.prefill.group import PrefillGroup
    from kvpush.prefill.role import PrefillRole
    from kvpush.telemetry.health import Health
    from kvpush.telemetry.prom import PrometheusExporter
    from kvpush.telemetry.snapshot import Snapshot

    #: What ``open_endpoint`` starts: a P or a D.
    Served = Endpoint[PrefillRole, PrefillGroup] | Endpoint[DecodeRole, DecodeGroup]

log = logging.getLogger("kvpush.serve")

LIVE_REFRESH_S = 0.25

DOCS: dict[str, str] = {
    Role.PREFILL: """Run a prefill endpoint (P): fill blocks on request and push them to decode
    endpoints.

    P marks a request's blocks finished, matches them with D's PUSH_REG registration (either
    may arrive first), handshakes with a new D in the background and WRITEs the blocks into D's
    memory with a completion notification. SIGINT, SIGTERM and SIGHUP drain and exit 0; a
    second signal exits at once (130). A closed stdout stops the telemetry lines, not the
    endpoint.""",
    Role.DECODE: """Run a decode endpoint (D): allocate blocks on request and receive P's push into
    them.

    D allocates blocks, handshakes with P (notification-only by default: D only ever notifies
    P), sends PUSH_REG, counts completion notifications, verifies the bytes and answers the
    request. SIGINT, SIGTERM and SIGHUP drain and exit 0; a second signal exits at once (130).
    A closed stdout stops the telemetry lines, not the endpoint.""",
}


def register(app: typer.Typer) -> None:
    for role in ROLES:
        options.register(
            app, f"serve-{role}", _command(role), DOCS[role], options.serve_entries(role)
        )


ROLES: tuple[Role, ...] = (Role.PREFILL, Role.DECODE)


LANES_HELP = (
    "Report which lane carries each peer's KV: UCX prints its protocol selection "
    "(UCX_PROTO_INFO) into a private log file that kvpush reads (never onto stdout) and relays "
    "UCX's other log lines to kvpush's log; a P's peer rows then show the WRITE's and the "
    "notification's transports, descriptors per push and post time per descriptor. An "
    "operator's own UCX_LOG_FILE or UCX_PROTO_INFO is left as it is (lanes are then read from "
    "that file)."
)
Lanes = Annotated[bool, option("--lanes/--no-lanes", help=LANES_HELP, panel=PANEL_NIXL)]
COALESCE_HELP = (
    "P: pushes ready for the same D rank in one pass of the writer go as one NIXL WRITE with one "
    "notification naming them all (never waiting to fill a batch), to a D that takes them. D: "
    "its registrations say it takes them, and those of one pass go to a P that takes them in "
    "one notification. kvpush's wire only (vLLM's is unchanged). --no-coalesce: one WRITE and "
    "one completion notification per push, one notification per registration."
)
Coalesce = Annotated[bool, option("--coalesce/--no-coalesce", help=COALESCE_HELP, panel=PANEL_NIXL)]
OtlpEndpoint = Annotated[
    str | None,
    option(
        "--otlp-traces-endpoint",
        help=tracing.ENDPOINT_HELP,
        panel=PANEL_OUT,
        metavar="URL",
        show_default=False,
    ),
]
OtlpRatio = Annotated[
    float, option("--otlp-sample-ratio", help=tracing.RATIO_HELP, panel=PANEL_OUT, metavar="R")
]


def _command(role: Role) -> Callable[..., None]:
    """The body of ``serve-<role>``: every option but ``--lanes``, ``--coalesce`` and the
    traces' is an entry of the endpoint table."""

    def body(
        lanes: Lanes = True,
        coalesce: Coalesce = True,
        otlp_traces_endpoint: OtlpEndpoint = None,
        otlp_sample_ratio: OtlpRatio = 1.0,
        **params: object,
    ) -> None:
        cfg = translate.endpoint_config(role, params)
        traces = tracing.resolve(otlp_traces_endpoint, otlp_sample_ratio)
        if traces.endpoint:
            tracing.require_sdk()  # before anything starts, not once the pool is allocated
        cfg = dataclasses.replace(
            cfg,
            agent=dataclasses.replace(cfg.agent, lanes=lanes),
            tracing=traces,
            coalesce=coalesce,
        )
        opts = ServeOptions.from_params(params)
        raise typer.Exit(serve(cfg, opts))

    return body


def setup_logging(console: Console, level: LogLevel | str, rich_handler: bool) -> None:
    """One handler for the application: rich on a terminal, plain lines otherwise."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler: logging.Handler
    if rich_handler:
        from rich.logging import RichHandler

        handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(logsafe.install(handler))  # peer strings never forge a record
    lvl = level.value if isinstance(level, LogLevel) else level
    root.setLevel(lvl.upper())


def write_ready_file(path: str, info: dict[str, object]) -> None:
    """Write ``info`` as JSON to ``path`` atomically (temp file in the same dir + rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ready-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def choose_output(requested: OutputMode | None) -> OutputMode:
    """Live only when both stdout and stderr are terminals (isatty, not rich's detection)."""
    if requested is not None:
        return requested
    return OutputMode.LIVE if sys.stdout.isatty() and sys.stderr.isatty() else OutputMode.PLAIN


def serve(cfg: EndpointConfig, opts: ServeOptions) -> int:
    """Run one endpoint until SIGINT/SIGTERM/SIGHUP; return the exit status (raise typed
    errors)."""
    from kvpush.commands.serve import lines

    console = Console(stderr=True)
    output = _output(cfg, opts, console)
    stop = StopFlag().install()
    run = _Running()
    failure: BaseException | None = None
    try:
        ep = _start(run, cfg, opts, stop)
        if output is OutputMode.LIVE:
            failure = _loop_live(ep, stop, console)
        else:
            fn = lines.render_json if output is OutputMode.JSON else lines.render_plain
            failure = _loop_lines(ep, stop, opts.interval_s, fn)
        if stop.signame:
            log.info("%s received: draining (up to %gs)", stop.signame, cfg.timeouts.drain_s)
    finally:
        _stop(run, opts, failure)
        stop.restore()
    if failure is not None:
        if isinstance(failure, KvpushError):
            raise failure
        raise KvpushError(
            f"an internal thread of the endpoint failed: {type(failure).__name__}: {failure}",
            "rerun with --debug --log-level debug and report the log",
        ) from failure
    log.info("stopped cleanly")
    return int(ExitStatus.OK)


def _output(cfg: EndpointConfig, opts: ServeOptions, console: Console) -> OutputMode:
    """The output mode, once logging is set up (with its warnings: an exposed side channel
    without a token, ``-o live`` without a terminal to draw on)."""
    output = choose_output(opts.output)
    live_refused = output is OutputMode.LIVE and not sys.stderr.isatty()
    if live_refused:
        output = OutputMode.PLAIN
    setup_logging(console, opts.log_level, rich_handler=sys.stderr.isatty())
    if cfg.allow_all_interfaces and cfg.auth_token is None:
        log.warning(
            "the side channel binds %s without --auth-token-file: anyone who can reach it "
            "can send requests",
            cfg.host,
        )
    if live_refused:
        log.warning(
            "-o live draws on stderr, which is not a terminal here: printing plain lines "
            "on stdout instead (-o plain or -o json says so without this warning)"
        )
    return output


@dataclass
class _Running:
    """What ``_start`` got running so far: ``_stop`` stops exactly that."""

    ep: Served | None = None
    exporter: PrometheusExporter | None = None
    member: Membership | None = None

    def snapshot(self) -> Snapshot:
        """The endpoint's telemetry (the exporter serves it once the endpoint is up)."""
        assert self.ep is not None, "asked for telemetry before the endpoint started"
        return self.ep.snapshot()


def _start(run: _Running, cfg: EndpointConfig, opts: ServeOptions, stop: StopFlag) -> Served:
    from kvpush.endpoint import open_endpoint

    if opts.metrics_port:
        from kvpush.telemetry.prom import PrometheusExporter

        # Bound before the pool is allocated (a busy port fails in milliseconds, not after
        # gigabytes); served once the endpoint is up.
        run.exporter = PrometheusExporter(run.snapshot, opts.metrics_host, opts.metrics_port)
        run.exporter.reserve()
    run.ep = ep = open_endpoint(cfg)
    stop.rearm()  # UCX took SIGHUP over while the endpoint started
    if cfg.agent.lanes:
        _say_lanes()
    freeze_startup_heap()
    health = _health(ep)
    if run.exporter is not None:
        run.exporter.health = health
        run.exporter.start()
    if opts.registry is not None:
        from kvpush.fleet.member import Membership

        run.member = Membership(ep, opts.registry, run.exporter.url if run.exporter else "")
        health.registration = run.member.verdict
        run.member.start()
    if opts.ready_file:
        info: dict[str, object] = {
            "address": ep.address,
            "engine_id": cfg.engine_id,
            "incarnation": ep.incarnation,
            "pid": os.getpid(),
            "role": cfg.role,
        }
        if run.exporter is not None:
            info["metrics"] = run.exporter.url
        write_ready_file(opts.ready_file, info)
    log.info("%s endpoint ready on %s; Ctrl+C or SIGTERM drains and stops", cfg.role, ep.address)
    return ep


def _stop(run: _Running, opts: ServeOptions, failure: BaseException | None) -> None:
    """The ordered shutdown: registry key, leave grace, drain, exporter, ready file."""
    if run.member is not None:
        # The key goes first, then the endpoint serves on for the leave grace, so routers
        # (and drives) following the registry stop sending before intake stops.
        grace = opts.registry.leave_grace_s if opts.registry is not None else 0.0
        if run.member.leave() and grace > 0 and failure is None:
            log.info("registry key removed: serving %gs more before the drain", grace)
            time.sleep(grace)
    if run.ep is not None:
        run.ep.stop()
        tracing.finish()  # the spans of the drain leave before the process does
        quickexit.request()  # nothing is left for the interpreter's finalization to do
    if run.exporter is not None:
        run.exporter.stop()
    if opts.ready_file:
        with contextlib.suppress(OSError):
            os.unlink(opts.ready_file)


def _say_lanes() -> None:
    from kvpush.transport import lanes

    where, problem = lanes.describe()
    if problem:
        log.warning("lanes: %s: peers' lanes show as unknown", where)
    else:
        log.info("lanes: %s", where)


def _pump_lanes() -> None:
    """Read UCX's log (its own lines go to kvpush's log): a D takes no lane snapshot."""
    from kvpush.transport import lanes

    lanes.refresh()


def _health(ep: Served) -> Health:
    from kvpush.telemetry.health import Health

    return Health(ep.snapshot, ep.failure, lambda: ep.stopping)


def _loop_lines(
    ep: Served, stop: StopFlag, interval_s: float, fn: Callable[[Snapshot], str]
) -> BaseException | None:
    next_t = time.monotonic() + interval_s
    told = False
    while not stop.event.is_set():
        failure: BaseException | None = ep.failure()
        if failure is not None:
            return failure
        _pump_lanes()
        now = time.monotonic()
        if now >= next_t:
            sys.stdout.write(fn(ep.snapshot()) + "\n")
            sys.stdout.flush()
            next_t = now + interval_s
            if stdio.stdout_closed() and not told:
                told = True
                log.warning(
                    "stdout was closed by its reader: no more telemetry lines; the endpoint "
                    "goes on serving (SIGTERM or Ctrl+C drains and stops it)"
                )
        stop.event.wait(min(0.2, max(0.0, next_t - time.monotonic())))
    return None


def _loop_live(ep: Served, stop: StopFlag, console: Console) -> BaseException | None:
    """Redraw the fitted view every ``LIVE_REFRESH_S`` from this thread only (no refresh
    thread of rich's). When the terminal's size changed, the screen is cleared first: a
    terminal that re-wraps its lines on a resize leaves the old frame taller than the view
    remembers, and its top rows would stay on screen as a ghost frame."""
    from rich.live import Live

    from kvpush.commands.serve.fit import FittedView

    size = console.size
    with Live(
        FittedView(ep.snapshot()),
        console=console,
        auto_refresh=False,
        redirect_stdout=False,
        redirect_stderr=False,
    ) as live:
        while not stop.event.wait(LIVE_REFRESH_S):
            failure: BaseException | None = ep.failure()
            if failure is not None:
                return failure
            _pump_lanes()
            if console.size != size:
                size = console.size
                console.clear()
            live.update(FittedView(ep.snapshot()), refresh=True)
    return None

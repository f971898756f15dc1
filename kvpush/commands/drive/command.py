"""``kvpush drive``: act as the router and put load through running P and D endpoints.

Options -> ``kvpush.commands.drive.driver.Driver`` -> a progress bar on a terminal, or a progress
line on stderr every few seconds when stderr is not one; peer events (down, back up) as they happen
-> the summary for a person (``view``) or one JSON object. The first SIGINT, SIGTERM
or SIGHUP stops intake and gives in-flight requests a short grace, a second ends the grace:
the partial summary is printed (every request accounted for) and the exit status is 130.
Otherwise 0 only when every request succeeded and verified, else 1. Runs on the main thread;
the driver owns its worker threads.

The old spelling of one vLLM leg (``drive --decode D --kv-transfer-params ...``, ``drive
--prefill P --request-id ID --blocks N``: hidden options now) still runs that leg through
``kvpush.commands.leg.command``, after a one-line deprecation note on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from kvpush.commands.common import options, translate
from kvpush.commands.common.optspec import option
from kvpush.commands.drive import progress
from kvpush.commands.drive import view as reports
from kvpush.commands.drive import workload_options as wo
from kvpush.commands.drive.otlp import DriveSpans, finish_traced
from kvpush.commands.drive.otlp import note as otlp_note
from kvpush.commands.leg import command as legs
from kvpush.commands.leg import otlp as otlp_options
from kvpush.config import Role, require_counts
from kvpush.errors import ConfigError
from kvpush.logsafe import shown
from kvpush.runtime.signals import StopFlag

if TYPE_CHECKING:
    from kvpush.commands.common.results import DriveConfig, DriveReport, RequestResult
    from kvpush.commands.drive.driver import Driver
    from kvpush.commands.drive.targets import FleetTargets
    from kvpush.commands.drive.workload import Replay
    from kvpush.config import TracingConfig

DOC = """Act as the router: send both legs of N requests to running P and D endpoints.

For each request the decode leg goes to a D that is up -- each of the --concurrency workers
has its own (workers spread evenly over the Ds, so a frozen D holds only its own workers; with
fewer workers than Ds, round robin) -- and the prefill leg to the next P, both in flight
together. A peer that refuses connections or misses a
liveness check is marked down at once and traffic goes to the others; it is re-checked (the
preflight again: role, geometry, readiness) and comes back. While no P or no D is up,
requests wait --peer-grace seconds for one to come back. Ends with ok/failed counts,
failures by reason, latency percentiles, throughput and whether every byte verified; every
request is accounted for. Ctrl-C stops intake, waits briefly for requests in flight and
prints the partial summary (exit 130). Exit status 0 when all requests succeeded and
verified, 1 otherwise.

With --registry URL (and --cluster NAME) instead of --prefill/--decode, the Ps and Ds are the
endpoints registered in etcd (serve-* --registry) that pass the same preflight (checked
together, a few at a time): one that does not answer or does not fit is left out with a note,
never stopping the run. drive follows the registry while it runs: an endpoint that registers,
restarts or comes back is checked again before it gets requests; one whose key goes gets no new
request (a hint: its requests in flight end only on the data path's evidence). Every request is
still accounted for.

With --workload FILE (a request trace in the Mooncake format; 'kvpush workload synth' makes
one) the requests are the trace's, replayed open loop: each at its timestamp / --speedup,
whether or not earlier ones finished, with ceil(input_length / --block-tokens) blocks. A bad
line, or a prompt larger than any D's pool, is named on stderr (its line number) and the replay
goes on. The summary adds offered vs achieved rate, how late requests started (against the
tool's 100 ms tolerance), latency by prompt size, GB/s over time, each D's pool occupancy over
time (its own gauges) and failures by reason (no_free_blocks when the pool cannot hold the
traffic).

With --otlp-traces-endpoint URL each request is one OpenTelemetry trace: drive's client span,
the Ps and Ds' server spans (theirs too started with the flag) and their phases as child spans.

One leg of a vLLM push deployment, with no router, is 'kvpush leg decode' or 'kvpush leg
prefill'."""

PROGRESS_EVERY_S = 3.0

#: What each leg of drive's old spelling takes; any other option given is refused.
OLD_LEG = {
    Role.DECODE: frozenset(
        {"decode", "kv_transfer_params", "blocks", "alloc_delay", "timeout", "json_out"}
    ),
    Role.PREFILL: frozenset({"prefill", "request_id", "blocks", "timeout", "json_out"}),
}


def register(app: typer.Typer) -> None:
    options.register(app, "drive", drive, DOC, options.REGISTRY)


def _given(ctx: typer.Context, name: str) -> bool:
    src = ctx.get_parameter_source(name)
    return src is not None and src.name != "DEFAULT"


def old_leg(ctx: typer.Context, token: bytes | None) -> None:
    """``drive --kv-transfer-params`` / ``drive --request-id``: the leg, as ``kvpush leg``
    runs it, after a deprecation note (refused with options of a load run)."""
    p = ctx.params
    leg = Role.DECODE if p["request_id"] is None else Role.PREFILL
    flag = "--kv-transfer-params" if leg == Role.DECODE else "--request-id"
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"drive: note: 'drive {flag}' is deprecated: run 'kvpush leg {leg}' (the same options)"
    )
    names = {prm.name: prm.opts[0] for prm in ctx.command.params if prm.name}
    allowed = OLD_LEG[leg] | {"auth_token_file"}
    extra = [names[n] for n in names if n not in allowed and _given(ctx, n)]
    ends = p[leg] or []
    if extra or len(ends) != 1:
        what = f"no {', '.join(extra)}" if extra else f"one --{leg}, got {len(ends)}"
        raise ConfigError(
            f"drive {flag} runs one vLLM leg, which takes {what}",
            f"run 'kvpush leg {leg} --{leg} HOST:PORT ...' (see 'kvpush leg {leg} --help')",
        )
    blocks = p["blocks"] if _given(ctx, "blocks") else None
    if leg == Role.DECODE:
        legs.decode_leg(
            ends[0], p["kv_transfer_params"], blocks, p["timeout"], p["alloc_delay"], token,
            p["json_out"],
        )  # fmt: skip
    if blocks is None:
        raise ConfigError(
            "--request-id needs --blocks N",
            "pass the request's prompt blocks: the vLLM D must allocate as many",
        )
    legs.prefill_leg(ends[0], p["request_id"], blocks, p["timeout"], token, p["json_out"], "drive")


# drive's own options: each parameter's type carries its option (typer reads the signature).
Prefill = Annotated[
    list[str] | None,
    option(
        "--prefill",
        "-p",
        help="A prefill endpoint HOST:PORT (repeatable).",
        metavar="HOST:PORT",
        show_default=False,
    ),
]

Decode = Annotated[
    list[str] | None,
    option(
        "--decode",
        "-d",
        help="A decode endpoint HOST:PORT (repeatable).",
        metavar="HOST:PORT",
        show_default=False,
    ),
]

Requests = Annotated[int, option("--requests", "-n", help="Requests to send.")]

Rate = Annotated[
    float | None,
    option("--rate", help="Start at most this many requests per second.", show_default=False),
]

Tokens = Annotated[
    int | None,
    option(
        "--tokens",
        help="Tokens per request (with --shape): --blocks becomes ceil(tokens / the "
        "shape's block tokens).",
        show_default=False,
    ),
]

Timeout = Annotated[
    float,
    option(
        "--timeout",
        help="Seconds a request may take before it fails.",
        scope="drive",
        seconds=True,
    ),
]

JsonOut = Annotated[bool, option("--json", help="One JSON summary on stdout.", scope="drive")]

# drive's old spelling of 'kvpush leg decode|prefill' (deprecated): hidden, no variable.
KvTransferParams = Annotated[
    str | None,
    option(
        "--kv-transfer-params",
        help="Deprecated: 'kvpush leg decode'.",
        env=False,
        hidden=True,
        metavar="FILE|JSON",
    ),
]

RequestId = Annotated[
    str | None,
    option(
        "--request-id",
        help="Deprecated: 'kvpush leg prefill'.",
        env=False,
        hidden=True,
        metavar="ID",
    ),
]

AllocDelay = Annotated[
    float,
    option(
        "--alloc-delay",
        help="Deprecated: 'kvpush leg decode'.",
        env=False,
        hidden=True,
        seconds=True,
    ),
]

Trace = Annotated[
    Path | None,
    option(
        "--trace",
        help="Write one JSON line per request to FILE: transfer id, outcome, reason, and "
        "the seconds from sending it to each phase (D allocated, PUSH_REG sent, P matched, "
        "handshake done, WRITE posted and done, completion received, verified, answered), "
        "both legs on drive's clock; a failed request's 'ended_at'. The summary adds "
        "p50/p99 per phase.",
        metavar="FILE",
        dir_okay=False,
    ),
]

PeerGrace = Annotated[
    float,
    option(
        "--peer-grace",
        help="While no P (or no D) is up, hold requests this long for one to come back (a "
        "restart is a dip, not the end of the run); past it what is left fails as "
        "unreachable.",
        seconds=True,
    ),
]


def drive(
    ctx: typer.Context,
    prefill: Prefill = None,
    decode: Decode = None,
    requests: Requests = 100,
    concurrency: options.Concurrency = 8,
    rate: Rate = None,
    blocks: options.Blocks = 4,
    shape: options.Shape = None,
    tokens: Tokens = None,
    timeout: Timeout = 30.0,
    json_out: JsonOut = False,
    # drive's old spelling of 'kvpush leg decode|prefill' (deprecated): hidden, no variable
    kv_transfer_params: KvTransferParams = None,
    request_id: RequestId = None,
    alloc_delay: AllocDelay = 0.0,
    trace: Trace = None,
    peer_grace: PeerGrace = 5.0,
    workload: wo.Workload = None,
    speedup: wo.Speedup = 1.0,
    limit: wo.Limit = None,
    start_at: wo.StartAt = 0.0,
    block_tokens: wo.BlockTokens = None,
    auth_token_file: options.AuthTokenFile = None,
    otlp_traces_endpoint: otlp_options.Endpoint = None,
    otlp_sample_ratio: otlp_options.Ratio = 1.0,
    **registry: object,  # options.REGISTRY: the endpoints' registry options
) -> None:
    token = translate.auth_token(auth_token_file)
    traces = otlp_options.traces(otlp_traces_endpoint, otlp_sample_ratio)
    if kv_transfer_params is not None or request_id is not None:
        old_leg(ctx, token)
    if _given(ctx, "alloc_delay"):
        raise ConfigError(
            "--alloc-delay applies to one vLLM leg, not to a load run",
            "run 'kvpush leg decode --alloc-delay SECONDS ...'",
        )
    wo.refuse_mixed(ctx, _given)
    # soft_wrap: one line per event whatever the width (a file or pipe is not 80 columns).
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    targets, prefill, decode = _endpoints(registry, list(prefill or ()), list(decode or ()), err)
    from kvpush.commands.drive.driver import DriveConfig

    replay = None
    if workload is not None:  # a trace: its requests, sizes and times (blocks: per request)
        replay = wo.replay(
            workload, speedup=speedup, limit=limit, start_at=start_at, block_tokens=block_tokens,
            shape=shape, token=token, say=lambda text: _say(err, text),
        )  # fmt: skip
        requests, rate, blocks, tokens = replay.requests, None, 1, None
        concurrency = concurrency if _given(ctx, "concurrency") else wo.WORKLOAD_CONCURRENCY
    cfg = DriveConfig(
        prefill=tuple(prefill),
        decode=tuple(decode),
        requests=requests,
        concurrency=concurrency,
        rate=rate,
        blocks=_shaped_blocks(ctx, shape, tokens, blocks),
        timeout_s=timeout,
        auth_token=token,
        shape=shape or "",
        peer_grace_s=peer_grace,
    )
    if targets is not None:  # the registry's set, checked; one that left meanwhile is dropped
        cfg = targets.preflight(cfg)
    tty = sys.stderr.isatty() and not json_out
    report, signame, spans = _run(cfg, targets, trace, err, tty, replay, traces)
    if report.interrupted:
        err.print(
            f"drive: interrupted ({signame or 'cancelled'}): intake stopped; the summary "
            "counts requests never sent and those still in flight as cancelled"
        )
    ok, interrupted = report.all_verified, report.interrupted
    if replay is not None:
        from kvpush.commands.drive.workload_report import workload_summary

        wr = replay.report(report, report.concurrency)
        finish_traced(wr, workload_summary, spans, json_out, ok=ok, interrupted=interrupted)
    finish_traced(report, reports.drive_summary, spans, json_out, ok=ok, interrupted=interrupted)


def _endpoints(
    registry: dict[str, object], prefill: list[str], decode: list[str], err: Console
) -> tuple[FleetTargets | None, list[str], list[str]]:
    """The registry's follower (or None) and the Ps and Ds to start with."""
    targets: FleetTargets | None = None
    if registry.get("registry"):
        from kvpush.commands.common.registry import registry_source
        from kvpush.commands.drive.targets import FleetTargets

        if prefill or decode:
            raise ConfigError(
                "--registry takes the Ps and Ds from the registry: not with --prefill/--decode",
                "drop --prefill/--decode, or drop --registry",
            )
        targets = FleetTargets(registry_source(registry), lambda text: _say(err, text))
        prefill, decode = (list(x) for x in targets.initial())
    if not prefill or not decode:
        missing = "--prefill" if not prefill else "--decode"
        raise ConfigError(
            f"drive needs {missing} HOST:PORT",
            "a load run takes --prefill and --decode endpoints; one vLLM leg is 'kvpush leg "
            "decode' or 'kvpush leg prefill'",
        )
    return targets, prefill, decode


def _run(
    cfg: DriveConfig,
    targets: FleetTargets | None,
    trace: Path | None,
    err: Console,
    tty: bool,
    replay: Replay | None,
    traces: TracingConfig,
) -> tuple[DriveReport, str | None, dict[str, object] | None]:
    """Run the driver under a signal handler, with a progress bar (``tty``) or progress lines,
    on ``replay``'s schedule when there is one; return its report, the signal that stopped
    it, if one did, and what its traces did (``--otlp-traces-endpoint``)."""
    from kvpush.commands.drive.driver import DriveHooks, Driver

    driver: Driver  # set below, before the first tick

    def tick() -> None:
        if not tty:
            done, ok, failed = driver.progress()
            err.print(
                reports.drive_progress_line(
                    done, ok, failed, driver.in_flight(), cfg.requests, driver.health.rows()
                )
            )

    advance: list[Callable[[RequestResult], object]] = [
        lambda r: None
    ]  # the progress bar's, once it exists
    tracer = None
    if trace is not None:
        from kvpush.commands.drive.trace import Tracer

        tracer = Tracer(trace, cfg.auth_token, min(cfg.timeout_s, 5.0))
    hooks = DriveHooks(
        on_result=progress.each_result(replay, advance),
        on_event=lambda text: _say(err, text),
        on_tick=tick,
        tick_s=PROGRESS_EVERY_S,
    )
    spans = DriveSpans(traces, cfg) if traces.endpoint else None
    checked = targets.checked if targets is not None else None
    driver = Driver(cfg, hooks, tracer, checked, replay, spans)
    if replay is not None:
        replay.attach(lambda: driver.decodes)
    if targets is not None:
        driver.notes.extend(dict.fromkeys(targets.notes))
        targets.follow(driver)
    told = len(driver.notes)  # what the run's plan already says: printed before it starts
    for note in driver.notes:
        _say(err, f"note: {note}")
    stop = StopFlag(on_signal=driver.cancel).install()
    try:
        report = progress.with_bar(driver, advance, err, cfg.requests) if tty else driver.run()
    finally:
        stop.restore()
        if targets is not None:
            targets.stop()
        summary = spans.summary(spans.close()) if spans is not None else None
    for note in report.notes[told:]:
        _say(err, f"note: {note}")
    if summary is not None:
        _say(err, otlp_note(summary))
    return report, stop.signame, summary


def _say(err: Console, text: str) -> None:
    """One line of drive's on stderr: words from the registry or a peer are shown as they are
    (no Rich markup read into them, every control character escaped)."""
    err.print(f"drive: {shown(text)}", markup=False)


def _shaped_blocks(ctx: typer.Context, shape: str | None, tokens: int | None, blocks: int) -> int:
    """``--tokens`` in the blocks of ``--shape`` (refused without one, or with --blocks)."""
    if tokens is None:
        return blocks
    if not shape:
        raise ConfigError("--tokens needs --shape", "name the model, e.g. --shape llama-8b")
    if _given(ctx, "blocks"):
        raise ConfigError(
            "--tokens and --blocks both size the requests", "give one of them, not both"
        )
    require_counts(("--tokens", tokens))
    from kvpush.memory.shapes import get_shape

    return get_shape(shape).blocks_for(tokens)

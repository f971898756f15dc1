"""``kvpush drive``: act as the router and put load through running P and D endpoints.

Options -> ``kvpush.ops.driver.Driver`` -> a progress bar on a terminal, or a progress line on
stderr every few seconds when stderr is not one; peer events (down, back up) as they happen
-> the summary for a person (``views.reports``) or one JSON object. The first SIGINT, SIGTERM
or SIGHUP stops intake and gives in-flight requests a short grace, a second ends the grace:
the partial summary is printed (every request accounted for) and the exit status is 130.
Otherwise 0 only when every request succeeded and verified, else 1. Runs on the main thread;
the driver owns its worker threads.

With ``--kv-transfer-params`` or ``--request-id`` it drives one leg of a vLLM push deployment
instead (``kvpush.ops.vllm_legs``): the flags are checked together first (one ``error:`` /
``hint:`` for a wrong combination, before any peer is contacted), then one leg runs on the
main thread and its report is printed (``views.reports.leg_report``) or, with ``--json``, one
JSON object; a prefill leg prints the ``kv_transfer_params`` line before it waits. Exit status
0 when the leg's push completed, 1 when it failed or lapsed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from kvpush.cli import options, stdio, translate
from kvpush.cli.signals import StopFlag
from kvpush.cli.views import reports
from kvpush.errors import ConfigError, ExitStatus

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

One leg of a vLLM push deployment, with no router: 'drive --decode D --kv-transfer-params
FILE|JSON' has a kvpush D (serve-decode --wire vllm) receive one request a vLLM P holds;
'drive --prefill P --request-id ID --blocks N' has a kvpush P (serve-prefill --wire vllm)
fill N blocks, prints the kv_transfer_params to hand a vLLM D as one JSON line, and waits
for its push. Both report outcome, bytes and the sha256 of the KV; exit status 0 when the
push completed, 1 otherwise.

With --registry URL (and --cluster NAME) instead of --prefill/--decode, the Ps and Ds are the
endpoints registered in etcd (serve-* --registry), and drive follows the registry while it runs:
an endpoint that registers gets requests from the next one on, one whose key goes gets no new
request (its requests in flight finish, or fail at once if it died). Every request is still
accounted for."""

PROGRESS_EVERY_S = 3.0


def register(app: typer.Typer) -> None:
    options.register(app, "drive", drive, options.DRIVE, DOC)


LEG_HINT = (
    "a vLLM leg is 'drive --decode D --kv-transfer-params FILE|JSON' or "
    "'drive --prefill P --request-id ID --blocks N'"
)
#: Options of a load run that mean nothing for one leg.
LOAD_ONLY = (("requests", "--requests"), ("concurrency", "--concurrency"), ("rate", "--rate"))


def _given(ctx: typer.Context, name: str) -> bool:
    src = ctx.get_parameter_source(name)
    return src is not None and src.name != "DEFAULT"


def leg_of(
    ctx: typer.Context,
    prefill: list[str],
    decode: list[str],
    kv_transfer_params: str | None,
    request_id: str | None,
) -> str | None:
    """Which vLLM leg these flags ask for ("decode", "prefill"), or None for a load run;
    a wrong combination is refused here, before any peer is contacted."""
    if kv_transfer_params is not None and request_id is not None:
        raise ConfigError("--kv-transfer-params and --request-id are two different legs", LEG_HINT)
    if kv_transfer_params is None and request_id is None:
        if _given(ctx, "alloc_delay"):
            raise ConfigError(
                "--alloc-delay needs --kv-transfer-params",
                "it delays the decode leg of one vLLM request: " + LEG_HINT,
            )
        return None
    leg, flag = (
        ("decode", "--kv-transfer-params") if request_id is None else ("prefill", "--request-id")
    )
    ours, other = (decode, prefill) if leg == "decode" else (prefill, decode)
    own_flag, other_flag = (
        ("--decode", "--prefill") if leg == "decode" else ("--prefill", "--decode")
    )
    if other:
        hint = (
            "the P is the one the kv_transfer_params name (remote_host, remote_port): drop "
            "--prefill"
            if leg == "decode"
            else "hand the kv_transfer_params it prints to the vLLM D (what a router does): "
            "drop --decode"
        )
        raise ConfigError(f"{flag} goes with {own_flag} only, not {other_flag}", hint)
    if not ours:
        what = (
            "the kvpush D (serve-decode --wire vllm) that receives the vLLM P's push"
            if leg == "decode"
            else "the kvpush P (serve-prefill --wire vllm) that fills the request"
        )
        raise ConfigError(
            f"{flag} needs {own_flag} HOST:PORT", f"pass {own_flag} HOST:PORT of {what}"
        )
    if len(ours) > 1:
        raise ConfigError(
            f"{flag} drives one request through one endpoint, got {len(ours)} {own_flag}",
            f"pass a single {own_flag}",
        )
    for name, opt in LOAD_ONLY:
        if _given(ctx, name):
            raise ConfigError(f"{opt} applies to a load run, not to one vLLM leg", f"drop {opt}")
    if leg == "prefill" and not _given(ctx, "blocks"):
        raise ConfigError(
            "--request-id needs --blocks N",
            "pass the request's prompt blocks: the vLLM D must allocate as many",
        )
    if leg == "prefill" and _given(ctx, "alloc_delay"):
        raise ConfigError(
            "--alloc-delay applies to the decode leg (--kv-transfer-params)",
            "a vLLM D decides itself when it allocates: drop --alloc-delay",
        )
    return leg


def drive(
    ctx: typer.Context,
    prefill: list[str] | None,
    decode: list[str] | None,
    requests: int,
    concurrency: int,
    rate: float | None,
    blocks: int,
    timeout: float,
    json_out: bool,
    shape: str | None,
    tokens: int | None,
    kv_transfer_params: str | None,
    request_id: str | None,
    alloc_delay: float,
    auth_token_file: str | None,
    trace: Path | None = None,
    peer_grace: float = 5.0,
    **registry: Any,
) -> None:
    prefill, decode = list(prefill or ()), list(decode or ())
    leg = leg_of(ctx, prefill, decode, kv_transfer_params, request_id)
    token = translate.auth_token(auth_token_file)
    targets: Any = None
    if registry.get("registry") and leg is None:
        from kvpush.cli.commands.fleet import registry_source
        from kvpush.ops.fleet_targets import FleetTargets

        if prefill or decode:
            raise ConfigError(
                "--registry takes the Ps and Ds from the registry: not with --prefill/--decode",
                "drop --prefill/--decode, or drop --registry",
            )
        targets = FleetTargets(registry_source(registry), lambda text: event(text))
        prefill, decode = (list(x) for x in targets.initial())
    if leg == "decode":
        _decode_leg(
            decode[0],
            str(kv_transfer_params),
            blocks if _given(ctx, "blocks") else None,
            timeout,
            alloc_delay,
            token,
            json_out,
        )
    if leg == "prefill":
        _prefill_leg(prefill[0], str(request_id), blocks, timeout, token, json_out)
    if not prefill or not decode:
        missing = "--prefill" if not prefill else "--decode"
        raise ConfigError(
            f"drive needs {missing} HOST:PORT",
            "a load run takes --prefill and --decode endpoints; " + LEG_HINT,
        )
    from kvpush.ops.driver import DriveConfig, Driver

    blocks = _shaped_blocks(ctx, shape, tokens, blocks)
    cfg = DriveConfig(
        prefill=tuple(prefill),
        decode=tuple(decode),
        requests=requests,
        concurrency=concurrency,
        rate=rate,
        blocks=blocks,
        timeout_s=timeout,
        auth_token=token,
        shape=shape or "",
        peer_grace_s=peer_grace,
    )
    if targets is not None:  # the registry's set, checked; one that left meanwhile is dropped
        cfg = targets.preflight(cfg)
    # soft_wrap: one line per event whatever the width (a file or pipe is not 80 columns).
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def event(text: str) -> None:
        err.print(f"drive: {text}")

    tty = sys.stderr.isatty() and not json_out
    driver: Any = None

    def tick() -> None:
        if not tty:
            done, ok, failed = driver.progress()
            err.print(
                reports.drive_progress_line(
                    done, ok, failed, driver.in_flight(), requests, driver.health.rows()
                )
            )

    advance: list[Any] = [lambda r: None]  # the progress bar's, once it exists
    tracer = None
    if trace is not None:
        from kvpush.ops.trace import Tracer

        tracer = Tracer(trace, token, min(timeout, 5.0))
    driver = Driver(
        cfg,
        on_result=lambda r: advance[0](r),
        on_event=event,
        on_tick=tick,
        tick_s=PROGRESS_EVERY_S,
        tracer=tracer,
    )
    if targets is not None:
        driver.notes.extend(dict.fromkeys(targets.notes))
        targets.follow(driver)
    told = len(driver.notes)  # what the run's plan already says: printed before it starts
    for note in driver.notes:
        err.print(f"drive: note: {note}")
    stop = StopFlag(on_signal=driver.cancel).install()
    try:
        if tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            with Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=err,
                transient=True,
            ) as bar:
                task = bar.add_task("requests", total=requests)
                advance[0] = lambda r: bar.advance(task)
                report = driver.run()
        else:
            report = driver.run()
    finally:
        stop.restore()
        if targets is not None:
            targets.stop()
    for note in report.notes[told:]:
        err.print(f"drive: note: {note}")
    if report.interrupted:
        err.print(
            f"drive: interrupted ({stop.signame or 'cancelled'}): intake stopped; the summary "
            "counts requests never sent and those still in flight as cancelled"
        )
    if json_out:
        stdio.out(json.dumps(report.to_dict()))
    else:
        Console().print(reports.drive_summary(report), soft_wrap=True)
    if report.interrupted:
        raise typer.Exit(int(ExitStatus.INTERRUPTED))
    raise typer.Exit(0 if report.all_verified else 1)


# ------------------------------------------------------------------------------ vLLM legs


def _finish_leg(report: Any, json_out: bool) -> None:
    if json_out:
        stdio.out(json.dumps(report.to_dict()))
    else:
        Console().print(reports.leg_report(report), soft_wrap=True)
    raise typer.Exit(0 if report.ok else 1)


def _decode_leg(
    address: str,
    params_arg: str,
    blocks: int | None,
    timeout: float,
    alloc_delay: float,
    token: bytes | None,
    json_out: bool,
) -> None:
    from kvpush.ops import vllm_legs

    params = vllm_legs.load_params(params_arg)
    report = vllm_legs.decode_leg(address, params, blocks, timeout, token, alloc_delay)
    _finish_leg(report, json_out)


def _prefill_leg(
    address: str, request_id: str, blocks: int, timeout: float, token: bytes | None, json_out: bool
) -> None:
    from kvpush.ops import vllm_legs

    err = Console(stderr=True, highlight=False)

    def hand_out(params: dict[str, Any]) -> None:
        stdio.out(json.dumps(params))  # at once: the vLLM D needs it before the push can run
        if not json_out:
            err.print(
                f"drive: hand these kv_transfer_params to the vLLM D; waiting up to {timeout:g}s "
                "for its push",
                soft_wrap=True,
            )

    report = vllm_legs.prefill_leg(address, request_id, blocks, timeout, token, on_params=hand_out)
    _finish_leg(report, json_out)


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
    if tokens < 1:
        raise ConfigError(f"--tokens must be positive, got {tokens}", "pass --tokens 1 or more")
    from kvpush.memory.shapes import get_shape

    return get_shape(shape).blocks_for(tokens)

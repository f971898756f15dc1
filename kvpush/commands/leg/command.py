"""``kvpush leg decode|prefill``: one leg of a vLLM push deployment, driven by hand.

``leg decode`` has a kvpush D (``serve-decode --wire vllm``) receive one request a vLLM P
holds, from the ``kv_transfer_params`` its ``request_finished`` returned; ``leg prefill`` has a
kvpush P (``serve-prefill --wire vllm``) fill one request for a vLLM D and prints the
``kv_transfer_params`` to hand it before it waits for the push. Options -> one call into
``kvpush.commands.leg.legs`` -> the report (``view.leg_report``) or, with ``--json``, one
JSON object. Exit status 0 when the leg's push completed, 1 when it failed or lapsed. With
``--otlp-traces-endpoint`` the leg is one client span (``kvpush.commands.leg.otlp``), a child of
``--traceparent`` when given, and the endpoint's span joins it.

The signatures are the CLI: plain typed parameters, each with its option; the options both
legs end with are ``leg_options``'s, read into one ``LegOptions`` that each leg gets as
``shared`` (``kvpush.commands.common.options.register``). ``drive``'s old spelling of the same
legs (``--kv-transfer-params``, ``--request-id``) calls ``decode_leg`` / ``prefill_leg`` here
after a deprecation note. Runs on the main thread.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from kvpush.commands.common import options, stdio, translate
from kvpush.commands.common.ending import finish
from kvpush.commands.common.optspec import PANEL_VLLM, option
from kvpush.commands.leg import otlp
from kvpush.commands.leg import view as reports
from kvpush.errors import KvpushError

if TYPE_CHECKING:
    from kvpush.commands.leg.legs import LegReport

HELP = "Drive one leg of a vLLM push deployment by hand, with no router: a kvpush D or P."

DECODE_DOC = """Have a kvpush D receive the push of one request a vLLM P holds.

The one --decode (serve-decode --wire vllm) allocates the request's blocks, registers with the
P that the kv_transfer_params name (remote_host, remote_port), waits for its push and reports
outcome, bytes and the sha256 of the KV. Exit status 0 when the push completed, 1 otherwise."""

PREFILL_DOC = """Have a kvpush P fill one request and push it into a vLLM D.

The one --prefill (serve-prefill --wire vllm) fills --blocks blocks for --request-id, prints at
once the kv_transfer_params to hand the vLLM D (one JSON line on stdout), then waits for its
push (or the lease) and reports outcome and the sha256 of the KV. Exit status 0 when the push
completed, 1 otherwise."""

Timeout = Annotated[
    float,
    option(
        "--timeout",
        help="Seconds to wait: D's wait for the push once it has blocks, or P's wait for a D "
        "to take the request.",
        scope="leg",
        seconds=True,
    ),
]
JsonOut = Annotated[
    bool,
    option(
        "--json",
        help="One JSON report on stdout (leg prefill: after the kv_transfer_params line).",
        scope="leg",
    ),
]
TIMEOUT_S = 30.0


def register(app: typer.Typer) -> None:
    subs = [
        options.Sub("decode", decode, DECODE_DOC, shared=leg_options),
        options.Sub("prefill", prefill, PREFILL_DOC, shared=leg_options),
    ]
    options.add_group(app, "leg", HELP, subs)


@dataclass(frozen=True)
class LegOptions:
    """The options both legs end with, read: the wait, the output, the token and the span."""

    timeout: float
    json_out: bool
    token: bytes | None
    span: otlp.LegSpan


def leg_options(
    timeout: Timeout = TIMEOUT_S,
    json_out: JsonOut = False,
    auth_token_file: options.AuthTokenFile = None,
    traceparent: otlp.Traceparent = None,
    otlp_traces_endpoint: otlp.Endpoint = None,
    otlp_sample_ratio: otlp.Ratio = 1.0,
) -> LegOptions:
    """Both legs' last options (each leg's signature goes on with these): the token is read
    first, then the tracing options are checked."""
    token = translate.auth_token(auth_token_file)
    span = _span(traceparent, otlp_traces_endpoint, otlp_sample_ratio)
    return LegOptions(timeout, json_out, token, span)


def decode(
    decode: Annotated[
        str,
        option(
            "--decode",
            "-d",
            help="The kvpush D (serve-decode --wire vllm) that receives the vLLM P's push.",
            scope="leg",
            metavar="HOST:PORT",
        ),
    ],
    kv_transfer_params: Annotated[
        str,
        option(
            "--kv-transfer-params",
            help="What the vLLM P's request_finished returned: a JSON object, a file holding "
            "it, or - for stdin (a whole response with a kv_transfer_params key also works).",
            panel=PANEL_VLLM,
            metavar="FILE|JSON",
        ),
    ],
    blocks: Annotated[
        int | None,
        option(
            "--blocks",
            help="The blocks D allocates: by default as many as P holds (remote_block_ids); "
            "vLLM refuses any other count.",
            scope="leg",
            show_default=False,
        ),
    ] = None,
    alloc_delay: Annotated[
        float,
        option(
            "--alloc-delay",
            help="D holds the request this long before it gets blocks, as a request queued in "
            "a vLLM D would, heartbeating P's lease meanwhile (longer than P's lease shows the "
            "heartbeats work).",
            panel=PANEL_VLLM,
            seconds=True,
        ),
    ] = 0.0,
    *,
    shared: LegOptions,
) -> None:
    timeout, token, json_out = shared.timeout, shared.token, shared.json_out
    decode_leg(
        decode, kv_transfer_params, blocks, timeout, alloc_delay, token, json_out, shared.span
    )


def prefill(
    prefill: Annotated[
        str,
        option(
            "--prefill",
            "-p",
            help="The kvpush P (serve-prefill --wire vllm) that fills the request.",
            scope="leg",
            metavar="HOST:PORT",
        ),
    ],
    request_id: Annotated[
        str,
        option(
            "--request-id",
            help="The request id the vLLM D will use.",
            panel=PANEL_VLLM,
            metavar="ID",
        ),
    ],
    blocks: Annotated[
        int,
        option(
            "--blocks",
            help="The request's prompt blocks P fills: the vLLM D must allocate as many.",
            scope="leg",
        ),
    ],
    *,
    shared: LegOptions,
) -> None:
    prefill_leg(
        prefill, request_id, blocks, shared.timeout, shared.token, shared.json_out, span=shared.span
    )


def _span(traceparent: str | None, endpoint: str | None, ratio: float) -> otlp.LegSpan:
    """The leg's span (tracing on), or the traceparent it forwards; checked first."""
    return otlp.LegSpan(otlp.traces(endpoint, ratio), otlp.parent(traceparent))


def decode_leg(
    address: str,
    params_arg: str,
    blocks: int | None,
    timeout: float,
    alloc_delay: float,
    token: bytes | None,
    json_out: bool,
    span: otlp.LegSpan | None = None,
) -> None:
    from kvpush.commands.leg import legs as vllm_legs

    params = vllm_legs.load_params(params_arg)
    with _ended(span) as ctx:
        report = ctx.report = vllm_legs.decode_leg(
            address, params, blocks, timeout, token, alloc_delay, ctx.trace
        )
    finish(report, reports.leg_report, json_out, ok=report.ok)


def prefill_leg(
    address: str,
    request_id: str,
    blocks: int,
    timeout: float,
    token: bytes | None,
    json_out: bool,
    prog: str = "leg",
    span: otlp.LegSpan | None = None,
) -> None:
    from kvpush.commands.leg import legs as vllm_legs

    err = Console(stderr=True, highlight=False)

    def hand_out(params: dict[str, object]) -> None:
        stdio.out(json.dumps(params))  # at once: the vLLM D needs it before the push can run
        if not json_out:
            err.print(
                f"{prog}: hand these kv_transfer_params to the vLLM D; waiting up to "
                f"{timeout:g}s for its push",
                soft_wrap=True,
            )

    with _ended(span) as ctx:
        report = ctx.report = vllm_legs.prefill_leg(
            address, request_id, blocks, timeout, token, on_params=hand_out, trace=ctx.trace
        )
    finish(report, reports.leg_report, json_out, ok=report.ok)


@dataclass
class _Traced:
    trace: tuple[str, str]
    report: LegReport | None = None


@contextlib.contextmanager
def _ended(span: otlp.LegSpan | None) -> Iterator[_Traced]:
    """The leg under its span: the span ends with the leg's report, or with the error that
    ended the leg (re-raised)."""
    ctx = _Traced((span.traceparent, span.tracestate) if span is not None else ("", ""))
    try:
        yield ctx
    except KvpushError as e:
        if span is not None:
            span.end(None, type(e).__name__, e.message)
        raise
    if span is not None:
        span.end(ctx.report)

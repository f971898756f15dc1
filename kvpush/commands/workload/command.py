"""``kvpush workload synth|stats``: make a synthetic request trace; say what a trace holds.

``synth``: options -> ``kvpush.commands.workload.synth.generate`` -> JSON lines (the Mooncake
format) on stdout or into ``--out FILE``, and one line on stderr saying what was written.
``stats``: a trace (a file or ``-``) -> ``kvpush.commands.workload.trace.load`` (each bad line
named on stderr, the rest read on) -> count, span, rate and length quantiles, as text or one
JSON object. Exit status 0; 1 (with ``error:`` and ``hint:``) when nothing could be read or
written. Runs on the main thread.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kvpush.commands.common import options, stdio
from kvpush.commands.common.optspec import option
from kvpush.errors import ConfigError

HELP = "Request traces in the Mooncake format (JSON lines): make a synthetic one, read one."

SYNTH_DOC = """Write a synthetic request trace shaped like Mooncake's conversation trace.

One JSON object per line -- timestamp (ms), input_length, output_length (tokens), hash_ids
(one per 512-token block) -- as AIPerf, SGLang's bench_serving and 'kvpush drive --workload'
read it. Arrivals: gamma-distributed gaps of mean 1/--rate (--burstiness 1: Poisson; below 1:
burstier; above 1: more even). Prompt lengths fit the published conversation trace (p50 6,909,
p90 27,367, p99 85,399, max 126,195 tokens); output lengths have its median (350). The same
--seed gives the same trace. The trace ends at --duration seconds, or after --requests."""

STATS_DOC = """Say what a request trace holds: requests, span, rate, prompt and output quantiles.

Reads a Mooncake-format trace (a file, or - for stdin); a bad line is named on stderr (its
number and what is wrong) and the rest is read on."""


def register(app: typer.Typer) -> None:
    subs = [options.Sub("synth", synth, SYNTH_DOC), options.Sub("stats", trace_stats, STATS_DOC)]
    options.add_group(app, "workload", HELP, subs)


def synth(
    seed: Annotated[int, option("--seed", help="Random seed: the same seed, the same trace.")] = 0,
    duration: Annotated[
        float,
        option(
            "--duration",
            help="Seconds of trace (the last timestamp is at most this).",
            scope="workload",
            seconds=True,
        ),
    ] = 60.0,
    rate: Annotated[
        float,
        option(
            "--rate",
            help="Mean requests per second (Mooncake's conversation trace: 3.4).",
            scope="workload",
        ),
    ] = 3.4,
    burstiness: Annotated[
        float,
        option(
            "--burstiness",
            help="Shape of the gamma-distributed gaps: 1 is a Poisson process, below 1 "
            "burstier, above 1 more even.",
        ),
    ] = 1.0,
    requests: Annotated[
        int | None,
        option(
            "--requests",
            "-n",
            help="At most this many requests (the trace also ends at --duration).",
            scope="workload",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        str,
        option(
            "--out",
            "-o",
            help="Where the trace goes: a file, or - for stdout.",
            scope="workload",
            metavar="FILE|-",
        ),
    ] = "-",
) -> None:
    from kvpush.commands.workload.synth import SynthSpec, generate, stats

    reqs = generate(SynthSpec(seed, duration, rate, burstiness, requests))
    text = "".join(r.to_json() + "\n" for r in reqs)
    if out == "-":
        stdio.out(text, end="")
    else:
        try:
            with open(out, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise ConfigError(
                f"cannot write the trace to {out!r}: {e.strerror or e}",
                "give --out a path in a directory that exists and is writable, or - for stdout",
            ) from None
    st = stats(reqs)
    where = "stdout" if out == "-" else out
    stdio.err(f"workload synth: {st.requests} requests over {st.span_s:.1f} s ({st.rate:.2f}/s), "
              f"input tokens {_q(st.input_tokens)} -> {where}")  # fmt: skip


def _q(q: dict[str, float]) -> str:
    return " · ".join(f"{k} {v:,.0f}" for k, v in q.items())


def trace_stats(
    source: Annotated[
        str, typer.Argument(help="The trace: a file, or - for stdin.", metavar="FILE|-")
    ],
    json_out: Annotated[
        bool, option("--json", help="One JSON object on stdout.", scope="workload")
    ] = False,
) -> None:
    from kvpush.commands.workload.synth import stats
    from kvpush.commands.workload.trace import load

    wl = load(source, on_problem=lambda p: stdio.err(f"workload stats: {p}"))
    st = stats(wl.requests)
    if json_out:
        stdio.out(json.dumps({**st.to_dict(), "bad_lines": len(wl.problems)}))
        return
    stdio.out(f"requests       {st.requests} ({len(wl.problems)} bad lines skipped)")
    stdio.out(f"span           {st.span_s:.1f} s · {st.rate:.2f} requests/s")
    stdio.out(f"input tokens   {_q(st.input_tokens)}")
    stdio.out(f"output tokens  {_q(st.output_tokens)}")

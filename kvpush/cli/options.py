"""Every option and argument of the ``kvpush`` CLI, indexed once, and the commands built from them.

Owns ``OPTIONS`` (key -> ``Opt``: the endpoint options of ``kvpush.cli.serve_options`` and,
declared here, those of the root, ``probe``, ``drive``, ``demo``, ``bench`` and
``completion``), each command's list of entries, and ``signature`` / ``register``, which give a
command function an ``inspect.Signature`` made of table entries. typer reads that signature like
a hand-written one, so ``serve-prefill`` and ``serve-decode`` are built from the same
declarations and cannot drift apart. What one option is (``Opt``, its ``KVPUSH_<OPTION>``
variable) lives in ``kvpush.cli.optspec``; the commands import only this module, which passes
those names on.

Imports typer and the configuration only (no torch, nixl or zmq: typer re-runs the program on
every Tab press). Runs on the main thread at import time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import typer

from kvpush.cli import complete
from kvpush.cli.flags import Command
from kvpush.cli.fleet_options import FLEET_OPTS, REGISTRY
from kvpush.cli.optspec import (
    REQUIRED,
    Entry,
    LogLevel,
    Opt,
    OutputMode,
    Shell,
    envvar,
    param_name,
)
from kvpush.cli.serve_options import ENDPOINT_OPTS, serve_entries
from kvpush.config import HandshakeMode

#: The commands import this one module: it passes on the names of ``optspec`` they use.
__all__ = [
    "BENCH",
    "COMPLETION",
    "DEMO",
    "DRIVE",
    "GEOMETRY",
    "OPTIONS",
    "PROBE",
    "ROOT",
    "SECONDS",
    "Entry",
    "LogLevel",
    "Opt",
    "OutputMode",
    "Shell",
    "envvar",
    "help_text",
    "options_of",
    "param_name",
    "register",
    "serve_entries",
    "signature",
]

_OPTS: list[Opt] = [
    # --------------------------------------------------------------------- root
    Opt("version", ("--version",), bool, "Print the version and exit.", False, env=False,
        kw={"is_eager": True}),
    Opt("debug", ("--debug",), bool, "Show a traceback with errors.", False),
    # --------------------------------------------------------------------- serve-*, probe
    *ENDPOINT_OPTS,
    # --------------------------------------------------------------------- probe
    Opt("address", ("address",), str, "The peer's side channel, HOST:PORT.", REQUIRED,
        argument=True),
    Opt("count", ("--count", "-c"), int, "Round trips to measure (RTT, clock offset).", 5),
    Opt("timeout", ("--timeout",), float, "Seconds to wait per request.", 3.0,
        seconds=True, key="probe.timeout", env_scope="probe"),
    Opt("handshake", ("--handshake",), HandshakeMode | None,
        "Also do a real NIXL handshake of this mode from a tiny local endpoint and time its "
        "phases.", None, show_default=False, key="probe.handshake", env_scope="probe"),
    Opt("ping", ("--ping",), int, "Measure this many NIXL notification round trips.", 0),
    Opt("stats", ("--stats",), bool, "Show the peer's live telemetry.", False),
    Opt("json_out", ("--json",), bool, "One JSON object on stdout.", False, key="probe.json",
        env_scope="probe"),
    Opt("ranks", ("--ranks",), str,
        "The peer's (pp, tp) rank to ask for, as PP,TP (vLLM serves one per rank).", "0,0"),
    Opt("peer_tp", ("--peer-tp",), int | None,
        "The vLLM peer's TP size (tp_size of its kv_transfer_params): needed to ask it for a "
        "rank other than 0,0, since vLLM's listener dies on a rank it does not serve.", None,
        show_default=False),
    # --------------------------------------------------------------------- drive, demo
    Opt("prefill", ("--prefill", "-p"), list[str], "A prefill endpoint HOST:PORT (repeatable).",
        None, metavar="HOST:PORT", show_default=False),
    Opt("decode", ("--decode", "-d"), list[str], "A decode endpoint HOST:PORT (repeatable).",
        None, metavar="HOST:PORT", show_default=False),
    Opt("requests", ("--requests", "-n"), int, "Requests to send.", 100),
    Opt("concurrency", ("--concurrency", "-c"), int, "Requests in flight at once.", 8),
    Opt("rate", ("--rate",), float | None, "Start at most this many requests per second.", None,
        show_default=False),
    Opt("blocks", ("--blocks",), int, "Blocks per request.", 4),
    Opt("blocks", ("--blocks",), int, "Blocks per request.", 4, key="drive.blocks"),
    Opt("timeout", ("--timeout",), float, "Seconds a request may take before it fails.", 30.0,
        seconds=True, key="drive.timeout", env_scope="drive"),
    # The old spelling of 'kvpush leg decode|prefill' (deprecated): hidden, no variable.
    Opt("kv_transfer_params", ("--kv-transfer-params",), str | None,
        "Deprecated: 'kvpush leg decode'.", None, metavar="FILE|JSON", env=False,
        kw={"hidden": True}),
    Opt("request_id", ("--request-id",), str | None, "Deprecated: 'kvpush leg prefill'.", None,
        metavar="ID", env=False, kw={"hidden": True}),
    Opt("trace", ("--trace",), Path | None,
        "Write one JSON line per request to FILE: transfer id, outcome, reason, and the "
        "seconds from sending it to each phase (D allocated, PUSH_REG sent, P matched, "
        "handshake done, WRITE posted and done, completion received, verified, answered), "
        "both legs on drive's clock; a failed request's 'ended_at'. The summary adds p50/p99 "
        "per phase.", None, metavar="FILE", kw={"dir_okay": False}),
    Opt("alloc_delay", ("--alloc-delay",), float, "Deprecated: 'kvpush leg decode'.", 0.0,
        seconds=True, env=False, kw={"hidden": True}),
    Opt("json_out", ("--json",), bool, "One JSON summary on stdout.", False, key="drive.json",
        env_scope="drive"),
    Opt("shape", ("--shape",), str | None,
        "A real model's KV geometry: llama-8b, llama-70b-tp8 (one rank of TP 8) or mla. drive "
        "checks that the endpoints have it (and sizes --tokens in its blocks); demo starts its "
        "endpoints with it.", None, show_default=False, kw={"autocompletion": complete.shapes}),
    Opt("peer_grace", ("--peer-grace",), float,
        "While no P (or no D) is up, hold requests this long for one to come back (a restart "
        "is a dip, not the end of the run); past it what is left fails as unreachable.", 5.0,
        seconds=True),
    Opt("tokens", ("--tokens",), int | None,
        "Tokens per request (with --shape): --blocks becomes ceil(tokens / the shape's block "
        "tokens).", None, show_default=False),
    Opt("requests", ("--requests", "-n"), int, "Requests to drive.", 300, key="demo.requests"),
    Opt("decoders", ("--decoders",), int, "Decode endpoints at start.", 2),
    Opt("tp_shape", ("--tp",), str,
        "Tensor-parallel ranks of P and of each D: N for both, or P,D (e.g. 4,2 or 1,4; the "
        "demo model has 4 KV heads, so 1, 2 or 4).", "1", key="demo.tp", metavar="N|P,D",
        env_scope="demo"),
    Opt("live", ("--live/--no-live",), bool | None,
        "Show P's live telemetry while driving (default: when stderr is a terminal).", None,
        show_default=False),
    Opt("json_out", ("--json",), bool, "One JSON report on stdout.", False, key="demo.json",
        env_scope="demo"),
    Opt("keep_logs", ("--keep-logs",), bool,
        "Keep the endpoints' logs (kept anyway on failure).", False),
    # --------------------------------------------------------------------- bench, completion
    Opt("scenario", ("scenario",), str,
        "hol (head-of-line behind a slow new peer, deferred vs blocking writer), handshake "
        "(notif-only vs full; agent metadata over the side channel vs etcd), bandwidth (push "
        "GB/s vs raw NIXL, process_vm_writev, memcpy), "
        "rate (small pushes/s vs raw NIXL), scale (many new peers at once), tp (N ranks vs N "
        "x one rank), model (real model shapes, block ids contiguous, shuffled and after "
        "churn, vs raw NIXL), fleet (8 P x 16 D registered in etcd: fleet ls/watch/check, registry "
        "load, p99 with registration on vs off), or all; device (--device cuda: pushes between "
        "VRAM pools vs raw NIXL and a torch copy; not part of all).", REQUIRED,
        argument=True, show_default=False, kw={"autocompletion": complete.scenarios}),
    Opt("quick", ("--quick",), bool, "Short smoke version (what CI runs); figures are rough.",
        False),
    Opt("json_out", ("--json",), bool,
        "Print each scenario's full result as one JSON line instead of tables.", False,
        key="bench.json", env_scope="bench"),
    Opt("out_dir", ("--out-dir",), Path | None,
        "Where results (<scenario>.json), charts (.svg) and worker logs go. "
        "[default: ./bench-out]", None, kw={"file_okay": False}),
    Opt("shell", ("shell",), Shell, "The shell to print a completion script for.", REQUIRED,
        argument=True),
    # --------------------------------------------------------------------- fleet
    *FLEET_OPTS,
]  # fmt: skip

#: key -> option. The key is the parameter name, or ``command.param`` where two commands give
#: the same flag different meanings (probe's --timeout is per request, drive's per transfer).
OPTIONS: dict[str, Opt] = {o.key: o for o in _OPTS}
assert len(OPTIONS) == len(_OPTS), "two options share a key"

#: Variables that two option entries declare (drive's and demo's --blocks and --requests:
#: per-command help, the same meaning). Any other variable two entries would share is a
#: clash; an entry in several commands' tables (--concurrency, --shape, the geometry) means the
#: same to each by construction.
SHARED_ENV: frozenset[str] = frozenset({"KVPUSH_BLOCKS", "KVPUSH_REQUESTS"})


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


def help_text(doc: str) -> str:
    """A command's help: ``doc`` with each paragraph joined into one line."""
    paras = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paras)


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
    command.__doc__ = help_text(doc)
    if name is None:
        app.callback()(command)
    else:
        app.command(name, cls=Command)(command)


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
    "auth_token_file", "trace", "peer_grace", *REGISTRY,
]  # fmt: skip
DEMO: list[Entry] = [
    "demo.requests", "blocks", "decoders", "demo.tp", "shape", "concurrency", "live",
    "demo.json", "keep_logs",
]  # fmt: skip
BENCH: list[Entry] = ["scenario", "quick", "bench.json", "out_dir", ("device", "cpu")]
COMPLETION: list[Entry] = ["shell"]
ROOT: list[Entry] = ["version", "debug"]

#: Parameters whose value is a duration (the man page names them SECONDS).
SECONDS = frozenset(o.name for o in _OPTS if o.seconds)

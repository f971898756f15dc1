"""The options several commands share, and how a command is built from its function.

A command's options are its function's signature: plain typed parameters, each annotated with
its ``typer.Option`` (``optspec.option``), as typer reads them. What several commands share is
declared once here: the endpoint table (``OPTIONS``: key -> ``Opt``, the declarations of
``kvpush.commands.common.endpoint_options``, defaults read from the configuration), the entries
other commands take from it (``PROBE``: probe's local geometry, NIXL and security options;
``REGISTRY``: the etcd options of drive and fleet), and the aliases of options that two signatures
share (``AuthTokenFile``, ``Shape``, ``Concurrency``, ``Blocks``). ``register`` adds a command whose
function takes some table entries as ``**kwargs``: its signature is the function's own
parameters, then those entries -- so ``serve-prefill`` and ``serve-decode``, built wholly from
the table, cannot drift apart, and probe, drive and fleet take the endpoints' flags and
``KVPUSH_*`` variables. Options that the commands of one group all end with (``leg``'s wait,
output, token and tracing) are declared once as the signature of a function that reads them
(``register``'s ``shared``). ``add_group`` adds a group (``kvpush fleet|leg|workload ...``) and
its commands (``Sub``).

Imports typer and the configuration only (no torch, nixl or zmq: typer re-runs the program on
every Tab press). Runs on the main thread at import time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, NamedTuple

import typer

from kvpush.commands.common import complete
from kvpush.commands.common.endpoint_options import ENDPOINT_OPTS, serve_entries
from kvpush.commands.common.flags import Command, Group
from kvpush.commands.common.optspec import (
    Entry,
    LogLevel,
    Opt,
    OutputMode,
    Shell,
    TyperKw,
    envvar,
    option,
    param_name,
)

#: The commands import this module: it passes on the names of ``optspec`` they use.
__all__ = [
    "GEOMETRY",
    "OPTIONS",
    "PROBE",
    "REGISTRY",
    "SHARED",
    "SHARED_ENV",
    "AuthTokenFile",
    "Blocks",
    "Concurrency",
    "Entry",
    "LogLevel",
    "Opt",
    "OutputMode",
    "Shape",
    "Shell",
    "Sub",
    "add_group",
    "envvar",
    "help_text",
    "option",
    "param_name",
    "register",
    "serve_entries",
    "signature",
]

#: key -> option of the endpoint table (serve-*; probe, drive and fleet take some of them).
OPTIONS: dict[str, Opt] = {o.name: o for o in ENDPOINT_OPTS}
assert len(OPTIONS) == len(ENDPOINT_OPTS), "two endpoint options share a name"

#: The geometry options probe compares with the peer when given.
GEOMETRY = ("layers", "block_bytes", "block_tokens", "kv_heads", "head_dim", "dtype", "kv_layout")
#: probe's entries of the table: a tiny local endpoint's geometry, NIXL and security.
PROBE: list[Entry] = [
    "config", "auth_token_file", "device", *GEOMETRY, "kv_regions", "backends",
    "progress_thread",
]  # fmt: skip
#: The registry options every fleet-aware command takes (declared with serve-*'s).
REGISTRY: list[Entry] = [
    "registry", "cluster", "registry_user", "registry_password_file", "registry_ca",
    "registry_cert", "registry_key",
]  # fmt: skip

AuthTokenFile = Annotated[str | None, OPTIONS["auth_token_file"].info()]
Shape = Annotated[
    str | None,
    option(
        "--shape",
        help="A real model's KV geometry: llama-8b, llama-70b-tp8 (one rank of TP 8) or mla. "
        "drive checks that the endpoints have it (and sizes --tokens in its blocks); demo "
        "starts its endpoints with it.",
        show_default=False,
        autocompletion=complete.shapes,
    ),
]
Concurrency = Annotated[int, option("--concurrency", "-c", help="Requests in flight at once.")]
Blocks = Annotated[int, option("--blocks", help="Blocks per request.")]

#: Variables that two declarations share (drive's and demo's --requests; leg decode's and leg
#: prefill's --blocks, the request's blocks: per-command help, the same meaning). Every other
#: variable that two options with different help would share is a clash
#: (``tests/integration/test_cli_operator.py`` walks every command).
SHARED_ENV: frozenset[str] = frozenset({"KVPUSH_REQUESTS", "KVPUSH_LEG_BLOCKS"})

#: The keyword that gets the value of a group's shared options (``register``'s ``shared``).
SHARED = "shared"


def help_text(doc: str) -> str:
    """A command's help: ``doc`` with each paragraph joined into one line."""
    paras = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paras)


def signature(
    fn: Callable[..., object],
    entries: Sequence[Entry],
    extra: Mapping[str, TyperKw] | None = None,
    shared: Callable[..., object] | None = None,
) -> inspect.Signature:
    """``fn``'s own parameters (its ``**kwargs`` left out, and its ``shared`` when ``shared`` is
    given), then ``shared``'s parameters, then the table ``entries`` (``key`` or
    ``(key, default)``), in order; ``extra`` adds typer keywords to some entries."""
    own = [
        p
        for p in inspect.signature(fn, eval_str=True).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD and not (shared and p.name == SHARED)
    ]
    if shared is not None:
        own += inspect.signature(shared, eval_str=True).parameters.values()
    params = [p if p.name == "ctx" else p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
    for e in entries:
        key, default = (e, None) if isinstance(e, str) else e
        params.append(OPTIONS[key].parameter(default, (extra or {}).get(key)))
    return inspect.Signature(params)


def register(
    app: typer.Typer,
    name: str,
    fn: Callable[..., object],
    doc: str,
    entries: Sequence[Entry] = (),
    *,
    extra: Mapping[str, TyperKw] | None = None,
    shared: Callable[..., object] | None = None,
) -> None:
    """Add ``fn`` as command ``name`` of ``app``, with ``doc`` as its help; ``entries`` of the
    endpoint table reach ``fn`` as keyword arguments (its ``**kwargs``). ``shared``: options
    several commands of a group end with, declared once as the signature of a function that
    reads them into one value; ``fn`` gets that value as its keyword ``shared``."""
    if not entries and shared is None:
        app.command(name, cls=Command, help=help_text(doc))(fn)
        return
    tail = [] if shared is None else list(inspect.signature(shared).parameters)

    def command(**params: object) -> object:
        if shared is not None:
            params[SHARED] = shared(**{k: params.pop(k) for k in tail})
        return fn(**params)

    command.__signature__ = signature(fn, entries, extra, shared)  # type: ignore[attr-defined]
    command.__name__ = name.replace("-", "_")
    app.command(name, cls=Command, help=help_text(doc))(command)


class Sub(NamedTuple):
    """One command of a group (``register``'s arguments)."""

    name: str
    fn: Callable[..., object]
    doc: str
    entries: Sequence[Entry] = ()
    shared: Callable[..., object] | None = None


def add_group(app: typer.Typer, name: str, help: str, subs: Sequence[Sub]) -> None:
    """Add the group ``kvpush NAME ...`` (``fleet``, ``leg``, ``workload``) to ``app``, with
    ``subs`` as its commands."""
    group = typer.Typer(
        name=name,
        cls=Group,
        help=help,
        no_args_is_help=True,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    for sub in subs:
        register(group, sub.name, sub.fn, sub.doc, sub.entries, shared=sub.shared)
    app.add_typer(group)

"""How an option of the ``kvpush`` CLI is declared, and the names every command shares.

Owns ``option`` (the ``typer.Option`` of a plain typed parameter, with its ``KVPUSH_<OPTION>``
variable), ``Opt`` (one option of the endpoint table, ``kvpush.commands.common.endpoint_options``,
with its default, and how it becomes an annotated ``inspect.Parameter``), the variable names derived
from long flags (``envvar``, ``param_name``; ``KVPUSH_<COMMAND>_<OPTION>`` for a flag that
means different things to different commands), the help panels, and the enums of option values
that are the CLI's own (``OutputMode``, ``LogLevel``, ``Shell``).

Imports typer only (no torch, nixl or zmq: typer re-runs the program on every Tab press). Runs
on the main thread at import time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, TypedDict, Unpack

import typer

ENV_PREFIX = "KVPUSH_"

PANEL_NET = "Side channel"
PANEL_GEOM = "KV geometry"
PANEL_NIXL = "NIXL"
PANEL_TIME = "Timeouts (seconds)"
PANEL_OUT = "Output"
PANEL_SEC = "Security"
PANEL_VLLM = "vLLM wire"
PANEL_REGISTRY = "Registry (etcd)"


class OutputMode(str, Enum):
    LIVE = "live"
    PLAIN = "plain"
    JSON = "json"


class LogLevel(str, Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class NixlMetadata(str, Enum):
    """Where peers load a NIXL agent's metadata from."""

    SIDECHANNEL = "sidechannel"
    ETCD = "etcd"


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


class TyperKw(TypedDict, total=False):
    """The ``typer.Option`` keywords the commands' options use beyond ``option``'s own."""

    show_default: bool | str
    metavar: str | None
    hidden: bool
    is_eager: bool
    callback: Callable[..., object] | None
    autocompletion: Callable[..., object] | None
    dir_okay: bool
    file_okay: bool


def param_name(flag: str) -> str:
    """``--side-channel-timeout`` -> ``side_channel_timeout``."""
    return flag.lstrip("-").split("/")[0].replace("-", "_")


def envvar(long_opt: str, scope: str = "") -> str:
    """``--num-blocks`` -> ``KVPUSH_NUM_BLOCKS``; with a command ``scope`` (a flag that means
    something else to another command): ``--timeout``, ``probe`` -> ``KVPUSH_PROBE_TIMEOUT``."""
    scoped = f"{scope}_" if scope else ""
    return ENV_PREFIX + (scoped + param_name(long_opt)).upper()


def option(
    *decls: str,
    help: str,
    scope: str = "",
    panel: str | None = None,
    seconds: bool = False,
    env: bool = True,
    **kw: Unpack[TyperKw],
) -> object:
    """The ``typer.Option`` of a plain typed parameter (``Annotated[int, option(...)] = 5``):
    its ``KVPUSH_<OPTION>`` variable (``KVPUSH_<SCOPE>_<OPTION>`` with a command ``scope``, for
    a flag that means something else to another command) is named in its help; a duration
    (``seconds``) reads SECONDS."""
    long = next((d for d in decls if d.startswith("--")), decls[0])
    if seconds:
        kw.setdefault("metavar", "SECONDS")
    var = envvar(long, scope) if env else None
    return typer.Option(
        *decls, help=help, envvar=var, show_envvar=var is not None, rich_help_panel=panel, **kw
    )


@dataclass(frozen=True)
class Opt:
    """One option of the endpoint table (``kvpush.commands.common.endpoint_options``): what
    ``option`` takes, with its default, so that two commands built from the table declare it
    once."""

    name: str  # the parameter name the command receives
    decls: tuple[str, ...]
    type: object  # the parameter's annotation: a type, or a union of types
    help: str
    default: object = None
    panel: str | None = None
    metavar: str | None = None
    show_default: bool | str = True
    seconds: bool = False  # its value is a duration: it reads SECONDS, not <float>
    kw: TyperKw = field(default_factory=lambda: TyperKw())

    def info(self, extra: TyperKw | None = None) -> object:
        """The ``typer.Option`` (``extra``: more typer keywords, a command's own callback)."""
        kw: TyperKw = {**self.kw, **(extra or {}), "show_default": self.show_default}
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        return option(*self.decls, help=self.help, panel=self.panel, seconds=self.seconds, **kw)

    def parameter(self, default: object = None, extra: TyperKw | None = None) -> inspect.Parameter:
        """The keyword parameter typer reads, ``default`` overriding the table's."""
        return inspect.Parameter(
            self.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=self.default if default is None else default,
            annotation=Annotated[self.type, self.info(extra)],
        )


#: A command's table entry: an option key, or ``(key, default)`` to override its default.
Entry = str | tuple[str, object]

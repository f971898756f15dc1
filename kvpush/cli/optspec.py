"""What one option of the ``kvpush`` CLI is, and the names every option table shares.

Owns ``Opt`` (flags, type, default, help, help panel of one option or positional argument, and
how it becomes an annotated ``inspect.Parameter`` typer reads), the ``KVPUSH_<OPTION>`` variable
names derived from long flags (``envvar``, ``param_name``; ``KVPUSH_<COMMAND>_<OPTION>`` for a
flag that means different things to different commands), the help panels, and the enums of
option values that are the CLI's own (``OutputMode``, ``LogLevel``, ``Shell``). The tables of
options are ``kvpush.cli.serve_options`` (the endpoint commands) and ``kvpush.cli.options``
(the others, and the one ``OPTIONS`` index the commands are built from).

Imports typer only (no torch, nixl or zmq: typer re-runs the program on every Tab press). Runs
on the main thread at import time.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any

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


def param_name(flag: str) -> str:
    """``--side-channel-timeout`` -> ``side_channel_timeout``."""
    return flag.lstrip("-").split("/")[0].replace("-", "_")


def envvar(long_opt: str, scope: str = "") -> str:
    """``--num-blocks`` -> ``KVPUSH_NUM_BLOCKS``; with a command ``scope`` (a flag that means
    something else to another command): ``--timeout``, ``probe`` -> ``KVPUSH_PROBE_TIMEOUT``."""
    scoped = f"{scope}_" if scope else ""
    return ENV_PREFIX + (scoped + param_name(long_opt)).upper()


REQUIRED: Any = ...


def option(*decls: str, help: str, scope: str = "", panel: str | None = None, **kw: Any) -> Any:
    """A ``typer.Option`` for a plain typed parameter (``Annotated[int, option(...)] = 5``),
    with the ``KVPUSH_<OPTION>`` variable of its long flag (``KVPUSH_<SCOPE>_<OPTION>`` with a
    command ``scope``) named in its help."""
    long = next((d for d in decls if d.startswith("--")), decls[0])
    return typer.Option(
        *decls,
        help=help,
        envvar=envvar(long, scope),
        show_envvar=True,
        rich_help_panel=panel,
        **kw,
    )


@dataclass(frozen=True)
class Opt:
    """One option (or, with ``argument=True``, one positional argument) of the CLI."""

    name: str  # the parameter name the command receives
    decls: tuple[str, ...]
    type: Any
    help: str
    default: Any = None
    panel: str | None = None
    metavar: str | None = None
    show_default: bool | str = True
    seconds: bool = False  # its value is a duration (the man page says SECONDS)
    env: bool = True
    argument: bool = False
    kw: Mapping[str, Any] = field(default_factory=dict)
    key: str = ""  # the table key when two commands give one flag two meanings
    # The command whose name the variable carries when two commands give one flag two
    # meanings (``KVPUSH_PROBE_TIMEOUT`` and ``KVPUSH_DRIVE_TIMEOUT``): one variable set for
    # one command never changes another. Empty: ``KVPUSH_<OPTION>``, shared by every command
    # that has the option, because it means the same to each.
    env_scope: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.name)

    @property
    def long(self) -> str:
        return next((d for d in self.decls if d.startswith("--")), self.decls[0])

    @property
    def envvar(self) -> str | None:
        return envvar(self.long, self.env_scope) if self.env and not self.argument else None

    def info(self, extra: Mapping[str, Any] | None = None) -> Any:
        kw = {**self.kw, **(extra or {})}
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        if self.argument:
            return typer.Argument(help=self.help, show_default=self.show_default, **kw)
        return typer.Option(
            *self.decls,
            help=self.help,
            envvar=self.envvar,
            show_envvar=self.envvar is not None,
            rich_help_panel=self.panel,
            show_default=self.show_default,
            **kw,
        )

    def parameter(
        self, default: Any = None, extra: Mapping[str, Any] | None = None
    ) -> inspect.Parameter:
        value = self.default if default is None else default
        return inspect.Parameter(
            self.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if value is REQUIRED else value,
            annotation=Annotated[self.type, self.info(extra)],
        )


#: A command's table entry: an option key, or ``(key, default)`` to override its default.
Entry = str | tuple[str, Any]

"""``--config FILE.toml``: load a settings file into the command's defaults.

Owns the TOML loading (``tomllib``; a file that is not UTF-8 or not TOML is a usage error that
names the file), the flattening of a file into one command's option values (top-level keys
for every command that reads ``--config``, ``[prefill]`` / ``[decode]`` for one role), and the
eager ``--config`` callback that puts those values into click's ``ctx.default_map``. That gives
the precedence command line > ``KVPUSH_<OPTION>`` > file > built-in default, and lets a value
of the wrong type be reported with the file's name (``ctx.meta[CONFIG_PATH]``).

A key no command knows is an error in any table, and a key in ``[prefill]`` / ``[decode]``
must be an option of that role's command: a file shared by P and D is checked whole by either.
Runs on the main thread while click parses the command line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import typer

from kvpush.config import Role
from kvpush.errors import ConfigError

#: ``ctx.meta`` key of the loaded file's path (for messages about values it set).
CONFIG_PATH = "kvpush.config_path"

#: Keys naming files that do not end in ``_file``: relative to the config file like those.
PATH_KEYS = frozenset({"registry_ca", "registry_cert", "registry_key"})

#: Tables (named by role) and the command each applies to.
SECTIONS: dict[str, str] = {Role.PREFILL: "serve-prefill", Role.DECODE: "serve-decode"}


def toml_load(path: str) -> dict[str, object]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError(
                "reading --config needs Python 3.11+ (tomllib) or the tomli package",
                "pip install tomli, or pass the settings as options",
            ) from None
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(
            f"cannot read config file {path}: {e.strerror}", "check the path and its permissions"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.start}: {raw[e.start]:#04x})",
            "TOML files are UTF-8: save it as UTF-8 (iconv -t UTF-8)",
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            f"config file {path} is not valid TOML: {e}", "see https://toml.io for the syntax"
        ) from None


def command_keys(ctx: typer.Context) -> dict[str, set[str]]:
    """Option names of every command that reads ``--config``, by command name."""
    root = ctx.find_root().command
    out: dict[str, set[str]] = {}
    for name, cmd in getattr(root, "commands", {}).items():
        names = {p.name for p in cmd.params if p.name}
        if "config" in names:
            out[name] = names
    return out


def config_values(
    data: Mapping[str, object],
    path: str,
    command: str,
    own: set[str],
    known: set[str],
    section_keys: Mapping[str, set[str]] | None = None,
) -> dict[str, object]:
    """Flatten a parsed file into ``{param_name: value}`` for ``command``.

    Top-level keys apply to every command that has the option (``own``: this command's);
    ``[prefill]`` / ``[decode]`` apply to one role's command. Keys are option names with
    underscores (dashes too). A key in no command (``known``) is an error wherever it is;
    given ``section_keys`` (table -> that command's options), so is a key of the wrong role.
    """
    base = Path(path).resolve().parent
    items: list[tuple[str, object]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            _check_section(key, value, path, known, section_keys)
            if SECTIONS[key] == command:
                items.extend(value.items())
            continue
        items.append((key, value))
    out: dict[str, object] = {}
    for raw_key, value in items:
        key = raw_key.replace("-", "_")
        _check_key(key, raw_key, path, known)
        if key in own:
            out[key] = _value(key, value, base)
    return out


def _check_section(
    table: str,
    keys: Mapping[str, object],
    path: str,
    known: set[str],
    section_keys: Mapping[str, set[str]] | None,
) -> None:
    """A ``[prefill]`` or ``[decode]`` table: every key an option (of that role's command)."""
    if table not in SECTIONS:
        raise ConfigError(
            f"unknown table [{table}] in config file {path}",
            "use top-level keys, or the tables [prefill] and [decode]",
        )
    for raw_key in keys:
        k = raw_key.replace("-", "_")
        _check_key(k, raw_key, path, known)
        if section_keys is not None and k not in section_keys.get(table, known):
            raise ConfigError(
                f"key {raw_key!r} in table [{table}] of config file {path} is not an "
                f"option of {SECTIONS[table]}",
                "move it to the table of the role it applies to, or to the top level",
            )


def _value(key: str, value: object, base: Path) -> object:
    """A list as comma-separated text; a relative path relative to the file."""
    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    is_path = key.endswith("_file") or key in PATH_KEYS
    if is_path and isinstance(value, str) and not os.path.isabs(value):
        value = str(base / value)
    return value


def _check_key(key: str, raw_key: str, path: str, known: set[str]) -> None:
    if key == "config":
        raise ConfigError(f"config file {path} sets 'config'", "config files do not nest")
    if key not in known:
        raise ConfigError(
            f"unknown key {raw_key!r} in config file {path}",
            "keys are option names with underscores, e.g. num_blocks = 1024",
        )


def config_callback(ctx: typer.Context, param: object, value: str | None) -> str | None:
    """Eager callback of ``--config``: load the file into ``ctx.default_map``."""
    if not value or ctx.resilient_parsing:
        return value
    data = toml_load(value)
    keys = command_keys(ctx)
    own = {p.name for p in ctx.command.params if p.name}
    known = set().union(own, *keys.values())
    sections = {t: keys.get(cmd, set()) for t, cmd in SECTIONS.items()}
    values = config_values(data, value, ctx.info_name or "", own, known, sections)
    ctx.default_map = {**(ctx.default_map or {}), **values}
    ctx.meta[CONFIG_PATH] = value
    return value

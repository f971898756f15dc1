"""Generate ``completions/``, ``man/kvpush.1`` and ``docs/cli.md`` from the one CLI definition.

``python -m kvpush.cli.gendocs`` rewrites the committed files; ``--check`` exits 1 when any of
them differs from what the app generates now (``tests/component/test_cli_docs.py`` checks it).
typer >= 0.26 ships its own copy of click, so click-man does not work on it: this walks the
click command tree that typer builds and writes roff itself. Output is deterministic (no dates,
no terminal widths) so that the drift check is exact. Runs on the main thread.
"""

from __future__ import annotations

import argparse
import sys
from enum import Enum
from pathlib import Path

from typer import _click as click  # typer >= 0.26 ships its own copy of click
from typer.core import TyperGroup, TyperOption

from kvpush import PROTOCOL_VERSION, __version__
from kvpush.cli.completion import PROG, completion_script

ROOT = Path(__file__).resolve().parents[2]


# -------------------------------------------------------------------------------- man page


def _esc(text: str) -> str:
    """Escape text for roff: backslashes, and a leading dot or quote on any line."""
    text = text.replace("\\", "\\e")
    out = []
    for line in text.split("\n"):
        if line.startswith((".", "'")):
            line = "\\&" + line
        out.append(line)
    return "\n".join(out)


def _opt(name: str) -> str:
    return "\\fB" + _esc(name).replace("-", "\\-") + "\\fR"


def _metavar(param: click.Parameter) -> str:
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    if getattr(param, "metavar", None):
        return str(param.metavar)
    desc = getattr(param, "type_descriptor", None)  # typer >= 0.26
    ann = getattr(desc, "annotation", None)
    args = getattr(ann, "__args__", None)
    if args:  # list[X]
        ann = args[0]
    if isinstance(ann, type) and issubclass(ann, Enum):
        return "{" + "|".join(str(m.value) for m in ann) + "}"
    if ann is int:
        return "N"
    if ann is float:
        return "X"  # a duration says SECONDS: its metavar
    return "TEXT"


def _default(param: TyperOption) -> str | None:
    if param.show_default is False:
        return None
    d = param.default
    if callable(d) or d is None or d == "" or d == () or d == []:
        return None
    if isinstance(d, Enum):
        d = d.value
    if getattr(param, "is_flag", False):
        if param.secondary_opts:
            return str(param.opts[0] if d else param.secondary_opts[0])
        return None
    return str(d)


def _paragraphs(text: str | None) -> list[str]:
    if not text:
        return []
    paras = [" ".join(p.split()) for p in text.strip().split("\n\n")]
    return [p for p in paras if p and p != "\b"]


def _option_block(param: TyperOption) -> list[str]:
    names = [*param.opts, *param.secondary_opts]
    head = ", ".join(_opt(n) for n in names)
    mv = _metavar(param)
    if mv:
        head += " \\fI" + _esc(mv) + "\\fR"
    lines = [".TP", head]
    text = " ".join((param.help or "").split())
    extra = []
    d = _default(param)
    if d is not None:
        extra.append(f"Default: {d}.")
    env = param.envvar
    if env and getattr(param, "show_envvar", True):
        extra.append(f"Environment: {env if isinstance(env, str) else ', '.join(env)}.")
    lines.append(_esc(" ".join(x for x in (text, *extra) if x)))
    return lines


def _synopsis(name: str, cmd: click.Command) -> str:
    args = " ".join(
        f"\\fI{_esc((p.name or '').upper())}\\fR"
        for p in cmd.params
        if p.param_type_name == "argument"
    )
    words = " ".join(_opt(w) for w in name.split())
    return f"{_opt(PROG)} {words} [\\fIOPTIONS\\fR]" + (f" {args}" if args else "")


def commands(root: click.Command) -> list[tuple[str, click.Command]]:
    """Every command as (name, click command), a group's as ``group sub`` (``fleet ls``)."""
    out: list[tuple[str, click.Command]] = []
    for name, cmd in _root(root).commands.items():
        if isinstance(cmd, TyperGroup) and cmd.commands:
            out += [(f"{name} {sub}", c) for sub, c in cmd.commands.items()]
        else:
            out.append((name, cmd))
    return out


def _root(cmd: click.Command) -> TyperGroup:
    """The app's click command: the group of every command."""
    if not isinstance(cmd, TyperGroup):
        raise TypeError(f"the kvpush app is a {type(cmd).__name__}, not a group of commands")
    return cmd


def man_page() -> str:
    """The whole of ``man/kvpush.1``, generated from the typer app."""
    from typer.main import get_command

    from kvpush.cli.app import EPILOG, HELP, app

    root = _root(get_command(app))
    out: list[str] = [
        '.\\" Generated from the CLI by "python -m kvpush.cli.gendocs"; do not edit.',
        f'.TH KVPUSH 1 "" "kvpush {__version__}" "User Commands"',
        ".nh",
        ".ad l",
        ".SH NAME",
        "kvpush \\- push KV\\-cache blocks from prefill to decode endpoints over NIXL",
        ".SH SYNOPSIS",
        f"{_opt(PROG)} [\\fIGLOBAL OPTIONS\\fR] \\fICOMMAND\\fR [\\fIOPTIONS\\fR] [\\fIARGS\\fR]",
        ".SH DESCRIPTION",
        _esc(" ".join(HELP.split())),
        ".PP",
        _esc(
            "Commands: " + ", ".join(n for n, _ in commands(root)) + ". Each command's options "
            "are listed below; "
            "'kvpush COMMAND --help' shows the same."
        ),
        ".SH GLOBAL OPTIONS",
    ]
    for p in root.params:
        if isinstance(p, TyperOption):
            out += _option_block(p)
    out += [".TP", f"{_opt('-h')}, {_opt('--help')}", "Show help and exit."]
    out.append(".SH COMMANDS")
    for name, cmd in commands(root):
        out += _command_section(name, cmd)
    out += _environment() + _exit_status()
    out += [
        ".SH EXAMPLES",
        ".nf",
        _esc("\n".join(EXAMPLES)),
        ".fi",
        ".SH NOTES",
        _esc(" ".join(EPILOG.split()) + f" Wire protocol version {PROTOCOL_VERSION}."),
        "",
    ]
    return "\n".join(out)


EXAMPLES = (
    "kvpush demo",
    "kvpush serve-prefill --port 5600",
    "kvpush serve-decode --port 5601",
    "kvpush probe 127.0.0.1:5600 --handshake full --ping 20",
    "kvpush drive -p 127.0.0.1:5600 -d 127.0.0.1:5601 -n 1000 -c 16",
    "kvpush leg decode -d 127.0.0.1:5601 --kv-transfer-params params.json",
    "kvpush fleet check --registry http://10.0.0.5:2379 --cluster prod",
    "kvpush completion bash > ~/.local/share/bash-completion/completions/kvpush",
)


def _command_section(name: str, cmd: click.Command) -> list[str]:
    """One command's ``.SS``: synopsis, help paragraphs, arguments and options."""
    out = [".SS " + _esc(name), _synopsis(name, cmd)]
    for para in _paragraphs(cmd.help):
        out += [".PP", _esc(para)]
    args = [p for p in cmd.params if p.param_type_name == "argument"]
    opts = [p for p in cmd.params if isinstance(p, TyperOption)]
    if args:
        out += [".PP", "Arguments:"]
        for a in args:
            out += [
                ".TP",
                f"\\fI{_esc((a.name or '').upper())}\\fR",
                _esc(getattr(a, "help", "") or ""),
            ]
    if opts:
        out += [".PP", "Options:"]
        for p in opts:
            out += _option_block(p)
    return out


def _environment() -> list[str]:
    return [
        ".SH CONFIGURATION FILE",
        _esc(
            "serve-prefill, serve-decode and probe read --config FILE.toml: keys are option "
            'names with underscores (num_blocks = 2048, handshake = "full"); the tables '
            "[prefill] and [decode] apply to one role only. Relative *_file paths are relative "
            "to the file. Precedence: command line, then KVPUSH_* variables, then the file, "
            "then the defaults."
        ),
        ".SH ENVIRONMENT",
        ".TP",
        "\\fBKVPUSH_\\fIOPTION\\fR",
        _esc(
            "Every option of every command, upper-cased with dashes as underscores, e.g. "
            "KVPUSH_NUM_BLOCKS=2048, KVPUSH_AUTH_TOKEN_FILE=/etc/kvpush/token; a repeatable "
            'option takes space-separated values (KVPUSH_DECODE="HOST:PORT HOST:PORT").'
        ),
        ".TP",
        "\\fBKVPUSH_DEBUG\\fR",
        "Same as \\fB\\-\\-debug\\fR.",
        ".TP",
        "\\fBNO_COLOR\\fR",
        "Disable colours in all output.",
        ".TP",
        "\\fBUCX_TLS\\fR, \\fBUCX_NET_DEVICES\\fR",
        _esc("Read by UCX (NIXL's default backend); leave UCX_TLS unset unless measuring."),
    ]


def _exit_status() -> list[str]:
    out = [".SH EXIT STATUS"]
    for code, meaning in (
        (0, "success"),
        (1, "error (a request failed, an endpoint failed)"),
        (2, "usage: invalid option, value, address, device or configuration"),
        (3, "the peer answered but is not ready or is incompatible"),
        (69, "the peer is unreachable"),
        (
            130,
            "interrupted: a second signal while an endpoint drains; drive or demo stopped "
            "by SIGINT, SIGTERM or SIGHUP",
        ),
    ):
        out += [".TP", f"\\fB{code}\\fR", _esc(meaning)]
    return out


# -------------------------------------------------------------------------------- docs/cli.md


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _md_option(param: TyperOption) -> str:
    names = ", ".join(f"`{n}`" for n in (*param.opts, *param.secondary_opts))
    mv = _metavar(param)
    what = " ".join((param.help or "").split())
    d = _default(param)
    env = param.envvar if getattr(param, "show_envvar", True) else None
    envs = env if isinstance(env, str) else ", ".join(env or ())
    return (
        f"| {names}{' ' + _cell(mv) if mv else ''} | {_cell(what)} | "
        f"{_cell(d) if d is not None else ''} | {_cell(envs)} |"
    )


def cli_markdown() -> str:
    """The whole of ``docs/cli.md``: every command and option, generated from the typer app."""
    from typer.main import get_command

    from kvpush.cli.app import app

    root = _root(get_command(app))
    out = [
        "<!-- Generated from the CLI by `python -m kvpush.cli.gendocs`; do not edit. -->",
        "# kvpush command reference",
        "",
        "Every command and option, as `kvpush COMMAND --help` shows them (also `man -l "
        "man/kvpush.1`). The README shows each command's most useful lines; "
        "[usage.md](usage.md) explains them in depth.",
        "",
        "## Global options",
        "",
        "| option | meaning | default | environment |",
        "|---|---|---|---|",
        *(_md_option(p) for p in root.params if isinstance(p, TyperOption)),
    ]
    for name, cmd in commands(root):
        out += ["", f"## kvpush {name}", ""]
        for para in _paragraphs(cmd.help):
            out += [para, ""]
        args = [p for p in cmd.params if p.param_type_name == "argument"]
        if args:
            out += ["Arguments: " + ", ".join(f"`{(a.name or '').upper()}`" for a in args), ""]
        opts = [p for p in cmd.params if isinstance(p, TyperOption)]
        if opts:
            out += ["| option | meaning | default | environment |", "|---|---|---|---|"]
            out += [_md_option(p) for p in opts]
    return "\n".join(out) + "\n"


def outputs() -> dict[str, str]:
    """Relative path -> content of every generated file."""
    files = {f"completions/kvpush.{sh}": completion_script(sh) for sh in ("bash", "zsh", "fish")}
    files["man/kvpush.1"] = man_page()
    files["docs/cli.md"] = cli_markdown()
    return files


def drift(root: Path = ROOT) -> list[str]:
    """Generated files whose committed copy under ``root`` differs (or is missing)."""
    stale = []
    for rel, text in outputs().items():
        path = root / rel
        if not path.exists() or path.read_text() != text:
            stale.append(rel)
    return stale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpush.cli.gendocs", description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed file drifted")
    ap.add_argument(
        "--root", type=Path, default=ROOT, help="repository root (default: %(default)s)"
    )
    args = ap.parse_args(argv)
    if args.check:
        stale = drift(args.root)
        for rel in stale:
            print(
                f"drift: {rel} differs from the CLI; run: python -m kvpush.cli.gendocs",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for rel, text in outputs().items():
        path = args.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

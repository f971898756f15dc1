"""The ``kvpush`` command line: the typer app, its root options, and the error translation.

Owns ``app`` (every command registered from ``kvpush.cli.commands``), the root callback
(``--version``, ``--debug``) and ``main`` / ``run``: options -> frozen config -> one core call
-> exit status. ``main`` runs click in non-standalone mode and translates whatever ends a
command: typed ``KvpushError`` s and click's usage errors become one ``error:`` and one
``hint:`` line on stderr with a documented exit status (a traceback only with ``--debug``), a
reader that went away from stdout is no error at all (``kvpush.commands.common.stdio``).

Importing this module stays cheap (typer re-runs the program on every Tab press): torch, nixl
and zmq are only imported inside command bodies (``tests/component/test_cli_import.py`` checks it).
Runs on the main thread.
"""

from __future__ import annotations

import sys
import traceback
from typing import Annotated

import typer
from typer import _click as click  # typer >= 0.26 ships its own copy of click
from typer._completion_classes import completion_init  # typer.completion calls it there

from kvpush import PROTOCOL_VERSION, __version__
from kvpush.cli.commands import register_all
from kvpush.commands.common import stdio
from kvpush.commands.common.configfile import CONFIG_PATH
from kvpush.commands.common.flags import Group
from kvpush.commands.common.optspec import option
from kvpush.errors import ExitStatus, KvpushError

HELP = (
    "Push KV-cache blocks from a prefill endpoint (P) into a decode endpoint's (D) memory over "
    "NIXL, as disaggregated LLM inference does in push mode; watch, probe and load-test it."
)
EPILOG = (
    "Exit status: 0 ok, 1 error, 2 usage, 3 peer answered but not ready or incompatible, "
    "69 peer unreachable, 130 interrupted. Every option of a command can also be set with "
    "KVPUSH_<OPTION> (e.g. KVPUSH_NUM_BLOCKS=2048), or KVPUSH_<COMMAND>_<OPTION> where a flag "
    "means different things to different commands (KVPUSH_PROBE_TIMEOUT, KVPUSH_DRIVE_TIMEOUT): "
    "each option's help names its variable."
)

# typer's own --install-completion/--show-completion would sit in --help beside the
# `completion` command that does the same: they are left out (add_completion=False), and the
# shell classes they would register -- what answers _KVPUSH_COMPLETE on a Tab press -- are
# registered here instead (without them Tab completion silently answers nothing).
completion_init()

app = typer.Typer(
    name="kvpush",
    cls=Group,
    help=HELP,
    epilog=EPILOG,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class _State:
    debug = False


def _version(value: bool) -> None:
    if value:
        stdio.out(f"kvpush {__version__} (protocol v{PROTOCOL_VERSION})")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        option(
            "--version",
            help="Print the version and exit.",
            env=False,
            is_eager=True,
            callback=_version,
        ),
    ] = False,
    debug: Annotated[bool, option("--debug", help="Show a traceback with errors.")] = False,
) -> None:
    """Push KV-cache blocks from prefill to decode endpoints over NIXL."""
    _State.debug = debug


register_all(app)


# ------------------------------------------------------------------------------ entry point


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _error(message: str, hint: str | None) -> None:
    sys.stderr.write(f"error: {_one_line(message)}\n")
    if hint:
        sys.stderr.write(f"hint: {_one_line(hint)}\n")
    sys.stderr.flush()


def _usage_error(e: click.exceptions.ClickException) -> tuple[str, str]:
    """Message and hint of a click usage error, naming where a bad value came from."""
    ctx = getattr(e, "ctx", None)
    path = ctx.command_path if ctx is not None else "kvpush"
    hint = f"see '{path} --help'"
    param = getattr(e, "param", None)
    if (
        not isinstance(e, click.exceptions.BadParameter)
        or isinstance(e, click.exceptions.MissingParameter)
        or param is None
        or ctx is None
    ):
        return e.format_message(), hint
    flag = next((o for o in getattr(param, "opts", []) if o.startswith("--")), None)
    what = flag or (param.name or "argument").upper()
    explain = e.message[:1].lower() + e.message[1:]
    source = ctx.get_parameter_source(param.name) if param.name else None
    src = getattr(source, "name", "")
    if src == "ENVIRONMENT" and getattr(param, "envvar", None):
        var = param.envvar if isinstance(param.envvar, str) else param.envvar[0]
        import os

        return (
            f"invalid value {os.environ.get(var, '')!r} for {what} from {var}: {explain}",
            f"fix or unset {var}",
        )
    if src == "DEFAULT_MAP":
        cfg = ctx.meta.get(CONFIG_PATH, "the config file")
        value = (ctx.default_map or {}).get(param.name)
        return (
            f"invalid value {value!r} for {param.name} in config file {cfg}: {explain}",
            f"fix {param.name} in {cfg}",
        )
    return f"invalid value for {what}: {explain}", hint


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return the exit status (typed errors -> error/hint on stderr)."""
    stdio.install()
    try:
        rv = app(args=argv, prog_name="kvpush", standalone_mode=False)
        return rv if isinstance(rv, int) else int(ExitStatus.OK)
    except SystemExit as e:  # shell completion exits by itself
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except click.exceptions.NoArgsIsHelpError:
        return int(ExitStatus.USAGE)  # typer printed the help already
    except click.exceptions.ClickException as e:
        message, hint = _usage_error(e)
        _error(message, hint)
        return int(e.exit_code)
    except typer.Abort:
        return int(ExitStatus.INTERRUPTED)
    except KvpushError as e:
        if _State.debug:
            traceback.print_exc()
        _error(e.message, e.hint)
        return int(e.exit_status)
    except KeyboardInterrupt:
        return int(ExitStatus.INTERRUPTED)
    except Exception as e:
        if _State.debug:
            traceback.print_exc()
        _error(
            f"internal error: {type(e).__name__}: {e}",
            "rerun with --debug for a traceback, and report it",
        )
        return int(ExitStatus.ERROR)


def run() -> None:
    """Console-script entry point (``kvpush = "kvpush.cli.app:run"``)."""
    from kvpush.commands.common import quickexit

    quickexit.finish(main())

"""The CLI stays cheap to import (Tab completion re-runs it) and its entry points work."""

from __future__ import annotations

import subprocess
import sys

from kvpush import PROTOCOL_VERSION, __version__


def test_import_cli_does_not_pull_heavy_modules() -> None:
    code = (
        "import kvpush.cli, kvpush.cli.app, kvpush.commands.common.options, kvpush.cli.gendocs; "
        "import sys; "
        "heavy = {'torch', 'nixl', 'zmq', 'etcd3gw', 'requests'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_version(kvpush_run) -> None:
    r = kvpush_run("--version")
    assert r.returncode == 0
    assert r.stdout == f"kvpush {__version__} (protocol v{PROTOCOL_VERSION})\n"


def test_no_args_shows_help_and_every_command(kvpush_run) -> None:
    r = kvpush_run("--help")
    assert r.returncode == 0
    for cmd in ("serve-prefill", "serve-decode", "probe", "drive", "demo", "completion"):
        assert cmd in r.stdout


def test_console_script_entry_point_is_run() -> None:
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert eps.get("kvpush") == "kvpush.cli.app:run"


def test_bash_tab_completion_lists_commands(make_env) -> None:
    env = make_env(_KVPUSH_COMPLETE="complete_bash", COMP_WORDS="kvpush serve", COMP_CWORD="1")
    p = subprocess.run(
        [sys.executable, "-m", "kvpush"], env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert set(p.stdout.split()) == {"serve-prefill", "serve-decode"}


def test_tab_completion_of_enum_choices(make_env) -> None:
    env = make_env(
        _KVPUSH_COMPLETE="complete_bash",
        COMP_WORDS="kvpush serve-decode --handshake ",
        COMP_CWORD="3",
    )
    p = subprocess.run(
        [sys.executable, "-m", "kvpush"], env=env, capture_output=True, text=True, timeout=60
    )
    assert set(p.stdout.split()) == {"notif", "full"}

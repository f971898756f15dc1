"""Generated docs and completions match the CLI; the README's usage only names what exists."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.core import TyperGroup
from typer.main import get_command

from kvpush.cli import gendocs
from kvpush.cli.app import app

ROOT = Path(__file__).resolve().parents[2]


def test_committed_docs_match_the_cli() -> None:
    stale = gendocs.drift(ROOT)
    assert not stale, f"regenerate with: python -m kvpush.cli.gendocs ({', '.join(stale)})"


def test_gendocs_check_flags_drift(tmp_path: Path) -> None:
    assert gendocs.main(["--root", str(tmp_path)]) == 0  # writes into an empty tree
    assert gendocs.main(["--root", str(tmp_path), "--check"]) == 0
    (tmp_path / "man" / "kvpush.1").write_text("stale\n")
    assert gendocs.main(["--root", str(tmp_path), "--check"]) == 1


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_command_prints_the_committed_script(kvpush_run, shell: str) -> None:
    r = kvpush_run("completion", shell)
    assert r.returncode == 0
    assert r.stdout == (ROOT / "completions" / f"kvpush.{shell}").read_text()


def test_man_page_names_every_command_and_option() -> None:
    text = gendocs.man_page()
    root = get_command(app)
    names = [n for n, _ in gendocs.commands(root)]
    assert "fleet check" in names and "fleet" not in names  # a group's commands, by full name
    for name, cmd in gendocs.commands(root):
        assert f".SS {name}\n" in text
        for p in cmd.params:
            for opt in getattr(p, "opts", []):
                if opt.startswith("--"):
                    assert "\\fB" + opt.replace("-", "\\-") + "\\fR" in text, (name, opt)


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff not installed")
def test_man_page_is_clean_roff() -> None:
    p = subprocess.run(
        ["groff", "-ww", "-man", "-z", str(ROOT / "man" / "kvpush.1")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and not p.stderr, p.stderr


@pytest.mark.skipif(shutil.which("man") is None, reason="man not installed")
def test_man_page_renders() -> None:
    p = subprocess.run(
        ["man", "-l", str(ROOT / "man" / "kvpush.1")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"MANPAGER": "cat", "PAGER": "cat", "MANWIDTH": "100", "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr
    assert "serve-prefill" in p.stdout


def _readme_invocations() -> list[list[str]]:
    """Every ``kvpush ...`` line inside the README's fenced code blocks."""
    text = (ROOT / "README.md").read_text()
    lines: list[list[str]] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        block = block.replace("\\\n", " ")  # a command continued on the next line
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("kvpush "):
                lines.append(shlex.split(line.split(">")[0]))
    return lines


def test_readme_usage_names_only_existing_commands_and_options() -> None:
    root = get_command(app)
    assert isinstance(root, TyperGroup)
    commands = root.commands
    global_opts = {o for p in root.params for o in (*p.opts, *getattr(p, "secondary_opts", []))}
    invocations = _readme_invocations()
    assert len(invocations) >= 10
    documented = set()
    for argv in invocations:
        rest = [a for a in argv[1:] if a not in global_opts]
        assert rest and rest[0] in commands, f"README uses an unknown command: {argv}"
        cmd = commands[rest[0]]
        documented.add(rest[0])
        subs = getattr(cmd, "commands", None)
        if subs:  # a group (kvpush fleet ls): the options are its command's
            assert len(rest) > 1 and rest[1] in subs, f"README: unknown {rest[0]} command: {argv}"
            cmd = subs[rest[1]]
            rest = rest[1:]
        known = {"-h", "--help"} | {
            o for p in cmd.params for o in (*p.opts, *getattr(p, "secondary_opts", []))
        }
        for arg in rest[1:]:
            if arg.startswith("-") and not re.fullmatch(r"-?\d+(\.\d+)?", arg):
                assert arg.split("=")[0] in known, f"README: {rest[0]} has no option {arg}"
    assert documented == set(commands), (
        f"commands without README usage: {set(commands) - documented}"
    )


def test_readme_set_up_has_exactly_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```[a-z]*\n(.*?)```", section, flags=re.S)
    assert block is not None
    cmds = [ln.split("#")[0].strip() for ln in block.group(1).splitlines() if ln.strip()]
    assert cmds == ["make demo", "make test"]


def test_flags_read_as_flags_in_help() -> None:
    """typer's help prints a value type beside every option; a flag (``--json``,
    ``--verify/--no-verify``, ``--help``) gets none, as in the man page: it takes no value."""
    from typer.testing import CliRunner

    runner = CliRunner()
    names = ["", "fleet", "leg", *(n for n, _ in gendocs.commands(get_command(app)))]
    for name in names:
        r = runner.invoke(app, [*name.split(), "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, (name, r.output)
        assert "<bool>" not in r.output, name
        assert re.search(r"--help\s+-h\s+Show this message and exit\.", r.output), name
    r = runner.invoke(app, ["serve-decode", "--help"], env={"COLUMNS": "200"})
    assert re.search(r"--verify\s+--no-verify\s+Check every landed byte", r.output), r.output
    r = runner.invoke(app, ["probe", "--help"], env={"COLUMNS": "200"})
    assert re.search(r"--json\s+One JSON object on stdout\.", r.output), r.output
    assert re.search(r"--timeout\s+SECONDS\s+Seconds to wait per request\.", r.output)

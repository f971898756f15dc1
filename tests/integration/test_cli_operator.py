"""What an operator types and reads, item by item: exact messages and behaviour of the CLI
(issue 19's smaller items and drive's lines). Real processes on 127.0.0.1 where a peer is
needed."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from typer.main import get_command

from kvpush.cli import gendocs
from kvpush.cli.app import app
from kvpush.commands.common import options
from tests.conftest import SMALL, Done, run_cli
from tests.support.procs import KVPUSH, Launcher, Proc, clean_env

HASH_ERROR = [
    "error: invalid compatibility hash {!r}",
    "hint: pass vLLM's hash (64 hex digits) with --compat-hash, or take it from a running peer "
    "with --like HOST:PORT",
]


@pytest.mark.parametrize("value", ["abc", "not hex!", "5" * 63, "g" * 64])
def test_compat_hash_must_be_64_hex_digits(value: str) -> None:
    r = run_cli("serve-decode", "--wire", "vllm", "--compat-hash", value, "--port", "0")
    assert r.returncode == 2, r.stderr
    assert r.err_lines == [HASH_ERROR[0].format(value), HASH_ERROR[1]]


def _complete(words: str) -> list[str]:
    cword = len(words.split()) - (0 if words.endswith(" ") else 1)
    env = clean_env(_KVPUSH_COMPLETE="complete_bash", COMP_WORDS=words, COMP_CWORD=str(cword))
    p = subprocess.run([*KVPUSH], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_completion_offers_shapes_dtypes_devices_and_scenarios() -> None:
    assert _complete("kvpush drive --shape ") == ["llama-8b", "llama-70b-tp8", "mla"]
    assert _complete("kvpush demo --shape ll") == ["llama-8b", "llama-70b-tp8"]
    assert "bfloat16" in _complete("kvpush serve-decode --dtype ")
    assert _complete("kvpush probe 127.0.0.1:1 --dtype fl") == ["float16", "float32"]
    assert _complete("kvpush serve-prefill --device ")[:2] == ["cpu", "cuda"]
    assert _complete("kvpush bench ") == [
        "hol", "handshake", "bandwidth", "rate", "scale", "tp", "model", "fleet", "device", "trace",
        "peer", "all",
    ]  # fmt: skip
    assert _complete("kvpush bench h") == ["hol", "handshake"]


def test_help_has_no_typer_completion_options_and_tab_still_completes() -> None:
    r = run_cli("--help")
    assert r.returncode == 0
    assert "--install-completion" not in r.stdout and "--show-completion" not in r.stdout
    assert "completion" in r.stdout  # the command that prints the scripts
    assert set(_complete("kvpush serve")) == {"serve-prefill", "serve-decode"}
    assert _complete("kvpush serve-decode --handshake ") == ["notif", "full"]


def _helps_by_variable() -> dict[str, set[str]]:
    """Every option's variable -> the help texts of the options that read it, in every
    command (the root's included)."""
    root = get_command(app)
    meanings: dict[str, set[str]] = {}
    for cmd in [root, *(c for _, c in gendocs.commands(root))]:
        for p in cmd.params:
            var = getattr(p, "envvar", None)
            if var:
                meanings.setdefault(var, set()).add(getattr(p, "help", "") or "")
    return meanings


def test_no_variable_means_two_things_to_two_commands() -> None:
    """A flag with two meanings has a variable per command; the shared ones mean the same."""
    meanings = _helps_by_variable()
    shared = {var for var, helps in meanings.items() if len(helps) > 1}
    assert shared == options.SHARED_ENV
    for var in ("KVPUSH_PROBE_TIMEOUT", "KVPUSH_DRIVE_TIMEOUT", "KVPUSH_PROBE_JSON",
                "KVPUSH_DRIVE_JSON", "KVPUSH_PROBE_HANDSHAKE", "KVPUSH_HANDSHAKE",
                "KVPUSH_LEG_TIMEOUT", "KVPUSH_BLOCKS"):  # fmt: skip
        assert len(meanings[var]) == 1, var
    assert "KVPUSH_TIMEOUT" not in meanings and "KVPUSH_JSON" not in meanings


def test_probes_timeout_variable_is_probes_own() -> None:
    env = clean_env(KVPUSH_PROBE_TIMEOUT="soon")
    r = run_cli("probe", "127.0.0.1:1", env=env)
    assert r.returncode == 2
    assert r.err_lines[0] == (
        "error: invalid value 'soon' for --timeout from KVPUSH_PROBE_TIMEOUT: input should be a "
        "valid number, unable to parse string as a number"
    )
    # The old shared name is no option of any command now: probe runs as if it were unset.
    r = run_cli("probe", "127.0.0.1:1", env=clean_env(KVPUSH_TIMEOUT="soon"))
    assert r.returncode == 69 and r.err_lines[0] == "error: 127.0.0.1:1: connection refused"


# ------------------------------------------------------------------ with real endpoints


@pytest.mark.integration
def test_probe_with_a_token_lists_the_same_ranks_as_without(
    serve: Launcher, tmp_path: Path
) -> None:
    tok = tmp_path / "token"
    tok.write_text("0123456789abcdef0123456789abcdef\n")
    tok.chmod(0o600)
    plain = serve.serve("prefill", *SMALL, "--tp", "2")
    locked = serve.serve("prefill", *SMALL, "--tp", "2", "--auth-token-file", str(tok))

    def ranks_line(r: Done) -> str:
        assert r.returncode == 0, r.stderr
        return next(ln for ln in r.stdout.splitlines() if ln.startswith("ranks"))

    without = ranks_line(run_cli("probe", plain.address))
    with_token = ranks_line(run_cli("probe", locked.address, "--auth-token-file", str(tok)))
    assert without == with_token
    assert without.split(None, 1)[1] == "0..1 (tp 2), describing rank 0"


def _drive(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*KVPUSH, "drive", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=clean_env(COLUMNS="80"),
    )  # fmt: skip


@pytest.mark.integration
def test_drive_goes_on_without_a_decode_that_is_down_at_start(
    pd_pair: tuple[Proc, Proc], free_port: int
) -> None:
    p, d = pd_pair
    gone = f"127.0.0.1:{free_port}"
    r = run_cli("drive", "-p", p.address, "-d", gone, "-d", d.address, "-n", "20",
                "-c", "4", "--json", env=clean_env(COLUMNS="80"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["ok"], out["by_decode"]) == (20, {d.address: 20})
    why = f"{gone}: connection refused"
    assert (
        f"drive: {gone} is down at start ({why}): requests avoid it until it answers"
        in r.stderr.splitlines()
    )
    note = (
        f"drive: note: {gone} was down at start ({why}): the run went on with the other "
        "endpoints; it was re-checked every second and took requests once it answered and its "
        "role and geometry were checked"
    )
    assert note in r.stderr.splitlines()  # one line, though stderr is a file and COLUMNS=80
    assert len(note) > 80


@pytest.mark.integration
def test_drive_exits_69_only_when_no_decode_is_up(pd_pair: tuple[Proc, Proc]) -> None:
    p, _ = pd_pair
    r = run_cli("drive", "-p", p.address, "-d", "127.0.0.1:1", "-d", "127.0.0.1:2", "-n", "2")
    assert r.returncode == 69
    assert r.err_lines[0] == "error: 127.0.0.1:1: connection refused"


@pytest.mark.integration
def test_a_short_timeout_is_reported_as_a_deadline(pd_pair: tuple[Proc, Proc]) -> None:
    p, d = pd_pair
    r = run_cli("drive", "-p", p.address, "-d", d.address, "-n", "4", "--timeout", "0.001",
                "--json")  # fmt: skip
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert set(out["failures_by_reason"]) == {"deadline"}, out
    assert "prefill_unreachable" not in r.stdout + r.stderr


@pytest.mark.integration
def test_a_run_planned_far_longer_than_its_timeout_is_noted_before_it_starts(
    pd_pair: tuple[Proc, Proc],
) -> None:
    p, d = pd_pair
    drive = _drive("-p", p.address, "-d", d.address, "--rate", "0.000001", "-n", "2",
                   "--json")  # fmt: skip
    try:
        assert drive.stderr is not None
        first = drive.stderr.readline().rstrip("\n")
        time.sleep(1.0)
        drive.send_signal(signal.SIGINT)
        _, rest = drive.communicate(timeout=30)
    finally:
        drive.kill()
    assert first == (
        "drive: note: --rate 1e-06 requests/s starts the last of 2 requests 11.6 days after "
        "the first, more than 100 x --timeout 30s: check --rate (requests per second) if that "
        "is not meant"
    )
    assert drive.returncode == 130
    assert first not in rest  # said once, at the start

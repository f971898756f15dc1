"""Bad input: the exact ``error:``/``hint:`` lines on stderr and the exit status, no traceback.

Real processes throughout (``python -m kvpush``); the cases that need the engine start real
endpoints and are marked ``integration``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpush.errors import ExitStatus

USAGE = int(ExitStatus.USAGE)
ERROR = int(ExitStatus.ERROR)
UNREACHABLE = int(ExitStatus.UNREACHABLE)

CASES: list[tuple[list[str], list[str], int]] = [
    (
        ["bench", "nope"],
        [
            "error: unknown benchmark scenario 'nope'",
            "hint: choose one of hol, handshake, bandwidth, rate, scale, tp, model, fleet, "
            "device, trace, peer, or all",
        ],
        USAGE,
    ),
    (
        ["serve-prefill", "--port", "70000"],
        ["error: invalid port 70000", "hint: use 1-65535, or 0 to pick a free port"],
        USAGE,
    ),
    (
        ["serve-decode", "--port", "-1"],
        ["error: invalid port -1", "hint: use 1-65535, or 0 to pick a free port"],
        USAGE,
    ),
    (
        ["serve-prefill", "--metrics-port", "99999"],
        ["error: invalid port 99999", "hint: use 1-65535 for --metrics-port, or 0 for off"],
        USAGE,
    ),
    (
        ["probe", "127.0.0.1"],
        ["error: address '127.0.0.1' has no port", "hint: use HOST:PORT, e.g. 127.0.0.1:5600"],
        USAGE,
    ),
    (
        ["probe", "127.0.0.1:0"],
        ["error: invalid port in address '127.0.0.1:0'", "hint: ports are 1-65535"],
        USAGE,
    ),
    (
        ["probe", "local host:5600"],
        ["error: invalid address 'local host:5600'", "hint: use HOST:PORT, e.g. 127.0.0.1:5600"],
        USAGE,
    ),
    (
        ["drive", "-p", "127.0.0.1:5600", "-d", "127.0.0.1:http"],
        ["error: invalid port in address '127.0.0.1:http'", "hint: ports are 1-65535"],
        USAGE,
    ),
    (
        ["serve-prefill", "--num-blocks", "0"],
        ["error: --num-blocks must be positive, got 0", "hint: pass --num-blocks > 0"],
        USAGE,
    ),
    (
        ["serve-decode", "--layers", "-3"],
        ["error: --layers must be positive, got -3", "hint: pass --layers > 0"],
        USAGE,
    ),
    (
        ["serve-decode", "--block-bytes", "0"],
        ["error: --block-bytes must be positive, got 0", "hint: pass --block-bytes > 0"],
        USAGE,
    ),
    (
        ["serve-decode", "--block-tokens", "16", "--kv-heads", "0", "--head-dim", "128"],
        ["error: --kv-heads must be positive, got 0", "hint: pass --kv-heads > 0"],
        USAGE,
    ),
    (
        ["serve-decode", "--block-tokens", "16"],
        [
            "error: --block-tokens needs --kv-heads and --head-dim too",
            "hint: model-like geometry takes --block-tokens, --kv-heads and --head-dim together",
        ],
        USAGE,
    ),
    (
        ["serve-prefill", "--lease", "0"],
        ["error: --lease must be positive, got 0", "hint: pass --lease > 0"],
        USAGE,
    ),
    (
        ["serve-prefill", "--lease", "5", "--heartbeat", "5"],
        [
            "error: heartbeat interval 5.0s must be shorter than the lease 5.0s",
            "hint: use a heartbeat of at most a third of the lease",
        ],
        USAGE,
    ),
    (
        ["serve-prefill", "--interval", "-1"],
        ["error: --interval must be positive, got -1", "hint: pass --interval > 0"],
        USAGE,
    ),
    (
        ["drive", "-p", "127.0.0.1:5600", "-d", "127.0.0.1:5601", "-n", "0"],
        ["error: --requests must be positive, got 0", "hint: pass --requests 1 or more"],
        USAGE,
    ),
    (
        ["drive", "-p", "127.0.0.1:5600", "-d", "127.0.0.1:5601", "--blocks", "-2"],
        ["error: --blocks must be positive, got -2", "hint: pass --blocks 1 or more"],
        USAGE,
    ),
    (
        ["drive", "-p", "127.0.0.1:5600", "-d", "127.0.0.1:5601", "--rate", "0"],
        ["error: --rate must be positive, got 0", "hint: omit --rate for no limit"],
        USAGE,
    ),
    (
        ["probe", "127.0.0.1:5600", "--count", "0"],
        ["error: --count must be positive, got 0", "hint: pass --count 1 or more"],
        USAGE,
    ),
    (
        ["demo", "--decoders", "0"],
        ["error: --decoders must be positive, got 0", "hint: pass --decoders 1 or more"],
        USAGE,
    ),
    (
        ["serve-decode", "--device", "tpu"],
        ["error: unknown device 'tpu'", "hint: use 'cpu', 'cuda' or 'cuda:N' (N = GPU index)"],
        USAGE,
    ),
    (
        ["serve-decode", "--device", "cuda:x"],
        ["error: unknown device 'cuda:x'", "hint: use 'cpu', 'cuda' or 'cuda:N' (N = GPU index)"],
        USAGE,
    ),
    (
        ["serve-decode", "--dtype", "float8"],
        [
            "error: unknown dtype 'float8'",
            "hint: choose one of bf16, bfloat16, float16, float32, fp16, fp32, fp8, int8, uint8",
        ],
        USAGE,
    ),
    (
        ["serve-prefill", "--host", "0.0.0.0"],
        [
            "error: refusing to bind the side channel to all interfaces (0.0.0.0)",
            "hint: pass --expose to bind every interface on purpose (and set --auth-token-file)",
        ],
        USAGE,
    ),
    (
        ["serve-prefill", "--engine-id", "bad id!"],
        [
            "error: invalid engine id 'bad id!'",
            "hint: use up to 128 letters, digits and . _ : @ -",
        ],
        USAGE,
    ),
    (
        ["serve-prefill", "--backends", ","],
        ["error: --backends is empty", "hint: name at least one NIXL backend, e.g. UCX"],
        USAGE,
    ),
    (
        ["serve-prefill", "--config", "/nonexistent/kvpush.toml"],
        [
            "error: cannot read config file /nonexistent/kvpush.toml: No such file or directory",
            "hint: check the path and its permissions",
        ],
        USAGE,
    ),
    (
        ["serve-prefill", "--config", "/"],
        [
            "error: cannot read config file /: Is a directory",
            "hint: check the path and its permissions",
        ],
        USAGE,
    ),
]


def _ids(case: tuple[list[str], list[str], int]) -> str:
    return " ".join(case[0])[:60]


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_bad_input(kvpush_run, case: tuple[list[str], list[str], int]) -> None:
    args, lines, status = case
    r = kvpush_run(*args)
    assert r.err_lines == lines, r.stderr
    assert r.returncode == status
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_debug_adds_a_traceback(kvpush_run) -> None:
    r = kvpush_run("--debug", "serve-prefill", "--num-blocks", "0")
    assert r.returncode == USAGE
    assert "Traceback (most recent call last)" in r.stderr
    assert r.err_lines[0] == "error: --num-blocks must be positive, got 0"


def test_environment_variable_is_an_option(kvpush_run, make_env) -> None:
    r = kvpush_run("serve-prefill", env=make_env(KVPUSH_NUM_BLOCKS="-4"))
    assert r.err_lines == [
        "error: --num-blocks must be positive, got -4",
        "hint: pass --num-blocks > 0",
    ]
    assert r.returncode == USAGE


def test_precedence_cli_over_env_over_config_file(kvpush_run, make_env, tmp_path: Path) -> None:
    cfg = tmp_path / "kvpush.toml"
    cfg.write_text("num_blocks = -1\n[decode]\nlayers = -2\n")
    # the file alone
    r = kvpush_run("serve-prefill", "--config", str(cfg))
    assert r.err_lines[0] == "error: --num-blocks must be positive, got -1"
    # the [decode] table applies to serve-decode only (num_blocks from env wins over the file)
    r = kvpush_run("serve-decode", "--config", str(cfg), env=make_env(KVPUSH_NUM_BLOCKS="8"))
    assert r.err_lines[0] == "error: --layers must be positive, got -2"
    # env over file, command line over env
    r = kvpush_run("serve-prefill", "--config", str(cfg), env=make_env(KVPUSH_NUM_BLOCKS="-5"))
    assert r.err_lines[0] == "error: --num-blocks must be positive, got -5"
    r = kvpush_run(
        "serve-prefill",
        "--config",
        str(cfg),
        "--num-blocks",
        "-6",
        env=make_env(KVPUSH_NUM_BLOCKS="-5"),
    )
    assert r.err_lines[0] == "error: --num-blocks must be positive, got -6"
    # KVPUSH_CONFIG names the file
    r = kvpush_run("serve-prefill", env=make_env(KVPUSH_CONFIG=str(cfg)))
    assert r.err_lines[0] == "error: --num-blocks must be positive, got -1"


def test_config_file_errors(kvpush_run, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("num_blocks = [\n")
    r = kvpush_run("serve-decode", "--config", str(bad))
    assert r.returncode == USAGE
    assert r.err_lines[0].startswith(f"error: config file {bad} is not valid TOML: ")
    assert r.err_lines[1] == "hint: see https://toml.io for the syntax"

    unknown = tmp_path / "unknown.toml"
    unknown.write_text("num_block = 5\n")
    r = kvpush_run("serve-decode", "--config", str(unknown))
    assert r.err_lines == [
        f"error: unknown key 'num_block' in config file {unknown}",
        "hint: keys are option names with underscores, e.g. num_blocks = 1024",
    ]
    assert r.returncode == USAGE

    table = tmp_path / "table.toml"
    table.write_text("[server]\nport = 1\n")
    r = kvpush_run("serve-decode", "--config", str(table))
    assert r.err_lines == [
        f"error: unknown table [server] in config file {table}",
        "hint: use top-level keys, or the tables [prefill] and [decode]",
    ]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_config_file(kvpush_run, tmp_path: Path) -> None:
    cfg = tmp_path / "secret.toml"
    cfg.write_text("num_blocks = 8\n")
    cfg.chmod(0)
    r = kvpush_run("serve-decode", "--config", str(cfg))
    assert r.err_lines == [
        f"error: cannot read config file {cfg}: Permission denied",
        "hint: check the path and its permissions",
    ]
    assert r.returncode == USAGE


def test_token_file_errors(kvpush_run, tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text("0123456789abcdef0123456789abcdef\n")
    tok.chmod(0o644)
    r = kvpush_run("serve-decode", "--auth-token-file", str(tok))
    assert r.err_lines == [
        f"error: auth token file {tok} is readable by other users",
        f"hint: run: chmod 600 {tok}",
    ]
    assert r.returncode == USAGE
    r = kvpush_run("probe", "127.0.0.1:5600", "--auth-token-file", str(tok))
    assert r.err_lines[0] == f"error: auth token file {tok} is readable by other users"

    short = tmp_path / "short"
    short.write_text("tooshort\n")
    short.chmod(0o600)
    r = kvpush_run("serve-prefill", "--auth-token-file", str(short))
    assert r.err_lines == [
        f"error: auth token in {short} is shorter than 16 bytes",
        "hint: generate one: head -c 32 /dev/urandom | xxd -p > FILE && chmod 600 FILE",
    ]
    missing = tmp_path / "missing"
    r = kvpush_run("serve-prefill", "--auth-token-file", str(missing))
    assert r.err_lines == [
        f"error: cannot read auth token file {missing}: No such file or directory",
        "hint: check the path and permissions",
    ]


def test_usage_errors_from_the_parser_exit_2(kvpush_run) -> None:
    r = kvpush_run("serve-prefill", "--port", "abc")
    assert r.returncode == USAGE
    assert "--port" in r.stderr
    r = kvpush_run("serve-decode", "--handshake", "half")
    assert r.returncode == USAGE
    r = kvpush_run("no-such-command")
    assert r.returncode == USAGE


# ----------------------------------------------------------------- errors raised by the engine


@pytest.mark.integration
def test_cuda_requested_on_a_host_without_it(kvpush_run) -> None:
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this host has CUDA")
    except ImportError:
        pass
    r = kvpush_run("serve-decode", "--port", "0", "--device", "cuda:0", "-o", "plain")
    assert r.err_lines == [
        "error: CUDA requested (--device cuda:0) but this host has no usable CUDA device",
        "hint: use --device cpu",
    ]
    assert r.returncode == USAGE
    assert "Traceback" not in r.stderr


@pytest.mark.integration
def test_missing_nixl_backend(kvpush_run) -> None:
    r = kvpush_run(
        "serve-prefill", "--port", "0", "--backends", "NOSUCH", "--num-blocks", "8", "-o", "plain"
    )
    assert r.err_lines[0] == "error: NIXL backend NOSUCH is not available"
    assert r.err_lines[1].startswith("hint: available backends here: ")
    assert "UCX" in r.err_lines[1]
    assert r.returncode == ERROR


@pytest.mark.integration
def test_port_in_use(kvpush_run, serve) -> None:
    first = serve.start("prefill", "--num-blocks", "8", "--layers", "1", "--block-bytes", "4096")
    r = kvpush_run("serve-decode", "--port", str(first.port), "--num-blocks", "8", "-o", "plain")
    assert r.err_lines == [
        f"error: cannot bind side channel 127.0.0.1:{first.port}: address already in use",
        "hint: choose another --port (0 picks a free one) or stop the process using it",
    ]
    assert r.returncode == ERROR
    assert first.proc.poll() is None  # the first endpoint is unharmed


@pytest.mark.integration
def test_metrics_port_in_use(kvpush_run, serve) -> None:
    first = serve.start("prefill", "--num-blocks", "8", "--layers", "1", "--block-bytes", "4096")
    r = kvpush_run(
        "serve-decode",
        "--port",
        "0",
        "--metrics-port",
        str(first.port),
        "--num-blocks",
        "8",
        "-o",
        "plain",
    )
    assert r.err_lines == [
        f"error: cannot bind metrics port 127.0.0.1:{first.port}: address already in use",
        "hint: choose another --metrics-port (0 means off) or stop the process using it",
    ]
    assert r.returncode == ERROR


@pytest.mark.integration
def test_probe_unreachable(kvpush_run, free_port: int) -> None:
    r = kvpush_run("probe", f"127.0.0.1:{free_port}", "--timeout", "0.5")
    assert r.err_lines == [
        f"error: 127.0.0.1:{free_port}: connection refused",
        f"hint: nothing listens on port {free_port} of 127.0.0.1: check the port and that the "
        "peer runs",
    ]
    assert r.returncode == UNREACHABLE


@pytest.mark.integration
def test_drive_unreachable(kvpush_run, free_port: int) -> None:
    r = kvpush_run(
        "drive", "-p", f"127.0.0.1:{free_port}", "-d", f"127.0.0.1:{free_port}", "--timeout", "0.5"
    )
    assert r.err_lines[0] == f"error: 127.0.0.1:{free_port}: connection refused"
    assert r.returncode == UNREACHABLE


# ------------------------------------------------------------- issue 12: the smaller items


def test_bad_typed_value_names_its_source(kvpush_run, make_env, tmp_path: Path) -> None:
    explain = "input should be a valid integer, unable to parse string as an integer"
    r = kvpush_run("serve-prefill", env=make_env(KVPUSH_NUM_BLOCKS="abc"))
    assert r.err_lines == [
        f"error: invalid value 'abc' for --num-blocks from KVPUSH_NUM_BLOCKS: {explain}",
        "hint: fix or unset KVPUSH_NUM_BLOCKS",
    ]
    assert r.returncode == USAGE
    cfg = tmp_path / "kvpush.toml"
    cfg.write_text('[decode]\nnum_blocks = "abc"\n')
    r = kvpush_run("serve-decode", "--config", str(cfg))
    assert r.err_lines == [
        f"error: invalid value 'abc' for num_blocks in config file {cfg}: {explain}",
        f"hint: fix num_blocks in {cfg}",
    ]
    assert r.returncode == USAGE
    r = kvpush_run("serve-prefill", "--port", "abc")
    assert r.err_lines == [
        f"error: invalid value for --port: {explain}",
        "hint: see 'kvpush serve-prefill --help'",
    ]
    assert "╭" not in r.stderr  # no box: one error line and one hint line


def test_config_file_that_is_not_utf8(kvpush_run, tmp_path: Path) -> None:
    cfg = tmp_path / "latin1.toml"
    cfg.write_bytes(b'engine_id = "caf\xe9"\n')
    r = kvpush_run("serve-decode", "--config", str(cfg))
    assert r.err_lines == [
        f"error: config file {cfg} is not UTF-8 text (byte 16: 0xe9)",
        "hint: TOML files are UTF-8: save it as UTF-8 (iconv -t UTF-8)",
    ]
    assert r.returncode == USAGE


def test_every_table_of_a_shared_config_file_is_checked(kvpush_run, tmp_path: Path) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text("[prefill]\nnum_blokcs = 8\n")
    r = kvpush_run("serve-decode", "--config", str(typo))  # the [prefill] table is not its own
    assert r.err_lines == [
        f"error: unknown key 'num_blokcs' in config file {typo}",
        "hint: keys are option names with underscores, e.g. num_blocks = 1024",
    ]
    assert r.returncode == USAGE
    wrong = tmp_path / "wrong-role.toml"
    wrong.write_text("[decode]\nwrite_timeout = 2.0\n")
    r = kvpush_run("serve-prefill", "--config", str(wrong))
    assert r.err_lines == [
        f"error: key 'write_timeout' in table [decode] of config file {wrong} is not an option of "
        "serve-decode",
        "hint: move it to the table of the role it applies to, or to the top level",
    ]
    assert r.returncode == USAGE


def test_ready_file_in_a_missing_directory_is_refused_up_front(kvpush_run, tmp_path) -> None:
    path = tmp_path / "no" / "such" / "ready.json"
    r = kvpush_run("serve-decode", "--port", "0", "--ready-file", str(path))
    assert r.err_lines == [
        f"error: --ready-file {path}: directory {path.parent} does not exist",
        "hint: create the directory first, or give a path in an existing one",
    ]
    assert r.returncode == USAGE
    assert "ready on" not in r.stderr  # refused before the endpoint started


def test_every_option_of_drive_reads_its_variable(kvpush_run, make_env) -> None:
    env = make_env(
        KVPUSH_PREFILL="127.0.0.1:5600", KVPUSH_DECODE="127.0.0.1:5601", KVPUSH_REQUESTS="0"
    )
    r = kvpush_run("drive", env=env)
    assert r.err_lines == [
        "error: --requests must be positive, got 0",
        "hint: pass --requests 1 or more",
    ]
    env = make_env(KVPUSH_PREFILL="127.0.0.1:5600 127.0.0.1:5602", KVPUSH_DECODE="127.0.0.1:x")
    r = kvpush_run("drive", env=env)
    assert r.err_lines == [
        "error: invalid port in address '127.0.0.1:x'",
        "hint: ports are 1-65535",
    ]
    r = kvpush_run("probe", "127.0.0.1:5600", env=make_env(KVPUSH_COUNT="0"))
    assert r.err_lines[0] == "error: --count must be positive, got 0"
    r = kvpush_run("demo", env=make_env(KVPUSH_DECODERS="0"))
    assert r.err_lines[0] == "error: --decoders must be positive, got 0"


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.integration
@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_bracketed_ipv6_host_is_not_doubled(serve, kvpush_run) -> None:
    s = serve.start("decode", "--host", "[::1]", "--num-blocks", "8", "--layers", "1",
                    "--block-bytes", "4096")  # fmt: skip
    assert s.address == f"[::1]:{s.port}"
    r = kvpush_run("probe", s.address, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["address"] == s.address


@pytest.mark.integration
def test_drive_preflight_refuses_an_incompatible_pair(serve, kvpush_run) -> None:
    p = serve.start("prefill", "--num-blocks", "16", "--layers", "2", "--block-bytes", "4096")
    d = serve.start("decode", "--num-blocks", "16", "--layers", "1", "--block-bytes", "8192")
    r = kvpush_run("drive", "-p", p.address, "-d", d.address, "-n", "5")
    assert r.err_lines == [
        f"error: {d.address} (decode) is incompatible with {p.address} (prefill): "
        "block_bytes 8192 vs 4096, layers 1 vs 2, regions 2 vs 4",
        "hint: P and D must agree on dtype, kv layout, block size and layers: start them with "
        "the same geometry options",
    ]
    assert r.returncode == 3


@pytest.mark.integration
def test_auth_errors_name_the_peer(serve, kvpush_run, tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for f, text in ((ours, "0123456789abcdef0123456789abcdef"), (theirs, "f" * 32)):
        f.write_text(text + "\n")
        f.chmod(0o600)
    p = serve.start("prefill", "--num-blocks", "8", "--layers", "1", "--block-bytes", "4096",
                    "--auth-token-file", str(theirs))  # fmt: skip
    r = kvpush_run("drive", "-p", p.address, "-d", p.address, "--auth-token-file", str(ours))
    assert r.returncode == 3, r.stderr
    assert r.err_lines[0].startswith(f"error: {p.address}"), r.err_lines

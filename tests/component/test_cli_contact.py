"""``kvpush probe`` tells what it found: refused, timed out, unresolvable, silent, not a side
channel (HTTP); ``--json`` prints exactly one object, errors included; a closed stdout is no
error. Real sockets and real processes on 127.0.0.1.

No timing is asserted: "fast" is shown by giving ``--timeout 60`` to a command the test waits
30 s for -- waiting out the timeout would fail the test.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
from collections.abc import Iterator

import pytest

from tests.support.procs import KVPUSH, clean_env

pytestmark = pytest.mark.integration

UNREACHABLE_HINT = (
    "hint: check the address, that the peer is running and that no firewall is in the way; "
    "raise --timeout for a slow link"
)
NOT_SIDE_CHANNEL_HINT = (
    "hint: check the address: it must be a kvpush or vLLM NIXL side channel, not e.g. the "
    "Prometheus /metrics port"
)


def _one_object(stdout: str) -> dict[str, object]:
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


def test_refused_is_fast_and_says_so(kvpush_run, free_port: int) -> None:
    addr = f"127.0.0.1:{free_port}"
    r = kvpush_run("probe", addr, "--timeout", "60", "--json", timeout=30)
    assert r.returncode == 69
    assert r.err_lines == [
        f"error: {addr}: connection refused",
        f"hint: nothing listens on port {free_port} of 127.0.0.1: check the port and that the "
        "peer runs",
    ]
    assert _one_object(r.stdout) == {
        "address": addr,
        "status": "unreachable",
        "found": "refused",
        "error": f"{addr}: connection refused",
        "hint": f"nothing listens on port {free_port} of 127.0.0.1: check the port and that "
        "the peer runs",
        "exit_status": 69,
    }


def test_kvpush_metrics_port_is_http_not_a_side_channel(serve, kvpush_run, free_port) -> None:
    s = serve.start("decode", "--num-blocks", "8", "--layers", "1", "--block-bytes", "4096",
                    "--metrics-port", str(free_port))  # fmt: skip
    addr = f"127.0.0.1:{free_port}"
    r = kvpush_run("probe", addr, "--timeout", "60", timeout=30)
    assert r.returncode == 3
    assert r.err_lines == [
        f"error: {addr} answered but is not a kvpush or vLLM side channel (looks like HTTP)",
        NOT_SIDE_CHANNEL_HINT,
    ]
    r = kvpush_run("probe", addr, "--json", timeout=30)
    obj = _one_object(r.stdout)
    assert (obj["status"], obj["found"], obj["exit_status"]) == ("not_a_side_channel", "http", 3)
    assert s.proc.poll() is None  # the endpoint is unharmed


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A TCP port whose kernel accepts connections that nobody ever reads or answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


def test_silent_peer_times_out(kvpush_run, silent_listener: int) -> None:
    addr = f"127.0.0.1:{silent_listener}"
    r = kvpush_run("probe", addr, "--timeout", "1", "--json")
    assert r.returncode == 69
    assert r.err_lines == [
        f"error: {addr}: timed out: accepted the connection but sent nothing within 1s",
        UNREACHABLE_HINT,
    ]
    obj = _one_object(r.stdout)
    assert (obj["status"], obj["found"]) == ("unreachable", "silent")


def test_zmq_socket_that_never_answers(kvpush_run) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        addr = f"127.0.0.1:{port}"
        r = kvpush_run("probe", addr, "--timeout", "1", "--json")
        assert r.returncode == 69
        assert r.err_lines == [
            f"error: {addr}: timed out: a ZMQ socket accepted the connection but did not "
            "answer get_meta_msg within 1s (busy, frozen, or not a side channel)",
            UNREACHABLE_HINT,
        ]
        assert _one_object(r.stdout)["found"] == "timeout"
    finally:
        sock.close(0)
        ctx.term()


def test_name_that_resolves_to_nothing(kvpush_run) -> None:
    r = kvpush_run("probe", "nosuch.invalid:5600", "--json", timeout=60)
    assert r.returncode == 69
    assert r.err_lines == [
        "error: nosuch.invalid:5600: cannot resolve the name: 'nosuch.invalid' resolves to no "
        "address",
        UNREACHABLE_HINT,
    ]
    obj = _one_object(r.stdout)
    assert (obj["status"], obj["found"]) == ("unreachable", "unresolved")


def test_json_usage_error_is_one_object_too(kvpush_run) -> None:
    r = kvpush_run("probe", "127.0.0.1", "--json")
    assert r.returncode == 2
    assert r.err_lines[0] == "error: address '127.0.0.1' has no port"
    obj = _one_object(r.stdout)
    assert (obj["status"], obj["exit_status"]) == ("usage", 2)


@pytest.mark.parametrize("reader", ["grep -q healthy", "true"])
def test_probe_into_a_pipe_whose_reader_exits(pd_pair, reader: str) -> None:
    p, _ = pd_pair
    cmd = f"set -o pipefail; {shlex.join([*KVPUSH, 'probe', p.address, '--stats'])} | {reader}"
    r = subprocess.run(
        ["bash", "-c", cmd], capture_output=True, text=True, env=clean_env(), timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no traceback, no "Broken pipe", no "Exception ignored"

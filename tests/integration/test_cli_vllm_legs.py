"""``kvpush leg decode|prefill`` driving one leg of a vLLM push deployment, without vLLM; and
``drive``'s old spelling of the same legs (``--kv-transfer-params``, ``--request-id``), which
runs them after a one-line deprecation note.

* Bad input (a missing option, malformed or incomplete kv_transfer_params, drive's old
  spelling with options of a load run) is refused with one ``error:`` / ``hint:`` pair and
  exit 2, before any peer is contacted.
* A leg's endpoint is identified first: a vLLM engine (a listener that dies as vLLM's does on
  anything but ``get_meta_msg``), an endpoint of the other role, or a P on kvpush's own wire is
  refused with a typed error, and the vLLM listener got nothing but ``get_meta_msg``.
* Both legs end to end between two kvpush endpoints on vLLM's wire (a shared ``--compat-hash``):
  ``leg prefill`` prints the kv_transfer_params line at once, ``leg decode`` hands them to D,
  and both report the same sha256. A prefill leg nobody takes ends ``pending`` (exit 1).

The same legs against vLLM's own connector are in ``tests/vllm/test_wire_vllm.py``.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest

from tests.conftest import Done, Served, ServeFactory, run_cli
from tests.support.procs import KVPUSH, clean_env, wait_ready
from tests.support.side import counters, failures, gauges

USAGE, ERROR, NOT_READY, UNREACHABLE = 2, 1, 3, 69
HASH = "5" * 64
GEOM = ["--num-blocks", "16", "--layers", "2", "--block-bytes", "4096", "--kv-regions", "per-layer"]
PARAMS = {
    "remote_engine_id": "vllm-p-1",
    "remote_request_id": "cmpl-abc-0000aaaa",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "pp_size": 1,
    "transfer_mode": "push",
}
D, P = "127.0.0.1:5601", "127.0.0.1:5600"


def params(**change: object) -> str:
    out = {**PARAMS, **change}
    return json.dumps({k: v for k, v in out.items() if v is not None})


# ------------------------------------------------------------------ refused before any contact

CASES = [
    (
        ["decode", "--kv-transfer-params", params()],
        [
            "error: Missing option '--decode' / '-d' (env var: 'KVPUSH_LEG_DECODE').",
            "hint: see 'kvpush leg decode --help'",
        ],
    ),
    (
        ["decode", "-d", D, "--kv-transfer-params", "{not json"],
        [
            "error: --kv-transfer-params is not valid JSON: Expecting property name enclosed "
            "in double quotes at line 1 column 2",
            "hint: pass the map a vLLM P's request_finished returns (the kv_transfer_params of "
            'its response), e.g. \'{"remote_engine_id": ..., "remote_host": ...}\'',
        ],
    ),
    (
        ["decode", "-d", D, "--kv-transfer-params", params(remote_host=None, tp_size=None)],
        [
            "error: --kv-transfer-params lacks remote_host, tp_size",
            "hint: a push-mode vLLM P returns remote_engine_id, remote_request_id, remote_host, "
            "remote_port, tp_size and pp_size: pass its kv_transfer_params unchanged",
        ],
    ),
    (
        ["decode", "-d", D, "--kv-transfer-params", params(remote_port="5600"), "--blocks", "2"],
        [
            "error: --kv-transfer-params: remote_port must be an integer in 1..65535, got '5600'",
            "hint: pass the kv_transfer_params a vLLM P returned, unchanged",
        ],
    ),
    (
        ["decode", "-d", D, "--kv-transfer-params", params(transfer_mode="pull")],
        [
            "error: --kv-transfer-params are for transfer_mode 'pull'",
            "hint: kvpush speaks vLLM's push mode (NixlPushConnector)",
        ],
    ),
    (
        ["decode", "-d", D, "--kv-transfer-params", "[1, 2]"],
        [
            "error: --kv-transfer-params must be a JSON object, not list",
            "hint: pass the map a vLLM P's request_finished returns",
        ],
    ),
    (
        ["decode", "-d", D, "--kv-transfer-params", params()],
        [
            "error: these kv_transfer_params do not say how many blocks P holds",
            "hint: pass --blocks N (the request's prompt blocks)",
        ],
    ),
    (
        ["decode", "-d", D, "--kv-transfer-params", params(remote_block_ids=[[3, 4, 5]]),
         "--blocks", "2"],
        [
            "error: --blocks 2 but P holds 3 blocks for this request",
            "hint: drop --blocks: D must allocate exactly P's block count",
        ],
    ),
    (
        ["decode", "-d", D, "--kv-transfer-params", params(), "--blocks", "2", "--alloc-delay",
         "-1"],
        [
            "error: --alloc-delay must be in 0..3600 seconds, got -1",
            "hint: pass how long D should hold the request before it gets blocks",
        ],
    ),
    (
        ["prefill", "-p", P, "--request-id", "cmpl-1"],
        [
            "error: Missing option '--blocks' (env var: 'KVPUSH_LEG_BLOCKS').",
            "hint: see 'kvpush leg prefill --help'",
        ],
    ),
    (
        ["prefill", "-p", P, "--request-id", "", "--blocks", "2"],
        ["error: --request-id is empty", "hint: pass the request id the vLLM D will use"],
    ),
    (
        ["prefill", "-p", P, "--request-id", "cmpl-1", "--blocks", "0"],
        ["error: --blocks must be in 1..65536, got 0", "hint: pass --blocks between 1 and 65536"],
    ),
    (
        ["prefill", "-p", P, "--request-id", "cmpl-1", "--blocks", "2", "--alloc-delay", "3"],
        ["error: No such option: --alloc-delay", "hint: see 'kvpush leg prefill --help'"],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("args", "lines"), CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_one_error_and_hint(args: list[str], lines: list[str]) -> None:
    r = run_cli("leg", *args)
    assert r.err_lines == lines, r.stderr
    assert r.returncode == USAGE
    assert "Traceback" not in r.stderr and r.stdout == ""


def _deprecated(flag: str, leg: str) -> str:
    return f"drive: note: 'drive {flag}' is deprecated: run 'kvpush leg {leg}' (the same options)"


OLD_SPELLING = [
    (
        ["-d", D, "--kv-transfer-params", params(), "--blocks", "2", "-n", "5"],
        [
            "error: drive --kv-transfer-params runs one vLLM leg, which takes no --requests",
            "hint: run 'kvpush leg decode --decode HOST:PORT ...' (see 'kvpush leg decode --help')",
        ],
    ),
    (
        ["-p", P, "-d", D, "--request-id", "cmpl-1", "--blocks", "2"],
        [
            "error: drive --request-id runs one vLLM leg, which takes no --decode",
            "hint: run 'kvpush leg prefill --prefill HOST:PORT ...' (see 'kvpush leg prefill "
            "--help')",
        ],
    ),
    (
        ["-d", D, "-d", "127.0.0.1:5602", "--kv-transfer-params", params()],
        [
            "error: drive --kv-transfer-params runs one vLLM leg, which takes one --decode, got 2",
            "hint: run 'kvpush leg decode --decode HOST:PORT ...' (see 'kvpush leg decode --help')",
        ],
    ),
    (
        ["-p", P, "--request-id", "cmpl-1"],
        [
            "error: --request-id needs --blocks N",
            "hint: pass the request's prompt blocks: the vLLM D must allocate as many",
        ],
    ),
    (
        ["-p", P, "-d", D, "--alloc-delay", "3"],
        [
            "error: --alloc-delay applies to one vLLM leg, not to a load run",
            "hint: run 'kvpush leg decode --alloc-delay SECONDS ...'",
        ],
    ),
    (
        ["-p", P],
        [
            "error: drive needs --decode HOST:PORT",
            "hint: a load run takes --prefill and --decode endpoints; one vLLM leg is 'kvpush "
            "leg decode' or 'kvpush leg prefill'",
        ],
    ),
]


@pytest.mark.parametrize(
    ("args", "lines"), OLD_SPELLING, ids=[" ".join(c[0])[:60] for c in OLD_SPELLING]
)
def test_drives_old_spelling_of_a_leg_is_checked(args: list[str], lines: list[str]) -> None:
    r = run_cli("drive", *args)
    assert r.err_lines == lines, r.stderr
    assert r.returncode == USAGE and r.stdout == ""
    flag = next((f for f in ("--kv-transfer-params", "--request-id") if f in args), None)
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("drive: note:")]
    leg = "decode" if flag == "--kv-transfer-params" else "prefill"
    assert notes == ([_deprecated(flag, leg)] if flag else [])


def test_params_from_a_file_stdin_or_a_whole_response(tmp_path, free_port: int) -> None:
    """Every way of passing the map reaches the peer (here: nobody listens, exit 69)."""
    d = f"127.0.0.1:{free_port}"
    f = tmp_path / "params.json"
    f.write_text(params(remote_block_ids=[[1, 2]]))
    refused = [f"error: {d}: connection refused"]
    assert (
        run_cli("leg", "decode", "-d", d, "--kv-transfer-params", str(f)).err_lines[:1] == refused
    )
    p = subprocess.run(
        [*KVPUSH, "leg", "decode", "-d", d, "--kv-transfer-params", "-", "--blocks", "2"],
        input=json.dumps({"id": "cmpl-1", "kv_transfer_params": PARAMS}),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("error:")] == refused
    assert p.returncode == UNREACHABLE
    r = run_cli("leg", "decode", "-d", d, "--kv-transfer-params", str(tmp_path / "none.json"))
    assert r.err_lines == [
        f"error: cannot read --kv-transfer-params file {tmp_path / 'none.json'}: "
        "No such file or directory",
        "hint: pass the JSON object itself, the path of a file holding it, or - for stdin",
    ]
    f.write_text("{")
    assert run_cli("leg", "decode", "-d", d, "--kv-transfer-params", str(f)).err_lines[0] == (
        f"error: --kv-transfer-params file {f} is not valid JSON: Expecting property name "
        "enclosed in double quotes at line 1 column 2"
    )


def test_drives_old_spelling_still_runs_the_leg(tmp_path, free_port: int) -> None:
    """``drive -d D --kv-transfer-params ...`` (deprecated) says so in one line on stderr and
    runs the leg as ``leg decode`` does: here it reaches the peer, which nobody serves."""
    d = f"127.0.0.1:{free_port}"
    r = run_cli("drive", "-d", d, "--kv-transfer-params", params(), "--blocks", "2")
    assert r.err_lines[:1] == [f"error: {d}: connection refused"]
    assert r.returncode == UNREACHABLE
    assert r.stderr.splitlines()[0] == _deprecated("--kv-transfer-params", "decode")
    r = run_cli("drive", "-p", d, "--request-id", "cmpl-1", "--blocks", "2")
    assert r.err_lines[:1] == [f"error: {d}: connection refused"]
    assert r.stderr.splitlines()[0] == _deprecated("--request-id", "prefill")


def test_options_read_their_variables(make_env) -> None:
    env = make_env(KVPUSH_LEG_DECODE=D, KVPUSH_KV_TRANSFER_PARAMS="{", KVPUSH_ALLOC_DELAY="1")
    assert (
        run_cli("leg", "decode", env=env)
        .err_lines[0]
        .startswith("error: --kv-transfer-params is not valid JSON")
    )
    env = make_env(KVPUSH_LEG_PREFILL=P, KVPUSH_REQUEST_ID="cmpl-1", KVPUSH_LEG_BLOCKS="0")
    r = run_cli("leg", "prefill", env=env)
    assert r.err_lines[0] == "error: --blocks must be in 1..65536, got 0"
    # drive's old spelling has no variables: a leg's never turns a load run into a leg
    r = run_cli("drive", "-p", P, env=make_env(KVPUSH_KV_TRANSFER_PARAMS=params()))
    assert r.err_lines[0] == "error: drive needs --decode HOST:PORT"


# ------------------------------------------------------------------ the wrong peer


class VllmLikeListener:
    """vLLM 0.33's side-channel listener in behaviour: three frames, a msgpack 3-sequence,
    a reply per (pp, tp); anything else kills the thread for good, as it kills vLLM's."""

    def __init__(self) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.requests: list[object] = []
        self.died: BaseException | None = None
        self._stop = threading.Event()
        md = {"engine_id": "vllm-engine-9", "agent_metadata": b"", "num_blocks": 16}
        self.payload = msgspec.msgpack.encode(
            {"compatibility_hash": HASH, "agent_metadata_bytes": msgspec.msgpack.encode(md)}
        )
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        import zmq

        try:
            while not self._stop.is_set():
                if not self.sock.poll(50, zmq.POLLIN):
                    continue
                identity, _, msg = self.sock.recv_multipart()
                tag, pp, tp = msgspec.msgpack.decode(msg)
                self.requests.append(tag)
                reply = {(0, 0): self.payload}[(pp, tp)]
                ts = msgspec.msgpack.encode(time.perf_counter())
                self.sock.send_multipart((identity, b"", reply, ts))
        except BaseException as e:
            self.died = e

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def vllm_like() -> Iterator[VllmLikeListener]:
    f = VllmLikeListener()
    yield f
    f.close()


def test_a_vllm_engine_named_as_a_leg_gets_only_get_meta(vllm_like: VllmLikeListener) -> None:
    a = vllm_like.address
    r = run_cli("leg", "decode", "-d", a, "--kv-transfer-params", params(), "--blocks", "2")
    assert r.err_lines == [
        f"error: {a} is a vLLM engine's side channel, not a kvpush decode endpoint; nothing "
        "but get_meta_msg was sent to it",
        "hint: a vLLM D gets kv_transfer_params from its router: give --decode a kvpush D "
        "(serve-decode --wire vllm --like <vLLM P>)",
    ]
    assert r.returncode == NOT_READY
    r = run_cli("leg", "prefill", "-p", a, "--request-id", "cmpl-1", "--blocks", "2")
    assert r.err_lines[0] == (
        f"error: {a} is a vLLM engine's side channel, not a kvpush prefill endpoint; nothing "
        "but get_meta_msg was sent to it"
    )
    assert r.returncode == NOT_READY
    assert vllm_like.died is None and vllm_like.thread.is_alive()
    assert vllm_like.requests == [b"get_meta_msg", b"get_meta_msg"]


@pytest.mark.integration
def test_wrong_role_and_wrong_wire_are_refused(serve: ServeFactory) -> None:
    kp = serve.start("prefill", *GEOM)  # kvpush's own wire
    r = run_cli(
        "leg", "decode", "-d", kp.address, "--kv-transfer-params", params(), "--blocks", "2"
    )
    assert r.err_lines == [
        f"error: {kp.address} is a prefill endpoint, not decode",
        "hint: give --decode a decode endpoint",
    ]
    assert r.returncode == USAGE
    r = run_cli("leg", "prefill", "-p", kp.address, "--request-id", "cmpl-1", "--blocks", "2")
    assert r.err_lines == [
        f"error: {kp.address} is a kvpush P on kvpush's own wire: it cannot push into a vLLM D",
        "hint: start it with serve-prefill --wire vllm --like <vLLM D>",
    ]
    assert r.returncode == NOT_READY


# ------------------------------------------------------------------ both legs, end to end


@pytest.fixture(scope="module")
def vllm_wire_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Served]]:
    """A kvpush P and D on vLLM's wire with one compatibility hash: each stands in for the vLLM
    side the other expects."""
    f = ServeFactory(tmp_path_factory.mktemp("legs"))
    try:
        common = [*GEOM, "--wire", "vllm", "--compat-hash", HASH, "--lease", "6"]
        p = f.start("prefill", *common, wait=False)
        d = f.start("decode", *common, "--heartbeat", "1", wait=False)
        wait_ready(p)
        wait_ready(d)
        yield p, d
    finally:
        f.close()


def _prefill_leg(p: Served, request_id: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``leg prefill`` and return it with the first stdout line (the params)."""
    proc = subprocess.Popen(
        [*KVPUSH, "leg", "prefill", "-p", p.address, "--request-id", request_id, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=clean_env(),
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline()


def _finish(proc: subprocess.Popen[str], first: str) -> Done:
    out, err = proc.communicate(timeout=60)
    return Done(proc.returncode, first + out, err)


@pytest.mark.integration
def test_prefill_leg_then_decode_leg(vllm_wire_pair: tuple[Served, Served], tmp_path) -> None:
    p, d = vllm_wire_pair
    proc, first = _prefill_leg(p, "cmpl-e2e-00000000", "--blocks", "3", "--timeout", "30")
    handed = json.loads(first)  # printed before the push: what a router hands the vLLM D
    assert proc.poll() is None
    assert handed["remote_request_id"] == "cmpl-e2e-00000000" and handed["tp_size"] == 1
    assert handed["remote_engine_id"] == p.engine_id and handed["transfer_mode"] == "push"
    f = tmp_path / "params.json"
    f.write_text(first)
    dr = run_cli("leg", "decode", "-d", d.address, "--kv-transfer-params", str(f), "--json")
    assert dr.returncode == 0, dr.stderr
    dec = json.loads(dr.stdout)
    pr = _finish(proc, first)
    assert pr.returncode == 0, pr.stderr
    lines = pr.stdout.splitlines()
    assert lines[0] == first.strip()
    assert lines[1] == "prefill leg  ok"
    assert pr.stderr.strip() == (
        "leg: hand these kv_transfer_params to the vLLM D; waiting up to 30s for its push"
    )
    sha = next(ln.split()[1] for ln in lines if ln.startswith("sha256"))
    assert dec["outcome"] == "ok" and dec["sha256"] == sha and len(sha) == 64
    assert dec["nbytes"] == 3 * 2 * 4096  # blocks x regions x block bytes
    assert dec["request_id"].rsplit("-", 1)[0] == "cmpl-e2e"  # shares P's base id


@pytest.mark.integration
def test_decode_leg_plain_report(vllm_wire_pair: tuple[Served, Served]) -> None:
    p, d = vllm_wire_pair
    proc, first = _prefill_leg(p, "cmpl-plain-00000000", "--blocks", "2", "--json")
    dr = run_cli(
        "leg", "decode", "-d", d.address, "--kv-transfer-params", first, "--alloc-delay", "1"
    )
    pr = _finish(proc, first)
    assert dr.returncode == 0 and pr.returncode == 0, dr.stderr + pr.stderr
    rows = [ln.split(None, 1) for ln in dr.stdout.splitlines()]
    assert [r[0] for r in rows] == ["decode", "D", "P", "request", "received", "sha256"]
    assert rows[0][1] == "leg  ok" and rows[1][1] == d.address
    assert rows[2][1] == f"{p.engine_id} at {p.address} (tp 1)"
    assert rows[4][1].startswith("16.38 kB (16384 bytes) in ")
    report = json.loads(pr.stdout.splitlines()[1])  # --json: params line, then the report
    assert report["outcome"] == "ok" and report["sha256"] == rows[5][1]
    assert pr.stderr == ""


@pytest.mark.integration
def test_prefill_leg_nobody_takes_is_pending(vllm_wire_pair: tuple[Served, Served]) -> None:
    p, _ = vllm_wire_pair
    proc, first = _prefill_leg(p, "cmpl-lapse-00000000", "--blocks", "1", "--timeout", "1")
    pr = _finish(proc, first)
    assert pr.returncode == ERROR
    assert pr.stdout.splitlines()[1] == "prefill leg  pending: deadline"
    assert "detail       no D wrote it in time" in pr.stdout


@pytest.mark.integration
def test_prefill_leg_into_a_d_of_twice_the_tp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM's wire, D_tp = 2 x P_tp: both D ranks send a PUSH_REG that names no rank; P's
    first stands for both (a full handshake of each rank, then each its half of every page,
    as vLLM's own P does) and the second is absorbed -- no duplicate, nothing refused."""
    f = ServeFactory(tmp_path_factory.mktemp("fanout"))
    model = ["--block-tokens", "16", "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp16"]
    common = [*model, "--num-blocks", "16", "--layers", "2", "--kv-regions", "per-layer"]
    common += ["--wire", "vllm", "--compat-hash", HASH, "--lease", "6"]
    try:
        p = f.start("prefill", *common, wait=False)
        d = f.start("decode", *common, "--tp", "2", wait=False)
        wait_ready(p)
        wait_ready(d)
        proc, first = _prefill_leg(p, "cmpl-fan-00000000", "--blocks", "3", "--json")
        dr = run_cli("leg", "decode", "-d", d.address, "--kv-transfer-params", first, "--json")
        pr = _finish(proc, first)
        assert dr.returncode == 0 and pr.returncode == 0, dr.stdout + dr.stderr + pr.stderr
        dec = json.loads(dr.stdout)
        pushed = json.loads(pr.stdout.splitlines()[1])
        page = 16 * 2 * 16 * 2 * 2  # tokens x heads x head dim x (K, V) x fp16: the model's
        assert dec["outcome"] == "ok" and pushed["outcome"] == "ok", (dec, pushed)
        assert dec["nbytes"] == pushed["nbytes"] == 3 * 2 * page
        # D's two ranks together hold the model's page: the digest of what P pushed
        assert dec["sha256"] == pushed["sha256"] and len(dec["sha256"]) == 64, (dec, pushed)
        c = counters(p.address)
        assert c["push_regs_received"] == 2 and c["pushes_ok"] == 1, c
        assert c["handshakes_ok"] == 2, c  # a full handshake of each D rank
        assert failures(p.address) == {} and failures(d.address) == {}
        g = gauges(d.address)
        assert g["pool_free"] == g["pool_total"], g  # the held shares were freed
    finally:
        f.close()

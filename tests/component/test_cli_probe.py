"""``kvpush probe`` against real endpoints (and a stand-in for a vLLM side channel)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush.wire import vllm
from tests.conftest import unused_port
from tests.support.procs import Launcher

pytestmark = pytest.mark.integration


def test_healthy_json(pd_pair, kvpush_run) -> None:
    p, _ = pd_pair
    r = kvpush_run("probe", p.address, "--json", "--count", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    md = out["metadata"]
    assert out["kind"] == "kvpush" and out["status"] == "healthy"
    assert md["engine_id"] == p.info["engine_id"]
    assert md["incarnation"] == p.info["incarnation"]
    assert md["role"] == "prefill"
    assert (md["num_blocks"], md["layers"], md["regions"], md["block_bytes"]) == (64, 2, 4, 4096)
    assert out["rtt"]["samples"] == 3
    assert 0 < out["rtt"]["min_s"] <= out["rtt"]["median_s"] < 1.0
    assert abs(out["rtt"]["clock_offset_s"]) < 0.5  # same host, same clock
    assert out["compatible"] is None  # no local geometry given
    assert len(out["compat_hash"]) == 32


def test_human_output(pd_pair, kvpush_run) -> None:
    _, d = pd_pair
    r = kvpush_run("probe", d.address, "--layers", "2", "--block-bytes", "4096")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"kvpush endpoint at {d.address}: healthy"
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:] if ln.strip()}
    assert "decode" in lines["role"]
    assert lines["compatible"].split()[1] == "yes"
    assert "64 blocks × 4 regions (2 layers × K/V) × 4 KiB" in r.stdout


def test_no_color(pd_pair, kvpush_run, make_env) -> None:
    p, _ = pd_pair
    r = kvpush_run(
        "probe", p.address, env=make_env(FORCE_COLOR="1", NO_COLOR="1", TERM="xterm-256color")
    )
    assert r.returncode == 0
    assert "\x1b[" in r.stdout  # styles (bold, dim) stay under FORCE_COLOR ...
    assert not re.search(r"\x1b\[[0-9;]*(3[0-8]|9[0-7])m", r.stdout)  # ... colours do not


def test_incompatible_names_fields(pd_pair, kvpush_run) -> None:
    p, _ = pd_pair
    # Local settings are what serve would use: given options, then defaults (layers 4).
    r = kvpush_run(
        "probe", p.address, "--layers", "2", "--block-bytes", "8192", "--dtype", "float16"
    )
    assert r.returncode == 3
    assert "INCOMPATIBLE" in r.stdout.splitlines()[0]
    assert "block_bytes: local 8192, remote 4096" in r.stdout
    assert "dtype: local float16, remote bfloat16" in r.stdout
    assert "layers:" not in r.stdout
    r = kvpush_run("probe", p.address, "--layers", "4", "--block-bytes", "4096", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 3
    assert {d["field"]: (d["local"], d["remote"]) for d in out["differences"]} == {
        "layers": (4, 2),
        "regions": (8, 4),
    }


def test_model_like_geometry_compares_block_bytes(pd_pair, kvpush_run) -> None:
    p, _ = pd_pair
    # 16 tokens x 1 head x 128 dim x 2 bytes = 4096 B: compatible
    r = kvpush_run(
        "probe",
        p.address,
        "--layers",
        "2",
        "--block-tokens",
        "16",
        "--kv-heads",
        "1",
        "--head-dim",
        "128",
        "--json",
    )
    assert r.returncode == 0, r.stdout
    assert json.loads(r.stdout)["compatible"] is True


def test_handshake_and_ping(pd_pair, kvpush_run) -> None:
    p, _ = pd_pair
    r = kvpush_run("probe", p.address, "--handshake", "full", "--ping", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["handshake_mode"] == "full"
    t = out["handshake_timings_s"]
    assert {"side_channel_s", "load_s", "prep_s", "total_s"} <= set(t)
    assert all(v >= 0 for v in t.values())
    assert len(out["ping_s"]) == 5 and all(0 < x < 5 for x in out["ping_s"])
    r = kvpush_run("probe", p.address, "--handshake", "notif")
    assert r.returncode == 0, r.stderr
    assert "handshake (notif)" in r.stdout


def test_stats(pd_pair, kvpush_run) -> None:
    _, d = pd_pair
    r = kvpush_run("probe", d.address, "--stats", "--json")
    out = json.loads(r.stdout)
    assert out["stats"]["role"] == "decode"
    assert out["stats"]["gauges"]["pool_total"] == 64
    r = kvpush_run("probe", d.address, "--stats")
    assert "Handshakes" in r.stdout and "Pool" in r.stdout
    # Only what applies to a D: no writer mode, no pushes; its D->P handshake mode instead.
    (header,) = [ln for ln in r.stdout.splitlines() if ln.startswith("kvpush decode")]
    assert "writer" not in header and "handshake notif" in header
    assert "pushes/s" not in r.stdout and "requests/s" in r.stdout
    p, _ = pd_pair
    r = kvpush_run("probe", p.address, "--stats")
    (header,) = [ln for ln in r.stdout.splitlines() if ln.startswith("kvpush prefill")]
    assert "writer deferred" in header and "handshake" not in header


def test_kvpush_peer_identified_at_first_contact(pd_pair, kvpush_run) -> None:
    p, _ = pd_pair
    r = kvpush_run("probe", p.address, "--json", "--count", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kind"] == "kvpush"
    assert out["metadata"]["wire"] == "kvpush"
    assert out["metadata"]["ranks"] == [[0, 0]]


HASH = "5" * 64  # a vLLM compatibility hash is 64 hex digits


class FakeVllmListener:
    """vLLM 0.33's listener loop, line for line in behaviour (``_nixl_handshake_listener``):
    exactly three frames, a msgpack 3-sequence, the reply looked up by (pp, tp). Anything else
    raises and the thread dies for good, as vLLM's does. ``alive`` tells whether it survived."""

    def __init__(self) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.requests = 0
        self.died: BaseException | None = None
        self._stop = threading.Event()
        # A real NIXL agent's metadata (of an agent in this process that nobody uses), so a
        # probe's --handshake loads what a vLLM engine's answer would hold.
        import torch

        from kvpush.config import AgentConfig
        from kvpush.transport.nixl import NixlAgent

        self.agent = NixlAgent(f"vllm-fake-{self.port}", AgentConfig())
        self.kv = torch.zeros((2, 16, 4096), dtype=torch.uint8)  # two regions, 16 blocks
        self.agent.register(self.kv)
        base = self.kv.data_ptr()
        md = vllm.AgentMetadata(
            engine_id="vllm-engine-7",
            agent_metadata=self.agent.metadata_full(),
            kv_caches_base_addr=[base, base + 16 * 4096],
            device_id=0,
            num_blocks=16,
            block_lens=[4096, 4096],
            kv_cache_layout="HND",
            block_size=16,
            attn_backend_name="FLASH_ATTN",
        )
        self.payload = msgspec.msgpack.encode(
            vllm.HandshakePayload(
                compatibility_hash=HASH, agent_metadata_bytes=msgspec.msgpack.encode(md)
            )
        )
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _run(self) -> None:
        import zmq

        encoded = {(0, 0): self.payload}
        try:
            while not self._stop.is_set():
                if not self.sock.poll(50, zmq.POLLIN):
                    continue
                identity, _, msg = self.sock.recv_multipart()  # 3 frames or ValueError
                _tag, pp, tp = msgspec.msgpack.decode(msg)  # msgpack 3-sequence or dies
                self.requests += 1
                ts = msgspec.msgpack.encode(time.perf_counter())
                self.sock.send_multipart((identity, b"", encoded[(pp, tp)], ts))  # KeyError
        except BaseException as e:
            self.died = e

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()
        self.agent.close()


@pytest.fixture
def vllm_listener():
    f = FakeVllmListener()
    yield f
    f.close()


def test_vllm_listener_identified(vllm_listener, kvpush_run) -> None:
    r = kvpush_run("probe", f"127.0.0.1:{vllm_listener.port}", "--json", "--count", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    md = out["metadata"]
    assert out["kind"] == "vllm" and out["compat_hash"] == HASH
    assert md["engine_id"] == "vllm-engine-7"
    assert md["block_lens"] == [4096, 4096]
    assert md["kv_cache_layout"] == "HND"
    assert md["block_size"] == 16
    assert md["agent_metadata_bytes"] == len(vllm_listener.agent.metadata_full())
    assert md["regions"] == 2
    assert out["rtt"]["samples"] == 3
    assert vllm_listener.alive, vllm_listener.died
    assert vllm_listener.requests == 4  # identify + 3 samples, nothing but get_meta_msg


def test_vllm_listener_plain_output(vllm_listener, kvpush_run) -> None:
    r = kvpush_run("probe", f"127.0.0.1:{vllm_listener.port}", "--timeout", "0.5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"vllm endpoint at 127.0.0.1:{vllm_listener.port}: healthy"
    assert "vllm-engine-7" in r.stdout and "FLASH_ATTN" in r.stdout
    assert "only get_meta_msg was sent" in r.stdout
    assert vllm_listener.alive, vllm_listener.died


def test_vllm_listener_survives_every_probe_mode(vllm_listener, kvpush_run) -> None:
    addr = f"127.0.0.1:{vllm_listener.port}"
    for args in (
        (),
        ("--json",),
        ("--stats",),
        ("--handshake", "notif"),
        ("--handshake", "full"),
        ("--layers", "2", "--block-bytes", "32768"),
    ):
        # A bound, not a speed claim: a probe slower than 2 s on a loaded host is no failure.
        r = kvpush_run("probe", addr, "--timeout", "10", *args)
        assert r.returncode in (0, 3), (args, r.stdout, r.stderr)
        assert vllm_listener.alive, (args, vllm_listener.died)
    # Refused before anything is sent: a NIXL ping (a foreign notification kills a vLLM engine),
    # and a rank the engine may not serve (vLLM's listener dies on it: KeyError).
    for args in (("--ping", "2"), ("--ranks", "0,1"), ("--ranks", "0,1", "--peer-tp", "1")):
        r = kvpush_run("probe", addr, "--timeout", "10", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert vllm_listener.alive, (args, vllm_listener.died)  # it got get_meta_msg (0,0) only
    r = kvpush_run("probe", addr, "--ranks", "0,1", "--peer-tp", "2", "--timeout", "1")
    # Told it serves rank 1 (it does not): this fake, like vLLM, dies -- the operator's word.
    assert r.returncode == 69 and not vllm_listener.alive, r.stderr


def test_auth_token(serve, kvpush_run, tmp_path) -> None:
    tok = tmp_path / "token"
    tok.write_text("0123456789abcdef0123456789abcdef\n")
    tok.chmod(0o600)
    s = serve.start(
        "prefill",
        "--num-blocks",
        "8",
        "--layers",
        "1",
        "--block-bytes",
        "4096",
        "--auth-token-file",
        str(tok),
    )
    r = kvpush_run("probe", s.address, "--json", "--auth-token-file", str(tok))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["metadata"]["auth"] is True
    r = kvpush_run("probe", s.address, "--timeout", "1")
    assert r.returncode == 3
    assert r.err_lines == [
        f"error: {s.address} is a kvpush endpoint that requires an auth token",
        "hint: pass --auth-token-file with the token the peer uses",
    ]


# --- tensor-parallel peers --------------------------------------------------------------------

TP_GEOMETRY = ["--layers", "2", "--block-tokens", "16", "--kv-heads", "2", "--head-dim", "64"]


@pytest.fixture(scope="module")
def tp_prefill(tmp_path_factory):
    """A prefill endpoint at TP 2 (each rank holds one of the two KV heads), served by the CLI
    with -o json lines and /metrics."""
    f = Launcher(tmp_path_factory.mktemp("tp"))
    try:
        metrics = ["--metrics-port", str(unused_port())]
        yield f.serve("prefill", "--tp", "2", "--num-blocks", "16", *metrics, *TP_GEOMETRY)
    finally:
        f.close()


def test_tp_peer_lists_its_ranks(tp_prefill, kvpush_run) -> None:
    r = kvpush_run("probe", tp_prefill.address, "--json", "--count", "2")
    assert r.returncode == 0, r.stderr
    md = json.loads(r.stdout)["metadata"]
    assert md["ranks"] == [[0, 0], [0, 1]] and md["tp_size"] == 2 and md["tp_rank"] == 0
    assert md["block_bytes"] == 2048  # one head of the model's two: rank 0's share
    r = kvpush_run("probe", tp_prefill.address, *TP_GEOMETRY)
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:] if ln.strip()}
    assert lines["ranks"].split(None, 1)[1] == "0..1 (tp 2), describing rank 0"
    assert lines["compatible"].split()[1] == "yes"  # the model's page: 4096 B on both sides


def test_tp_peer_probed_at_another_rank(tp_prefill, kvpush_run) -> None:
    r = kvpush_run("probe", tp_prefill.address, "--ranks", "0,1", "--json", "--count", "2")
    assert r.returncode == 0, r.stderr
    md = json.loads(r.stdout)["metadata"]
    assert md["tp_rank"] == 1 and md["agent_name"].endswith(".r1")
    # A real handshake (its geometry read from the peer) and NIXL pings, with rank 1.
    r = kvpush_run(
        "probe", tp_prefill.address, "--ranks", "0,1", "--handshake", "full", "--ping", "2",
        "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["handshake_mode"] == "full" and out["handshake_timings_s"]["total_s"] > 0
    assert len(out["ping_s"]) == 2
    r = kvpush_run("probe", tp_prefill.address, "--ranks", "0,1", "--handshake", "notif",
                   *TP_GEOMETRY)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "describing rank 1" in r.stdout and "handshake (notif)" in r.stdout
    # All of it reached rank 1: it served the handshakes and answered the pings (after a
    # handshake of its own back to the probe); rank 0 did neither.
    r = kvpush_run("probe", tp_prefill.address, "--stats", "--json", "--count", "1")
    rank0, rank1 = (s["counters"] for s in json.loads(r.stdout)["stats"]["ranks"])
    assert rank1["handshakes_served"] >= 2 + 2 + 1 and rank1["handshakes_started"] >= 1
    assert rank0.get("handshakes_started", 0) == 0


def test_tp_peer_refuses_a_rank_it_lacks(tp_prefill, kvpush_run) -> None:
    r = kvpush_run("probe", tp_prefill.address, "--ranks", "0,2")
    assert r.returncode == 3
    assert r.err_lines == [
        f"error: {tp_prefill.address} does not serve rank 0,2: it serves ranks 0..1 (tp 2)",
        "hint: ask for a rank it serves, e.g. --ranks 0,1",
    ]


def test_tp_peer_stats_json_lines_and_metrics_show_each_rank(tp_prefill, kvpush_run) -> None:
    r = kvpush_run("probe", tp_prefill.address, "--stats", "--json")
    stats = json.loads(r.stdout)["stats"]
    assert [s["info"]["rank"] for s in stats["ranks"]] == [0, 1]
    assert [s["gauges"]["pool_total"] for s in stats["ranks"]] == [16, 16]
    assert stats["gauges"]["pool_total"] == 32
    r = kvpush_run("probe", tp_prefill.address, "--stats")
    assert "Ranks" in r.stdout and "tp 2" in r.stdout
    # serve's own -o json lines carry the ranks too.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(ln) for ln in tp_prefill.log_text().splitlines() if ln.startswith("{")]
        if lines:
            break
        time.sleep(0.2)
    assert lines and [len(d["ranks"]) for d in lines][-1] == 2
    assert lines[-1]["ranks"][1]["info"]["rank"] == 1
    # And its /metrics: rank-level series per rank, the request-level count once.
    with urllib.request.urlopen(tp_prefill.info["metrics"], timeout=5) as resp:
        page = resp.read().decode()
    samples = [s for f in text_string_to_metric_families(page) for s in f.samples]
    pool = {s.labels["rank"]: s.value for s in samples if s.name == "kvpush_pool_capacity_blocks"}
    assert pool == {"0": 16, "1": 16}
    (prefills,) = [s for s in samples if s.name == "kvpush_prefills_total"]
    assert "rank" not in prefills.labels
    served = [s for s in samples if s.name == "kvpush_handshakes_served_total"]
    assert sorted(s.labels["rank"] for s in served) == ["0", "1"]

"""``kvpush probe`` against real endpoints (and a stand-in for a vLLM side channel)."""

from __future__ import annotations

import json
import re
import threading
import time

import msgspec
import pytest

from kvpush import protocol

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


def test_vllm_form_against_kvpush(pd_pair, kvpush_run) -> None:
    p, _ = pd_pair
    r = kvpush_run("probe", p.address, "--vllm", "--json", "--count", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kind"] == "vllm"
    md = out["metadata"]
    assert md["engine_id"] == p.info["engine_id"]
    assert md["attn_backend_name"] == "kvpush"
    assert md["block_lens"] == [4096] * 4
    assert md["kv_caches_base_addr"] == 4
    assert md["agent_metadata_bytes"] > 0


class FakeVllmListener:
    """A stand-in for vLLM's NixlConnector side channel: a ROUTER that answers get_meta_msg
    with vLLM's two-part reply and, like vLLM, never answers anything else."""

    def __init__(self) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.ignored = 0
        self._stop = threading.Event()
        md = protocol.VllmAgentMetadata(
            engine_id="vllm-engine-7",
            agent_metadata=b"\x00" * 300,
            kv_caches_base_addr=[1 << 40, 2 << 40],
            device_id=3,
            num_blocks=1000,
            block_lens=[32768, 32768],
            kv_cache_layout="HND",
            block_size=16,
            attn_backend_name="FLASH_ATTN",
        )
        self.payload = msgspec.msgpack.encode(
            protocol.VllmHandshakePayload(
                compatibility_hash="abc123", agent_metadata_bytes=msgspec.msgpack.encode(md)
            )
        )
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            if not self.sock.poll(50, zmq.POLLIN):
                continue
            ident, _, msg = self.sock.recv_multipart()[:3]
            try:
                ok = msgspec.msgpack.decode(msg)[0] == protocol.VLLM_GET_META
            except Exception:
                ok = False
            if not ok:
                self.ignored += 1
                continue
            self.sock.send_multipart(
                [ident, b"", self.payload, msgspec.msgpack.encode(time.perf_counter())]
            )

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def vllm_listener():
    f = FakeVllmListener()
    yield f
    f.close()


def test_vllm_listener_explicit(vllm_listener, kvpush_run) -> None:
    r = kvpush_run("probe", f"127.0.0.1:{vllm_listener.port}", "--vllm", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    md = out["metadata"]
    assert out["kind"] == "vllm" and out["compat_hash"] == "abc123"
    assert md["engine_id"] == "vllm-engine-7"
    assert md["block_lens"] == [32768, 32768]
    assert md["kv_cache_layout"] == "HND"
    assert md["block_size"] == 16
    assert md["agent_metadata_bytes"] == 300
    assert vllm_listener.ignored == 0  # --vllm never sent kvpush's form


def test_vllm_listener_auto_detected(vllm_listener, kvpush_run) -> None:
    r = kvpush_run("probe", f"127.0.0.1:{vllm_listener.port}", "--timeout", "0.5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"vllm endpoint at 127.0.0.1:{vllm_listener.port}: healthy"
    assert "vllm-engine-7" in r.stdout and "FLASH_ATTN" in r.stdout
    assert "no answer to kvpush's request form" in r.stdout


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
    assert r.err_lines[0].startswith(f"error: {s.address} refused the request: ")
    assert r.err_lines[1] == "hint: both sides must use the same --auth-token-file"

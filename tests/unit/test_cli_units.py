"""Pure parts of the CLI layer and its core helpers: no processes, no sockets."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvpush.commands.common import configfile, options, translate
from kvpush.commands.common.options import OutputMode
from kvpush.commands.common.stats import percentile
from kvpush.commands.drive.driver import DriveConfig, RequestResult, summarize
from kvpush.commands.probe.report import local_compat_fields, rtt_stats
from kvpush.commands.serve.command import choose_output, write_ready_file
from kvpush.config import PoolConfig
from kvpush.errors import ConfigError
from kvpush.wire.protocol import COMPAT_FIELDS


def test_envvar_names() -> None:
    assert options.envvar("--num-blocks") == "KVPUSH_NUM_BLOCKS"
    assert options.envvar("--progress-thread/--no-progress-thread") == "KVPUSH_PROGRESS_THREAD"


def test_percentile_nearest_rank() -> None:
    v = [float(i) for i in range(1, 101)]
    assert (percentile(v, 50), percentile(v, 90), percentile(v, 99)) == (50.0, 90.0, 99.0)
    assert percentile([], 50) == 0.0
    assert percentile([7.0], 99) == 7.0


def test_rtt_stats_keeps_lowest_rtt_sample_for_offset() -> None:
    # (t_send, t_recv, remote clock): second sample has the lowest RTT (0.1)
    st = rtt_stats([(0.0, 1.0, 10.0), (5.0, 5.1, 105.05), (9.0, 9.5, 0.0)])
    assert st.min_s == pytest.approx(0.1)
    assert st.median_s == pytest.approx(0.5)
    assert st.clock_offset_s == pytest.approx(100.0)


def _r(i: int, ok: bool, reason: str = "", verified: bool | None = True) -> RequestResult:
    return RequestResult(
        i,
        f"t-{i}",
        "p:1",
        f"d:{i % 2}",
        ok,
        reason,
        "",
        0.01 * (i + 1),
        4096 if ok else 0,
        verified if ok else None,
    )


def test_summarize() -> None:
    rep = summarize([_r(0, True), _r(1, True), _r(2, False, "decode_timeout")], elapsed_s=2.0)
    assert (rep.requests, rep.ok, rep.failed, rep.verified) == (3, 2, 1, 2)
    assert rep.failures_by_reason == {"decode_timeout": 1}
    assert rep.bytes_total == 8192 and rep.gb_per_s == pytest.approx(8192 / 2 / 1e9)
    assert rep.by_decode == {"d:0": 2, "d:1": 1}
    assert not rep.all_verified
    assert summarize([_r(0, True), _r(1, True)], 1.0).all_verified
    assert not summarize([_r(0, True, verified=None)], 1.0).all_verified


def test_drive_report_json_keys() -> None:
    """The keys drive --json has printed since the report began (a new field adds one);
    ``phases`` only where drive --trace measured some."""
    rep = summarize([_r(0, True), _r(1, False, "decode_timeout")], elapsed_s=1.0)
    d = rep.to_dict()
    assert set(d) == {
        "requests", "ok", "failed", "verified", "all_verified", "interrupted",
        "failures_by_reason", "first_failures", "latency_s", "elapsed_s", "requests_per_s",
        "bytes_total", "gb_per_s", "by_decode", "by_prefill", "concurrency", "notes",
        "peer_events",
    }  # fmt: skip
    assert d["all_verified"] is False and d["failures_by_reason"] == {"decode_timeout": 1}
    json.dumps(d)
    traced = replace(rep, phases={"sent": {"count": 1.0, "p50": 0.01}})
    assert traced.to_dict()["phases"] == {"sent": {"count": 1.0, "p50": 0.01}}


def test_drive_config_normalizes_and_validates() -> None:
    cfg = DriveConfig(prefill=("tcp://127.0.0.1:5600",), decode=("[::1]:5601",))
    assert cfg.prefill == ("127.0.0.1:5600",) and cfg.decode == ("[::1]:5601",)
    assert cfg.run_id
    with pytest.raises(ConfigError, match="no decode endpoint"):
        DriveConfig(prefill=("a:1",), decode=())
    with pytest.raises(ConfigError, match="--concurrency must be positive"):
        DriveConfig(prefill=("a:1",), decode=("b:2",), concurrency=0)


def test_local_compat_fields_cover_protocol_fields() -> None:
    f = local_compat_fields(PoolConfig(layers=3, block_bytes=8192))
    assert set(f) == set(COMPAT_FIELDS)
    assert (f["layers"], f["regions"], f["block_bytes"]) == (3, 6, 8192)


BASE = {"num_blocks": 8, "layers": 2, "device": "cpu", "dtype": "bfloat16", "kv_layout": "NHD"}


def test_pool_config_model_like_and_conflicts() -> None:
    p = translate.pool_config({**BASE, "block_tokens": 16, "kv_heads": 8, "head_dim": 128})
    assert p.block_bytes == 16 * 8 * 128 * 2
    with pytest.raises(ConfigError, match="--block-bytes and --block-tokens both set"):
        translate.pool_config(
            {**BASE, "block_bytes": 4096, "block_tokens": 16, "kv_heads": 1, "head_dim": 1}
        )
    assert translate.pool_config({**BASE, "block_bytes": None}).block_bytes == 65536


def test_config_values_sections_and_paths(tmp_path: Path) -> None:
    path = str(tmp_path / "k.toml")
    data = {
        "num_blocks": 8,
        "writer": "blocking",
        "auth_token_file": "tok",
        "backends": ["UCX", "POSIX"],
        "decode": {"handshake": "full"},
        "prefill": {"port": 1},
    }
    own = {"num_blocks", "handshake", "auth_token_file", "backends", "port"}
    known = own | {"writer"}
    out = configfile.config_values(data, path, "serve-decode", own, known)
    assert out == {
        "num_blocks": 8,
        "auth_token_file": str(tmp_path / "tok"),
        "backends": "UCX,POSIX",
        "handshake": "full",
    }
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        configfile.config_values({"bogus": 1}, path, "serve-decode", own, known)


def test_write_ready_file_is_atomic_json(tmp_path: Path) -> None:
    target = tmp_path / "ready.json"
    write_ready_file(str(target), {"address": "127.0.0.1:1", "pid": 1})
    assert json.loads(target.read_text()) == {"address": "127.0.0.1:1", "pid": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]


def test_choose_output_explicit_wins() -> None:
    assert choose_output(OutputMode.JSON) is OutputMode.JSON
    assert choose_output(None) is OutputMode.PLAIN  # pytest's stdout is not a terminal

"""Tests of kvpush.cli.views.live: pure renderers of a hand-built Snapshot."""

from __future__ import annotations

import functools
import json

from rich.console import Console

from kvpush.cli.views.live import (
    fmt_ms,
    fmt_uptime,
    render_json,
    render_live,
    render_plain,
    render_summary_table,
)
from kvpush.telemetry.snapshot import Snapshot, snapshot_from_dict
from kvpush.telemetry.store import Telemetry

T0 = 1_795_000_000.0  # 2026-11-18T11:06:40Z


def sample_snapshot(peers: list[dict[str, object]] | None = None) -> Snapshot:
    """A busy prefill endpoint at a fixed instant: deterministic, every section filled."""
    now = [0.0]
    tel = Telemetry(
        "prefill", "p-7f3a9c21", "inc-1a2b", clock=lambda: now[0], wall_clock=lambda: T0 + now[0]
    )
    tel.info(address="127.0.0.1:5600", device="cpu", writer="deferred", version="0.1.0")
    gauges = {
        "finished_waiting_reg": 4,
        "regs_waiting_blocks": 0,
        "deferred": 2,
        "inflight_writes": 17,
        "pool_free": 1000,
        "pool_allocated": 20,
        "pool_inflight": 3,
        "pool_quarantined": 1,
        "pool_total": 1024,
    }
    for name, value in gauges.items():
        tel.gauge_fn(name, functools.partial(float, value))
    if peers is None:
        peers = [
            {"peer": "127.0.0.1:5700", "engine_id": "d-11aa22bb", "mode": "full",
             "state": "connected", "duration_s": 0.041, "failures": 0, "last_error": None},
            {"peer": "10.0.0.12:5701", "engine_id": "d-99ff", "mode": "full", "state": "failed",
             "duration_s": 5.0, "failures": 3,
             "last_error": "deadline: no answer within 5 s from 10.0.0.12:5701 " * 4},
        ]  # fmt: skip
    tel.peers_fn(lambda: peers)
    for k in range(1000):
        tel.observe("push_latency", 4e-5 + k * 1e-7)
        tel.observe("write_duration", 2e-5)
    tel.observe("handshake_duration", 0.041)
    tel.declare(histograms=["decode_latency"])
    tel.inc("pushes_ok", 3000)
    tel.inc("bytes_pushed", 3000 * 1_000_000)
    tel.inc("requests_ok", 3000)
    tel.fail("handshake_failed", 3)
    tel.fail("deadline", 2)
    now[0] = 2.0
    return tel.snapshot()


def rendered(snap: Snapshot) -> str:
    console = Console(record=True, width=100, force_terminal=True, color_system="truecolor")
    console.print(render_live(snap))
    return console.export_text()


def test_live_view_has_every_section_and_fits_100_columns() -> None:
    text = rendered(sample_snapshot())
    for title in ("Handshakes", "Queues", "Throughput", "Latency", "Failures", "Pool"):
        assert title in text
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "kvpush prefill" in lines[0]
    assert "p-7f3a9c21" in text and "127.0.0.1:5600" in text and "up 2s" in text
    (peer_row,) = [line for line in lines if line.startswith("127.0.0.1:5700")]
    assert peer_row.split()[:5] == ["127.0.0.1:5700", "d-11aa22bb", "full", "connected", "41.0"]
    (failed_row,) = [line for line in lines if line.startswith("10.0.0.12:5701")]
    assert "failed" in failed_row and "deadline: no answer" in failed_row
    assert "Handshakes  1/2 ready" in text
    assert "finished awaiting PUSH_REG" in text and "in-flight WRITEs" in text
    assert "d_waiting" not in text and "D requests waiting" not in text  # not reported: not shown
    assert "1,500" in text  # pushes/s over the 2 s since start
    assert "1.50" in text  # GB/s
    assert "handshake_failed" in text
    assert "of 1,024 blocks" in text


def test_live_view_of_a_fresh_endpoint() -> None:
    snap = Telemetry("decode", "d-1").snapshot()
    text = rendered(snap)
    assert "no peers yet" in text
    assert "none reported" in text
    assert "nothing observed" in text
    assert "no block pool reported" in text


def test_live_view_caps_peer_rows_unhealthy_first() -> None:
    peers: list[dict[str, object]] = [
        {"peer": f"10.0.0.{i}:5700", "state": "connected"} for i in range(30)
    ]
    peers.append({"peer": "10.0.9.9:5700", "state": "failed"})
    text = rendered(sample_snapshot(peers))
    assert "… 19 more" in text
    assert text.index("10.0.9.9:5700") < text.index("10.0.0.0:5700")


def test_plain_is_one_deterministic_line() -> None:
    line = render_plain(sample_snapshot())
    assert "\n" not in line
    assert line == (
        "2026-11-18T11:06:42Z prefill p-7f3a9c21 pushes/s=1500 req/s=1500 GB/s=1.50 finished=4 "
        "regs=0 deferred=2 inflight=17 p99=0.139ms fail=5[handshake_failed:3,deadline:2] "
        "pool_free=1000/1024 peers=1/2"
    )


def test_plain_of_a_fresh_endpoint() -> None:
    snap = Telemetry("decode", "d 1", clock=lambda: 0.0, wall_clock=lambda: T0).snapshot()
    assert render_plain(snap) == (
        "2026-11-18T11:06:40Z decode d_1 pushes/s=0 req/s=0 GB/s=0.00 p99=- fail=0 peers=0/0"
    )


def test_json_is_one_line_and_round_trips() -> None:
    snap = sample_snapshot()
    line = render_json(snap)
    assert "\n" not in line
    d = json.loads(line)
    assert d == snap.to_dict()
    assert snapshot_from_dict(d) == snap
    assert d["counters"]["pushes_ok"] == 3000


def test_summary_table() -> None:
    console = Console(record=True, width=100)
    console.print(render_summary_table([sample_snapshot(), Telemetry("decode", "d-1").snapshot()]))
    text = console.export_text()
    assert "p-7f3a9c21" in text and "3.00 GB" in text and "d-1" in text


def test_formatters() -> None:
    assert [fmt_ms(s) for s in (0.0, 4.7e-5, 1.234e-3, 0.041, 1.2345)] == [
        "0", "0.047", "1.23", "41.0", "1234"
    ]  # fmt: skip
    assert [fmt_uptime(s) for s in (5, 65, 3725, 90061)] == ["5s", "1m05s", "1h02m05s", "1d01h01m"]

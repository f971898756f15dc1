"""Tests of kvpush.commands.common.live: pure renderers of a hand-built Snapshot."""

from __future__ import annotations

import functools
import json

from rich.console import Console

from kvpush.commands.common.live import render_live, render_summary_table
from kvpush.commands.common.readings import fmt_ms, fmt_uptime
from kvpush.commands.serve.lines import render_json, render_plain
from kvpush.config import Role
from kvpush.telemetry.merge import merge
from kvpush.telemetry.snapshot import Snapshot, snapshot_from_dict
from kvpush.telemetry.store import Telemetry

T0 = 1_795_000_000.0  # 2026-11-18T11:06:40Z


def sample_snapshot(peers: list[dict[str, object]] | None = None) -> Snapshot:
    """A busy prefill endpoint at a fixed instant: deterministic, every section filled."""
    now = [0.0]
    tel = Telemetry(
        Role.PREFILL, "p-7f3a9c21", "inc-1a2b", clock=lambda: now[0], wall_clock=lambda: T0 + now[0]
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
    snap = Telemetry(Role.DECODE, "d-1").snapshot()
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
    snap = Telemetry(Role.DECODE, "d 1", clock=lambda: 0.0, wall_clock=lambda: T0).snapshot()
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
    console.print(
        render_summary_table([sample_snapshot(), Telemetry(Role.DECODE, "d-1").snapshot()])
    )
    text = console.export_text()
    assert "p-7f3a9c21" in text and "3.00 GB" in text and "d-1" in text


def test_formatters() -> None:
    assert [fmt_ms(s) for s in (0.0, 4.7e-5, 1.234e-3, 0.041, 1.2345)] == [
        "0", "0.047", "1.23", "41.0", "1234"
    ]  # fmt: skip
    assert [fmt_uptime(s) for s in (5, 65, 3725, 90061)] == ["5s", "1m05s", "1h02m05s", "1d01h01m"]


# --- tensor-parallel ranks --------------------------------------------------------------------


def rank_snapshot(rank: int, role: Role = Role.PREFILL) -> Snapshot:
    """Rank ``rank`` of a TP-2 endpoint at a fixed instant: its own queues, pool and peers."""
    now = [0.0]
    tel = Telemetry(
        role, "p-7f3a9c21", "inc-1a2b", clock=lambda: now[0], wall_clock=lambda: T0 + now[0]
    )
    tel.info(
        address="127.0.0.1:5600", device=f"cuda:{rank}", writer="deferred", handshake="notif",
        version="0.1.0", rank=rank, tp_size=2,
    )  # fmt: skip
    gauges = {
        "pool_free": 1000 - rank,
        "pool_allocated": 20,
        "pool_inflight": 3 + rank,
        "pool_quarantined": rank,
        "pool_total": 1024,
    }
    if role == "prefill":
        gauges |= {"finished_waiting_reg": 4 * rank, "regs_waiting_blocks": 0,
                   "deferred": rank, "inflight_writes": 17 + rank}  # fmt: skip
    else:
        gauges |= {"d_waiting": 5 + rank}
    for name, value in gauges.items():
        tel.gauge_fn(name, functools.partial(float, value))
    peers: list[dict[str, object]] = [
        {"peer": "127.0.0.1:5700", "engine_id": "d-11aa22bb", "mode": "full",
         "state": "connected", "duration_s": 0.041, "failures": 0, "last_error": None},
    ]  # fmt: skip
    if rank == 1:
        peers.append({"peer": "10.0.0.12:5701", "engine_id": "d-99ff", "mode": "full",
                      "state": "failed", "duration_s": 5.0, "failures": 3,
                      "last_error": "deadline"})  # fmt: skip
    tel.peers_fn(lambda: peers)
    tel.inc("pushes_ok", 1000 * (rank + 1))
    tel.inc("bytes_pushed", 1000 * (rank + 1) * 1_000_000)
    tel.inc("requests_ok", 300 * (rank + 1))
    tel.inc("notifs_received", 200 * (rank + 1))
    tel.observe("push_latency", 1e-4 * (rank + 1))
    tel.fail("deadline", rank)
    now[0] = 2.0
    return tel.snapshot()


def tp_snapshot(role: Role = Role.PREFILL) -> Snapshot:
    return merge([rank_snapshot(0, role), rank_snapshot(1, role)])


def test_live_view_with_ranks_adds_a_rank_table_under_the_totals() -> None:
    text = rendered(tp_snapshot())
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert text.index("Pool") < text.index("Ranks") and "of 2,048 blocks" in text  # totals
    assert "device cuda:0,cuda:1" in text and "tp 2" in text
    head = lines.index(next(ln for ln in lines if ln.startswith("Ranks"))) + 1
    assert lines[head].split() == [
        "rank", "finished", "regs", "deferred", "writes", "free", "inflight", "quar.",
        "ok/conn/fail", "pushes/s", "GB/s",
    ]  # fmt: skip
    assert [lines[head + 2].split(), lines[head + 3].split()] == [
        ["0", "0", "0", "0", "17", "1,000", "3", "0", "1/0/0", "500", "0.50"],
        ["1", "4", "0", "1", "18", "999", "4", "1", "1/0/1", "1,000", "1.00"],
    ]
    # The handshake table names the rank that holds each peer (one row per rank and peer).
    assert "Handshakes  2/3 ready" in text
    rows = [ln.split()[:4] for ln in lines if "127.0.0.1:5700" in ln or "10.0.0.12" in ln]
    assert rows == [
        ["1", "10.0.0.12:5701", "d-99ff", "full"],
        ["0", "127.0.0.1:5700", "d-11aa22bb", "full"],
        ["1", "127.0.0.1:5700", "d-11aa22bb", "full"],
    ]


def test_rank_table_of_a_decode_endpoint_shows_its_queue_and_receive_rates() -> None:
    lines = rendered(tp_snapshot(Role.DECODE)).splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("Ranks"))) + 1
    assert lines[head].split() == [
        "rank", "waiting", "free", "inflight", "quar.", "ok/conn/fail", "req/s", "notifs/s",
    ]  # fmt: skip
    assert lines[head + 3].split() == ["1", "6", "999", "4", "1", "1/0/1", "300", "200"]


def test_one_rank_looks_as_it_always_did() -> None:
    snap = sample_snapshot()
    assert merge([snap]) is snap and not snap.ranks
    text = rendered(snap)
    assert "Ranks" not in text and "tp " not in text and "rank" not in text
    assert "\n" not in render_plain(snap)
    assert "ranks" not in json.loads(render_json(snap))


def test_plain_with_ranks_is_the_totals_line_then_a_line_per_rank() -> None:
    assert render_plain(tp_snapshot()).splitlines() == [
        "2026-11-18T11:06:42Z prefill p-7f3a9c21 pushes/s=1500 req/s=450 GB/s=1.50 finished=4 "
        "regs=0 deferred=1 inflight=35 p99=0.199ms fail=1[deadline:1] pool_free=1999/2048 "
        "peers=2/3",
        "2026-11-18T11:06:42Z prefill p-7f3a9c21 rank=0/2 pushes/s=500 GB/s=0.50 finished=0 "
        "regs=0 deferred=0 inflight=17 fail=0 pool_free=1000/1024 peers=1/1",
        "2026-11-18T11:06:42Z prefill p-7f3a9c21 rank=1/2 pushes/s=1000 GB/s=1.00 finished=4 "
        "regs=0 deferred=1 inflight=18 fail=1 pool_free=999/1024 peers=1/2",
    ]
    assert render_plain(tp_snapshot(Role.DECODE)).splitlines()[2] == (
        "2026-11-18T11:06:42Z decode p-7f3a9c21 rank=1/2 req/s=300 notifs/s=200 waiting=6 "
        "fail=1 pool_free=999/1024 peers=1/2"
    )


def test_json_with_ranks_carries_each_rank_and_round_trips() -> None:
    snap = tp_snapshot()
    line = render_json(snap)
    assert "\n" not in line
    d = json.loads(line)
    assert snapshot_from_dict(d) == snap
    assert d["info"]["rank"] == "all" and d["gauges"]["inflight_writes"] == 35
    assert [r["info"]["rank"] for r in d["ranks"]] == [0, 1]
    one = d["ranks"][1]
    assert one["gauges"]["inflight_writes"] == 18 and one["gauges"]["pool_free"] == 999
    assert one["counters"]["pushes_ok"] == 2000 and one["rates"]["pushes_ok"] == 1000
    assert [p["state"] for p in one["peers"]] == ["connected", "failed"]
    assert "ranks" not in one  # a rank has no ranks of its own
    assert [p["rank"] for p in d["peers"]] == [0, 1, 1]


def _fitted(snap: Snapshot, width: int, height: int) -> list[str]:
    from kvpush.commands.serve.fit import FittedView

    console = Console(record=True, width=width, height=height, force_terminal=True)
    console.print(FittedView(snap))
    return console.export_text().splitlines()


def test_fitted_view_of_a_decode_at_tp_4_fits_80x24_with_rates_named_as_rates() -> None:
    snap = merge([rank_snapshot(r, Role.DECODE) for r in range(4)])
    lines = _fitted(snap, 80, 24)
    text = "\n".join(lines)
    assert len(lines) <= 24 and max(len(ln) for ln in lines) <= 80, text
    assert "GB received" not in text and "pushes/s" not in text
    assert "Rates    requests/s 1,500  GB/s 0.00  notifs/s 1,000" in text
    assert "Totals   requests 3,000  received 0 B  notifs 2,000" in text
    assert "of 4,096 blocks" in text and "Failures deadline 6" in text
    head = lines.index(next(ln for ln in lines if ln.startswith("rank waiting")))
    assert lines[head].split() == [
        "rank", "waiting", "free", "infl.", "quar.", "peers", "req/s", "notifs/s",
    ]  # fmt: skip
    assert [lines[head + 1 + r].split()[0] for r in range(4)] == ["0", "1", "2", "3"]
    assert "Handshakes  4/5 ready" in text and "10.0.0.12:5701" in text


def test_fitted_view_lets_handshake_rows_give_way_with_a_count() -> None:
    peers: list[dict[str, object]] = [
        {"peer": f"10.0.0.{i}:5700", "state": "connected"} for i in range(30)
    ]
    lines = _fitted(sample_snapshot(peers), 80, 24)
    text = "\n".join(lines)
    assert len(lines) <= 24 and "of 1,024 blocks" in text and "Failures handshake_failed 3" in text
    assert "Handshakes  30/30 ready" in text and "… " in text
    shown = sum(ln.startswith("10.0.0.") for ln in lines)
    assert f"… {30 - shown} more" in text


def test_fitted_view_is_the_full_view_where_that_fits() -> None:
    snap = tp_snapshot()
    console = Console(record=True, width=200, height=50, force_terminal=True)
    console.print(render_live(snap))
    assert _fitted(snap, 200, 50) == console.export_text().splitlines()

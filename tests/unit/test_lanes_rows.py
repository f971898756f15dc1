"""A P's lane facts as its peer rows carry them: the flags, the snapshot, the live view, Prometheus.

``PeerLanes`` is fed what the writer records (posts, WRITEs done after their post) and reads the
lanes from a real UCX log file (the real tables of ``test_lanes_parse``); the rows then go through
a real ``Telemetry`` snapshot into the live view's cells and the Prometheus families."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from kvpush.commands.common.live import lane_cell, render_live
from kvpush.commands.probe.lanes import lane_rows, lane_word
from kvpush.config import Role
from kvpush.prefill.lanestats import POST_DOMINATES, TCP_ON_ONE_HOST, PeerLanes
from kvpush.telemetry.prom import snapshot_families
from kvpush.telemetry.store import Telemetry
from kvpush.transport.lanebook import LaneBook
from kvpush.transport.lanes import LaneLog
from tests.unit.test_lanes_parse import _CMA, _TCP, AGENT, T_CMA, T_TCP, _text

D_TCP = ("127.0.0.1", 5701, 0)
D_CMA = ("127.0.0.1", 5702, 0)


def _lanes(tmp_path: Path) -> PeerLanes:
    path = tmp_path / "ucx.log"
    path.write_text(_text(os.getpid(), _TCP, _CMA))
    book = LaneBook(AGENT, LaneLog(str(path), own=False), "")
    lanes = PeerLanes(book, "127.0.0.1")
    book.contact("d-tcp", T_TCP + 0.05)
    book.contact("d-cma", T_CMA + 0.05)
    return lanes


def test_tcp_between_two_endpoints_of_one_host_is_flagged(tmp_path: Path) -> None:
    lanes = _lanes(tmp_path)
    lanes.posted(D_TCP, "d-tcp", 32, 32 * 65536, 0.0004)
    lanes.posted(D_CMA, "d-cma", 32, 32 * 65536, 0.0002)
    rows = lanes.fields()
    tcp, cma = rows["127.0.0.1:5701"], rows["127.0.0.1:5702"]
    assert tcp["lane_flags"] == [TCP_ON_ONE_HOST]
    assert cma["lane_flags"] == []
    lane = tcp["lane"]
    assert isinstance(lane, dict)
    assert lane["write"] == ["tcp"] and lane["notif"] == ["tcp"]
    assert lane["descs_per_push"] == 32
    assert lane["post_us_per_desc"] == round(400 / 32, 4)
    assert lane["post_share"] is None  # no WRITE still in flight after its post yet


def test_posting_that_takes_most_of_the_writes_is_flagged(tmp_path: Path) -> None:
    lanes = _lanes(tmp_path)
    for _ in range(3):
        lanes.posted(D_CMA, "d-cma", 1000, 1000 * 4096, 0.006)
        lanes.done(D_CMA, 0.006, 0.010)  # 60 % of the WRITE's time in its post
    row = lanes.fields()["127.0.0.1:5702"]
    assert row["lane_flags"] == [POST_DOMINATES]
    lanes.posted(D_TCP, "d-tcp", 1000, 1000 * 4096, 0.001)
    for _ in range(3):
        lanes.done(D_TCP, 0.001, 0.010)
    assert lanes.fields()["127.0.0.1:5701"]["lane_flags"] == [TCP_ON_ONE_HOST]


def test_a_new_incarnation_at_an_address_starts_afresh(tmp_path: Path) -> None:
    lanes = _lanes(tmp_path)
    lanes.posted(D_TCP, "d-tcp", 8, 8 * 65536, 0.001)
    lanes.posted(D_TCP, "d-tcp-restarted", 4, 4 * 65536, 0.001)
    lane = lanes.fields()["127.0.0.1:5701"]["lane"]
    assert isinstance(lane, dict)
    assert (lane["pushes"], lane["descs_mean"]) == (1, 4.0)


def test_the_rows_carry_the_lane_into_the_snapshot_the_view_and_prometheus(
    tmp_path: Path,
) -> None:
    lanes = _lanes(tmp_path)
    lanes.posted(D_TCP, "d-tcp", 32, 32 * 65536, 0.0004)
    tm = Telemetry(Role.PREFILL, "p-1")
    tm.peers_fn(
        lambda: [
            {"peer": "127.0.0.1:5701", "state": "connected", "mode": "full"},
            {"peer": "127.0.0.1:5709", "state": "connected", "mode": "full"},
        ]
    )
    tm.peer_extras_fn(lanes.fields)
    snap = tm.snapshot()
    tcp, other = snap.peers
    assert isinstance(tcp["lane"], dict) and tcp["lane_flags"] == [TCP_ON_ONE_HOST]
    assert "lane" not in other  # a peer never written to has no lane
    assert snap.to_dict()["peers"] == snap.peers  # JSON carries it as it is
    assert "tcp" in lane_cell(tcp).plain and TCP_ON_ONE_HOST in lane_cell(tcp).plain
    con = Console(width=100, record=True)
    con.print(render_live(snap))
    assert "lane" in con.export_text()
    fams = {f.name: f for f in snapshot_families(snap)}
    (sample,) = fams["kvpush_peer_lane"].samples
    assert sample.labels["peer"] == "127.0.0.1:5701"
    assert (sample.labels["write"], sample.labels["notif"]) == ("tcp", "tcp")
    assert (sample.labels["device"], sample.labels["locality"]) == ("lo,eth0", "intra-node")
    assert sample.labels["flags"] == TCP_ON_ONE_HOST
    (per_desc,) = fams["kvpush_peer_post_seconds_per_descriptor"].samples
    assert abs(per_desc.value - 0.0004 / 32) < 1e-9


def test_a_ps_snapshot_gives_the_lane_rows_of_one_d_by_its_address(tmp_path: Path) -> None:
    lanes = _lanes(tmp_path)
    lanes.posted(D_TCP, "d-tcp", 32, 32 * 65536, 0.0004)
    lanes.posted(("127.0.0.1", 5701, 1), "d-tcp.r1", 32, 32 * 65536, 0.0004)
    tm = Telemetry(Role.PREFILL, "p-1")
    names = ["127.0.0.1:5701", "127.0.0.1:5701 rank 1", "127.0.0.1:57010", "127.0.0.1:5702"]
    tm.peers_fn(lambda: [{"peer": n, "state": "connected"} for n in names])
    tm.peer_extras_fn(lanes.fields)
    reply = tm.snapshot().to_dict()  # what a StatsReq answers
    rows = lane_rows(reply, "127.0.0.1:5701")
    assert [r["peer"] for r in rows] == ["127.0.0.1:5701", "127.0.0.1:5701 rank 1"]
    assert lane_word(rows[0]) == f"tcp!{TCP_ON_ONE_HOST}"
    assert lane_rows(reply, "127.0.0.1:5702") == []  # never written to: no lane yet

"""``kvpush bench rate``'s floors: UCX's ``ucx_perftest`` read and run, and the table of small
requests beside their floors (pure, from rounds as the bench records them)."""

from __future__ import annotations

import math
import socket
import sys
import time
from pathlib import Path

import pytest

from kvpush.commands.bench import ucx_floors
from kvpush.commands.bench.rate_floors import floors_report, kvpush_rows, ucx_rows
from kvpush.commands.bench.rate_report import InflightRounds, KvRound
from kvpush.commands.bench.report import Report

# ucx_perftest 1.13.1's own output (a client of ucp_am_bw over tcp, this host).
_OUT = "\n".join(
    [
        "+--------------+--------------+---------+ (the table's head, shortened)",
        "|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |",
        "Final:                100000      6.305     6.524     6.524        9.35       9.35"
        "      153272      153272",
    ]
)


def test_the_final_line_gives_iterations_p50_average_bandwidth_and_rate() -> None:
    assert ucx_floors.parse_final(_OUT) == (100000, 6.305, 6.524, 9.35, 153272.0)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "printed no Final line; its last: (nothing)"),
        ("UCX  ERROR client failed. connect() failed\n", "its last: UCX  ERROR client failed"),
        ("Final: 1 2 3\n", "has 3 fields, not 8"),
        ("Final: 10 a b c d e f g\n", "not numbers"),
    ],
)
def test_output_without_figures_is_a_floor_error_in_its_own_words(text: str, says: str) -> None:
    with pytest.raises(ucx_floors.FloorError, match=None) as e:
        ucx_floors.parse_final(text)
    assert says in str(e.value)


def test_a_listening_socket_is_seen_and_a_closed_port_is_not() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert not ucx_floors.listening(port)  # bound, not listening
        s.listen()
        assert ucx_floors.listening(port)
    assert not ucx_floors.listening(port)


def test_without_ucx_perftest_the_floors_are_skipped_with_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ucx_floors, "perftest", lambda: None)
    floors, notes = ucx_floors.measure(quick=True)
    assert floors == []
    assert notes == [
        "UCX floors skipped: ucx_perftest is not installed "
        "(scripts/ucx-setup.sh unpacks Debian's ucx-utils into .venv, no root)"
    ]


def test_a_case_that_cannot_run_is_a_note_not_a_failed_bench(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # /bin/false: starts, never listens, exits 1 -- the server's own failure, said per case
    monkeypatch.setattr(ucx_floors, "perftest", lambda: "/bin/false")
    floors, notes = ucx_floors.measure(quick=True)
    assert floors == []
    assert len(notes) == len(ucx_floors.cases(quick=True)) == 6
    assert all("exited (1) before listening" in n for n in notes), notes


def _round(per_s: float, elapsed: float, d_to_p: int, p_to_d: int) -> KvRound:
    return {
        "per_s": per_s,
        "failed": 0,
        "latency": {},
        "writer_cpu_us": 80.0,
        "p_cpu_us": 95.0,
        "d_cpu_us": 90.0,
        "d_receiver_cpu_us": 60.0,
        "d_client_cpu_us": 30.0,
        "writes": 100,
        "pushes_per_write": 16.0,
        "post_us_per_desc": 7.5,
        "d_to_p_notifs": d_to_p,
        "p_to_d_notifs": p_to_d,
        "elapsed_s": elapsed,
    }


def _rounds() -> InflightRounds:
    raw = {
        "n": 1000,
        "bytes": 0,
        "elapsed_s": 0.05,
        "cpu_s": 0.05,
        "thread_cpu_s": 0.05,
        "gbps": 0.0,
        "per_s": 20000.0,
        "post_to_done_p50_s": 0.0,
        "post_us_per_desc": 12.5,
    }
    notif = {
        "n": 1000,
        "size": 64,
        "elapsed_s": 0.02,
        "per_s": 50000.0,
        "send_us": 19.0,
        "thread_cpu_us": 18.0,
        "cpu_us": 20.0,
    }
    return {
        "n": 10000,
        # 10,000 pushes in 1 s each: 400 notifications D -> P, 625 P -> D
        "kvpush": [_round(10000.0, 1.0, 400, 625), _round(10000.0, 1.0, 400, 625)],
        "raw": [raw],  # type: ignore[list-item]
        "kvpush_d_nospin": [],
        "kvpush_single": [],
        "raw_notifs": [notif],  # type: ignore[list-item]
    }


def test_kvpush_notifications_are_rated_per_second_and_per_push_carried() -> None:
    rows = {r[0]: r[1:] for r in kvpush_rows(_rounds(), 64)}
    assert rows["kvpush: notifications D -> P (PUSH_REG batches)"] == [
        "400",
        "-",
        "25.0 pushes each",
    ]
    assert rows["kvpush: notifications P -> D (completions)"] == ["625", "-", "16.0 pushes each"]
    assert rows["kvpush: 1-block pushes, 64 in flight"][0] == "10,000"
    assert rows["raw NIXL: WRITE + notification, 64 in flight"] == [
        "20,000",
        "loop thread 50.0",
        "posts 12.5 us a descriptor",
    ]
    assert rows["raw NIXL: notifications of 64 B, back to back"] == [
        "50,000",
        "sender's thread 18.0",
        "send_notif 19.0 us",
    ]


def test_rounds_without_counted_notifications_say_nothing_rather_than_zero() -> None:
    e = _rounds()
    for r in e["kvpush"]:
        del r["d_to_p_notifs"]
    rows = {r[0]: r[1:] for r in kvpush_rows(e, 64)}
    assert rows["kvpush: notifications D -> P (PUSH_REG batches)"][0] == "-"


def test_ucx_rows_name_the_version_the_lane_and_what_the_p50_measures() -> None:
    floor: ucx_floors.Floor = {
        "label": "am 64 B",
        "test": "ucp_am_lat",
        "size": 64,
        "lane": "tcp",
        "n": 5000,
        "p50_us": 6.032,
        "avg_us": 6.34,
        "per_s": 157719.0,
        "mb_s": 9.63,
        "client_cpu_us": 37.9,
        "server_cpu_us": 37.6,
    }
    (row,) = ucx_rows([floor], "1.13.1")
    assert row == [
        "UCX 1.13.1, UCX_TLS tcp: am 64 B, ping-pong",
        "157,719",
        "sender 37.90, receiver 37.60",
        "p50 6.03 us (latency, half a round trip)",
    ]


def test_the_floors_table_carries_figures_and_the_notes_of_skipped_cases() -> None:
    rep = Report("rate", "rate", True, params={})
    floors_report(rep, _rounds(), 64, [], ["UCX floors skipped: why"], "?")
    fig = rep.figures["floors"]
    assert isinstance(fig, dict)
    assert fig["kvpush_d_to_p_notifs_per_s"] == 400 and fig["ucx"] == []
    assert "UCX floors skipped: why" in rep.notes
    assert not math.isnan(float(str(fig["kvpush_p_to_d_notifs_per_s"])))


@pytest.mark.slow
def test_the_real_ucx_perftest_gives_every_floor() -> None:
    """Against the real ucx_perftest (``make test-slow`` unpacks it: scripts/ucx-setup.sh)."""
    if ucx_floors.perftest() is None:
        pytest.fail("ucx_perftest is not installed: run scripts/ucx-setup.sh")
    floors, notes = ucx_floors.measure(quick=True)
    assert notes == []
    assert [(f["test"], f["lane"]) for f in floors] == [
        (c.test, c.tls or "unset (UCX's choice)") for c in ucx_floors.cases(quick=True)
    ]
    for f in floors:
        assert f["n"] > 0 and f["per_s"] > 0 and f["p50_us"] > 0, f
        assert f["client_cpu_us"] > 0 and f["server_cpu_us"] > 0, f
    assert ucx_floors.version() != "?"


class _Worker:
    """A bench worker's ``call`` as ``_raw_notif_round`` uses it; ``fail`` names a command that
    answers with a ``BenchError`` (a worker that timed out, or died)."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.calls: list[str] = []

    def call(self, cmd: str, call_timeout: float = 120.0, **args: object) -> object:
        from kvpush.commands.bench.procs import BenchError

        self.calls.append(cmd)
        if cmd == self.fail:
            raise BenchError(f"{cmd} did not answer in {call_timeout:g}s")
        return {"metadata": "", "bases": [], "pid": 1, "geometry": [1, 1, 4096]}


def test_a_failed_notification_round_still_closes_both_raw_nodes() -> None:
    from kvpush.commands.bench import rate
    from kvpush.commands.bench.procs import BenchError

    rt, ri = _Worker(), _Worker(fail="raw_notif_loop")
    with pytest.raises(BenchError, match="raw_notif_loop did not answer"):
        rate._raw_notif_round(rt, ri, 1000)  # type: ignore[arg-type]
    assert rt.calls == ["raw_node", "raw_notif_target", "raw_close"]
    assert ri.calls == ["raw_node", "raw_notif_loop", "raw_close"]


_FAKE = """#!{python}
# A stand-in ucx_perftest: as a server ("-p PORT") it listens and waits; as a client it {client}.
import socket, sys, time
if sys.argv[1] == "-p":
    s = socket.socket()
    s.bind(("127.0.0.1", int(sys.argv[2])))
    s.listen()
    time.sleep(60)
{client_code}
"""


def _fake_perftest(tmp_path: Path, client: str, client_code: str) -> str:
    exe = tmp_path / "ucx_perftest"
    exe.write_text(_FAKE.format(python=sys.executable, client=client, client_code=client_code))
    exe.chmod(0o755)
    return str(exe)


def test_a_client_that_fails_is_said_in_its_own_words_and_its_server_is_stopped(
    tmp_path: Path,
) -> None:
    exe = _fake_perftest(
        tmp_path, "fails", 'print("UCX  ERROR client failed. connect() failed"); sys.exit(255)'
    )
    t0 = time.monotonic()
    with pytest.raises(ucx_floors.FloorError, match="exited 255: UCX  ERROR client failed"):
        ucx_floors.run_case(exe, ucx_floors.cases(quick=True)[0])
    assert time.monotonic() - t0 < 10  # the waiting server was stopped, not waited for (60 s)


def test_a_client_that_hangs_is_stopped_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ucx_floors, "CASE_TIMEOUT_S", 1.0)
    exe = _fake_perftest(tmp_path, "hangs", "time.sleep(60)")
    with pytest.raises(ucx_floors.FloorError, match="did not finish in 1 s"):
        ucx_floors.run_case(exe, ucx_floors.cases(quick=True)[0])

"""UCX's protocol tables (``UCX_PROTO_INFO=y``) as kvpush reads them, and their attribution.

The fixture is UCX 1.23's real output (NIXL 1.5.1's bundled UCX, captured on this host: a P that
pushed into a D with the default transports, then into a D started with ``UCX_TLS=tcp``), with the
pid replaced by this process's so that ``LaneLog`` (which keeps only its own process's lines) reads
it from a real file. Each fixture line is ``TS THREAD BODY``; ``_text`` puts UCX's prefix
``[TS] [vm:PID:THREAD]   `` back.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.transport.lanebook import (
    EVIDENCE_UCX,
    SLACK_S,
    EpConfig,
    LaneBook,
    attribute,
    resolve,
)
from kvpush.transport.lanes import LaneLog
from kvpush.transport.protoinfo import (
    NOTIF,
    WRITE,
    Message,
    ProtoInfoParser,
    TableRow,
    parse_hops,
    parse_range,
)

AGENT = "p-44dd2ca8d47d#213683208139"

_SELF_PUT = """\
1796486941.392100 0 +--------+-------------+-----------------------------------+
1796486941.392100 0 | AGENT self cfg#0                   |
1796486941.392100 0 | remote memory write by ucp_put* from host memory to host |
1796486941.392100 0 +--------+-------------+-----------------------------------+
1796486941.392100 0 | Range  | Description |              Config               |
1796486941.392100 0 +--------+-------------+-----------------------------------+
1796486941.392100 0 | 0..inf | zero-copy   | cma/memory                        |
1796486941.392100 0 +--------+-------------+-----------------------------------+
"""
_TCP = """\
1796486942.707321 1 +--------+-------------+-----------------------------------+
1796486942.707321 1 | AGENT intra-node cfg#1             |
1796486942.707321 1 | remote memory write by ucp_put* from host memory to host |
1796486942.707321 1 +--------+-------------+-----------------------------------+
1796486942.707321 1 | Range  | Description |              Config               |
1796486942.707321 1 +--------+-------------+-----------------------------------+
1796486942.707321 1 | 0..inf | zero-copy   | 52% on tcp/lo and 48% on tcp/eth0 |
1796486942.707321 1 +--------+-------------+-----------------------------------+
1796486942.712130 1 +------------+--------------------+---------------+
1796486942.712130 1 | AGENT intra-node cfg#1    |
1796486942.712130 1 | active message by ucp_am_send* from host memory |
1796486942.712130 1 +------------+--------------------+---------------+
1796486942.712130 1 |   Range    |    Description     |    Config     |
1796486942.712130 1 +------------+--------------------+---------------+
1796486942.712130 1 |          0 | short              | tcp/lo        |
1796486942.712130 1 |   1..16515 | zero-copy          | tcp/lo        |
1796486942.712130 1 | 16516..inf | multi-frag copy-in | tcp/lo        |
1796486942.712130 1 +------------+--------------------+---------------+
1796486942.737076 1 +--------+-------------+------------------------------------------+
1796486942.737076 1 | AGENT intra-node cfg#1                    |
1796486942.737076 1 | remote memory write by ucp_put*(multi) from host memory to host |
1796486942.737076 1 +--------+-------------+------------------------------------------+
1796486942.737076 1 | Range  | Description |                  Config                  |
1796486942.737076 1 +--------+-------------+------------------------------------------+
1796486942.737076 1 | 0..inf | zero-copy   | 52% on tcp/lo and 48% on tcp/eth0        |
1796486942.737076 1 +--------+-------------+------------------------------------------+
"""
_CMA = """\
1796486946.562819 1 +--------+-------------+-----------------------------------+
1796486946.562819 1 | AGENT intra-node cfg#2             |
1796486946.562819 1 | remote memory write by ucp_put* from host memory to host |
1796486946.562819 1 +--------+-------------+-----------------------------------+
1796486946.562819 1 | Range  | Description |              Config               |
1796486946.562819 1 +--------+-------------+-----------------------------------+
1796486946.562819 1 | 0..inf | zero-copy   | cma/memory                        |
1796486946.562819 1 +--------+-------------+-----------------------------------+
1796486946.566424 1 +-----------+--------------------+---------------------------------+
1796486946.566424 1 | AGENT intra-node cfg#2                     |
1796486946.566424 1 | active message by ucp_am_send*(fast-completion) from host memory |
1796486946.566424 1 +-----------+--------------------+---------------------------------+
1796486946.566424 1 |   Range   |    Description     |             Config              |
1796486946.566424 1 +-----------+--------------------+---------------------------------+
1796486946.566424 1 |   0..8184 | short              | tcp/lo                          |
1796486946.566424 1 | 8185..inf | multi-frag copy-in | tcp/lo                          |
1796486946.566424 1 +-----------+--------------------+---------------------------------+
"""
_WARN = (
    "[1796486950.000001] [vm:PID:0]          parser.c:2578 UCX  WARN  unused environment "
    "variable: UCX_FOO\n"
)
T_TCP, T_CMA = 1796486942.707321, 1796486946.562819


def _text(pid: int, *parts: str) -> str:
    """The fixture as UCX wrote it: each ``TS THREAD BODY`` line gets UCX's prefix back."""
    out = []
    for part in parts:
        for line in part.splitlines():
            if line.startswith("["):
                out.append(line.replace("PID", str(pid)))
                continue
            ts, thread, body = line.split(" ", 2)
            out.append(f"[{ts}] [vm:{pid}:{thread}]   {body.replace('AGENT', AGENT)}")
    return "\n".join(out) + "\n"


REAL = _text(4242, _SELF_PUT, _TCP, _CMA, _WARN)


def _configs(text: str) -> dict[int, EpConfig]:
    out: dict[int, EpConfig] = {}
    for ev in ProtoInfoParser().feed(text):
        if isinstance(ev, TableRow) and ev.locality != "self":
            out.setdefault(ev.index, EpConfig(ev.worker, ev.locality, ev.index, ev.ts)).add(ev)
    return out


# --------------------------------------------------------------------------- the parser


def test_the_real_tables_give_each_configuration_its_write_and_notification_lanes() -> None:
    events = ProtoInfoParser().feed(REAL)
    rows = [e for e in events if isinstance(e, TableRow)]
    assert {(e.locality, e.index) for e in rows} == {
        ("self", 0),
        ("intra-node", 1),
        ("intra-node", 2),
    }
    assert {e.worker for e in rows} == {AGENT}
    assert all(e.pid == 4242 for e in rows)
    cfgs = _configs(REAL)
    tcp, cma = cfgs[1].lane(65536), cfgs[2].lane(65536)
    assert (tcp.write, tcp.devices, tcp.notif, tcp.notif_devices) == (
        ("tcp",),
        ("lo", "eth0"),
        ("tcp",),
        ("lo",),
    )
    assert (cma.write, cma.devices, cma.notif) == (("cma",), ("memory",), ("tcp",))
    assert (tcp.locality, tcp.cfg, tcp.evidence) == ("intra-node", 1, EVIDENCE_UCX)
    assert cfgs[1].ts == T_TCP and cfgs[2].ts == T_CMA  # the first table's timestamp
    assert {e.operation for e in rows} == {WRITE, NOTIF}


def test_a_line_outside_any_table_is_a_message_and_borders_are_nothing() -> None:
    events = ProtoInfoParser().feed(REAL)
    messages = [e for e in events if isinstance(e, Message)]
    assert [m.text for m in messages] == [
        "parser.c:2578 UCX  WARN  unused environment variable: UCX_FOO"
    ]
    assert messages[0].pid == 4242 and messages[0].ts == pytest.approx(1796486950.000001)


def test_ranges_sizes_and_hops_read_as_ucx_writes_them() -> None:
    assert parse_range("0") == (0, 0)
    assert parse_range("1..16515") == (1, 16515)
    assert parse_range("16516..inf") == (16516, None)
    assert parse_range("8K..inf") == (8192, None)
    assert parse_range("Range") is None
    assert parse_hops("52% on tcp/lo and 48% on tcp/eth0") == (("tcp", "lo"), ("tcp", "eth0"))
    assert parse_hops("rc_mlx5/mlx5_0:1") == (("rc_mlx5", "mlx5_0:1"),)
    assert parse_hops("cuda_ipc/cuda") == (("cuda_ipc", "cuda"),)
    assert parse_hops("no protocol") == ()


def test_a_small_message_reads_the_range_that_carries_it() -> None:
    cfg = _configs(REAL)[1]
    assert cfg.notif[0].covers(0) and not cfg.notif[0].covers(1)
    assert cfg.lane(None).write == ("tcp",)  # no size: the unbounded range


def test_tables_of_two_threads_interleaved_line_by_line_are_kept_apart() -> None:
    a = _text(7, _TCP).splitlines(keepends=True)
    b = _text(7, _CMA).replace("[vm:7:1]", "[vm:7:2]").splitlines(keepends=True)
    mixed = "".join(x for pair in zip(a, b, strict=False) for x in pair) + "".join(a[len(b) :])
    cfgs = _configs(mixed)
    assert cfgs[1].lane(65536).write == ("tcp",)
    assert cfgs[2].lane(65536).write == ("cma",)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(REAL)), max_size=40))
def test_the_text_in_any_chunks_gives_the_same_events(cuts: list[int]) -> None:
    whole = ProtoInfoParser().feed(REAL)
    p = ProtoInfoParser()
    got = []
    edges = [0, *sorted(cuts), len(REAL)]
    for lo, hi in itertools.pairwise(edges):
        got += p.feed(REAL[lo:hi])
    assert got == whole


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.text(max_size=400))
def test_arbitrary_text_never_raises(a: str, b: str) -> None:
    p = ProtoInfoParser()
    for ev in [*p.feed(a), *p.feed("\n" + b), *p.flush()]:
        assert isinstance(ev, TableRow | Message)


_LINE = st.sampled_from(
    [
        "+--------+-----+",
        "| Range  | Description | Config |",
        f"| {AGENT} intra-node cfg#3 |",
        f"| {AGENT} inter-node cfg#x |",
        "| remote memory write by ucp_put* from host memory to host |",
        "| 0..inf | zero-copy | rc_mlx5/mlx5_0:1 |",
        "| 9999999999999999999999..inf | z | a/b |",
        "| 1..2..3 | x | y |",
        "|",
        "||",
    ]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), _LINE | st.text(max_size=60)), max_size=30))
def test_table_shaped_garbage_never_raises(lines: list[tuple[int, str]]) -> None:
    text = "".join(f"[1.5] [h:{os.getpid()}:{t}]   {body}\n" for t, body in lines)
    events = ProtoInfoParser().feed(text)
    for ev in events:
        if isinstance(ev, TableRow):
            assert ev.row.hi is None or ev.row.hi >= 0


# --------------------------------------------------------------------------- attribution


def test_each_new_table_goes_to_the_one_peer_first_contacted_in_its_window() -> None:
    cfgs = list(_configs(REAL).values())
    contacts = {"d-tcp": T_TCP + 0.08, "d-cma": T_CMA + 0.03}
    assert attribute(cfgs, contacts) == {"d-tcp": 1, "d-cma": 2}
    assert resolve(cfgs, 1, "intra-node", 65536).write == ("tcp",)
    assert resolve(cfgs, 2, "intra-node", 65536).write == ("cma",)


def test_a_peer_attributed_to_a_later_table_leaves_an_earlier_tables_window() -> None:
    tcp, cma = _configs(REAL)[1], _configs(REAL)[2]
    cma.ts = tcp.ts + 1.0  # two pushes a second apart: the tcp table's window holds both
    contacts = {"d-tcp": tcp.ts + 0.03, "d-cma": cma.ts + 0.02}
    assert attribute([tcp, cma], contacts) == {"d-tcp": 1, "d-cma": 2}


def test_a_contact_stamped_just_before_a_table_belongs_to_the_earlier_one() -> None:
    # Measured on a quiet host (fleet check, two pairs one after the other): each contact
    # ~6 ms after its table, the second table 45 ms after the first contact -- inside its slack.
    tcp, cma = _configs(REAL)[1], _configs(REAL)[2]
    cma.ts = tcp.ts + 0.051
    contacts = {"d-tcp": tcp.ts + 0.006, "d-cma": cma.ts + 0.008}
    assert tcp.ts - SLACK_S <= contacts["d-tcp"] < cma.ts  # in both windows, before cfg#2
    assert attribute([tcp, cma], contacts) == {"d-tcp": 1, "d-cma": 2}


def test_two_contacts_in_one_window_are_not_guessed() -> None:
    cfgs = list(_configs(REAL).values())
    got = attribute(cfgs, {"a": T_CMA + 0.01, "b": T_CMA + 0.5})
    assert got == {}
    lane = resolve(cfgs, got.get("a"), "intra-node", 65536)
    assert lane.evidence == "ambiguous: cfg#1|cfg#2"
    assert lane.write == ()


def test_a_peer_that_printed_no_table_gets_the_one_config_of_its_locality() -> None:
    tcp_only = [c for c in _configs(REAL).values() if c.index == 1]
    assert attribute(tcp_only, {"late": T_TCP + 60}) == {}
    lane = resolve(tcp_only, None, "intra-node", 65536)
    assert (lane.write, lane.evidence) == (("tcp",), EVIDENCE_UCX)
    assert resolve(tcp_only, None, "inter-node", 65536).evidence.startswith("unknown: no UCX")
    assert resolve([], None, "intra-node", 1).evidence.startswith("unknown: UCX printed no")


def test_a_peer_that_reused_a_config_cannot_use_one_printed_after_its_first_contact() -> None:
    cfgs = list(_configs(REAL).values())  # tcp (cfg#1), then cma (cfg#2) 3.9 s later
    reused_early = resolve(cfgs, None, "intra-node", 65536, contact=T_TCP + 1.0)
    assert (reused_early.write, reused_early.cfg) == (("tcp",), 1)
    late = resolve(cfgs, None, "intra-node", 65536, contact=T_CMA + 10)
    assert late.evidence == "ambiguous: cfg#1|cfg#2"


def test_a_contact_long_before_the_table_is_not_its_cause() -> None:
    cfgs = list(_configs(REAL).values())
    assert attribute(cfgs, {"early": T_TCP - 1.0}) == {}


# --------------------------------------------------------------------------- a real file


def test_the_log_file_is_read_as_it_grows_with_only_this_process_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "kvpush-lanes"  # kvpush's own folder: removed once the file is open
    folder.mkdir()
    path = folder / "ucx.log"
    ucx = path.open("ab")  # UCX's handle: it writes on after the file's name is gone
    tcp = _text(os.getpid(), _SELF_PUT, _TCP)
    cut = len(tcp) - 500  # in the middle of cfg#1's second table: a partial line waits
    ucx.write(tcp[:cut].encode())
    ucx.flush()
    lf = LaneLog(str(path), own=True)
    lf.attach()
    assert not folder.exists()
    book = LaneBook(AGENT, lf, "")
    book.contact("d-tcp", T_TCP + 0.08)
    book.contact("d-cma", T_CMA + 0.03)
    book.contact("d-tcp", T_CMA + 0.03)  # only the first contact counts
    peers: dict[str, tuple[str | None, int | None]] = {
        "d-tcp": ("intra-node", 65536),
        "d-cma": ("intra-node", 65536),
        "d-never": ("intra-node", None),
    }
    first = book.lanes(peers)
    assert first["d-tcp"].write == ("tcp",)
    # cfg#2's table is not written yet: d-cma reads as the one intra-node config known so far
    assert (first["d-cma"].write, first["d-cma"].cfg) == (("tcp",), 1)
    # The rest of the file arrives, with another process's tables and UCX's own warning.
    with ucx:
        ucx.write(tcp[cut:].encode())
        ucx.write(_text(os.getpid() + 1, _CMA).replace("cma/memory", "sysv/memory").encode())
        ucx.write(_text(os.getpid(), _CMA, _WARN).encode())
    with caplog.at_level(logging.INFO, logger="kvpush.transport.lanes"):
        lanes = book.lanes(peers)
    assert lanes["d-tcp"].write == ("tcp",)
    assert lanes["d-cma"].write == ("cma",)
    assert lanes["d-never"].evidence == "unknown: no contact with this peer's agent yet"
    relayed = [r for r in caplog.records if "UCX_FOO" in r.getMessage()]
    assert [r.levelno for r in relayed] == [logging.WARNING]


def test_an_operator_file_that_is_not_there_says_so(tmp_path: Path) -> None:
    lf = LaneLog(str(tmp_path / "nope.log"), own=False)
    book = LaneBook(AGENT, lf, "")
    book.contact("d", 1.0)
    lane = book.lanes({"d": ("intra-node", None)})["d"]
    assert lane.evidence.startswith("unknown: ") and "not readable" in lane.evidence


def test_lanes_off_is_unknown_with_the_reason() -> None:
    book = LaneBook(AGENT, None, "lanes are off (--no-lanes)")
    book.contact("d", 1.0)
    assert book.lanes({"d": (None, None)})["d"].evidence == "unknown: lanes are off (--no-lanes)"

"""``drive --registry``'s admission, its pure parts (issue 24, item 3): which records a run starts
with (``kvpush.commands.drive.admission.choose``: the reference P among the reachable, fitting ones;
strays left out or pending, never stopping the run), the words for them (each named once, control
characters shown), one peer's fit (``preflight.misfit``), the socket plan (peers cost nothing
while idle: ``driver.plan_sockets``), the checker's queue (``due_checks.DueChecks``: one check
per address at a time, the latest record wanted meanwhile checked next) and the trace's note of
a peer whose phases are missing."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpush.commands.common import control
from kvpush.commands.common.results import RequestResult
from kvpush.commands.drive.admission import GROUP_AT, choose, contact_why, start_notes, unusable
from kvpush.commands.drive.driver import SOCKET_BUDGET, plan_sockets
from kvpush.commands.drive.due_checks import DueChecks
from kvpush.commands.drive.preflight import misfit
from kvpush.commands.drive.trace import ClockOffset, Tracer, _Rec
from kvpush.config import Role
from kvpush.errors import KvpushError, PeerError
from kvpush.fleet.record import EndpointRecord
from tests.support.records import record


def rec(
    role: Role, address: str, incarnation: str = "inc-1", wire: str = "kvpush"
) -> EndpointRecord:
    return record(address, role, incarnation=incarnation, wire=wire)


def md(
    role: Role, *, layers: int = 2, blocks: int = 64, tp: int = 1, inc: str = "i"
) -> dict[str, Any]:
    """Endpoint metadata as a peer answers it (decoded loose)."""
    return {
        "role": str(role),
        "protocol_version": 1,
        "dtype": "bfloat16",
        "kv_layout": "NHD",
        "block_bytes": 4096,
        "layers": layers,
        "regions": 2 * layers,
        "kv_heads": 1,
        "num_blocks": blocks,
        "tp_size": tp,
        "incarnation": inc,
    }


def refused(address: str) -> KvpushError:
    return control.UnreachablePeer(f"{address}: connection refused", "refused")


def named_once(notes: list[str], address: str) -> bool:
    pattern = re.compile(re.escape(address) + r"(?!\d)")
    return sum(len(pattern.findall(n)) for n in notes) == 1


# ------------------------------------------------------------------ choose


def test_a_stale_p_of_another_geometry_sorting_first_is_not_the_reference() -> None:
    stale = rec(Role.PREFILL, "10.0.0.1:1")  # closed port: does not answer
    other = rec(Role.PREFILL, "10.0.0.1:2")  # answers, another geometry, fewer share it
    p, d1, d2 = (rec(Role.PREFILL, "10.0.0.2:1"), rec(Role.DECODE, "10.0.0.3:1"),
                 rec(Role.DECODE, "10.0.0.3:2"))  # fmt: skip
    found: dict[str, Any] = {
        stale.address: refused(stale.address),
        other.address: md(Role.PREFILL, layers=4),
        p.address: md(Role.PREFILL),
        d1.address: md(Role.DECODE),
        d2.address: md(Role.DECODE),
    }
    st = choose([stale, other, p, d1, d2], found, blocks=4)
    assert st.reference == p.address
    assert (st.prefill, st.decode) == ([p.address], [d1.address, d2.address])
    assert set(st.meta) == {p.address, d1.address, d2.address}
    assert st.pending[stale.address][1] == "connection refused"
    assert "layers 4 vs 2" in st.out[other.address][1]


def test_strays_are_left_out_and_the_good_pair_starts() -> None:
    p, d = rec(Role.PREFILL, "10.0.0.2:1"), rec(Role.DECODE, "10.0.0.3:1")
    http = rec(Role.DECODE, "10.0.0.9:80")
    as_p = rec(Role.DECODE, "10.0.0.9:81")  # a D record carrying a live P's address
    layers4 = rec(Role.DECODE, "10.0.0.9:82")
    small = rec(Role.DECODE, "10.0.0.9:83")
    tp3 = rec(Role.DECODE, "10.0.0.9:84")
    silent = rec(Role.DECODE, "10.0.0.9:85")
    found: dict[str, Any] = {
        p.address: md(Role.PREFILL, tp=2),
        d.address: md(Role.DECODE, tp=2),
        http.address: control.NotASideChannel(
            f"{http.address} answered but is not a kvpush or vLLM side channel (looks like HTTP)",
            "http",
        ),
        as_p.address: md(Role.PREFILL),
        layers4.address: md(Role.DECODE, layers=4),
        small.address: md(Role.DECODE, blocks=2),
        tp3.address: md(Role.DECODE, tp=3),
        silent.address: control.UnreachablePeer(
            f"{silent.address}: timed out: accepted the connection but sent nothing", "silent"
        ),
    }
    records = [p, d, http, as_p, layers4, small, tp3, silent]
    st = choose(records, found, blocks=4)
    assert (st.prefill, st.decode) == ([p.address], [d.address])
    assert set(st.out) == {http.address, as_p.address, layers4.address, small.address,
                           tp3.address}  # fmt: skip
    assert set(st.pending) == {silent.address}
    assert st.out[http.address][1].startswith("answered but is not a kvpush")
    assert st.out[as_p.address][1] == "registered as decode, it is a prefill"
    assert "smaller than --blocks 4" in st.out[small.address][1]
    assert "do not divide" in st.out[tp3.address][1]
    notes = start_notes(st.out, st.pending)
    for r in records[2:]:
        assert named_once(notes, r.address), (r.address, notes)
    assert len(notes) == 6 and not any(d.address in n for n in notes)
    assert not any(n.startswith(f"registry: prefill {p.address}") for n in notes)


def test_no_p_that_answers_admits_nothing() -> None:
    p, d = rec(Role.PREFILL, "10.0.0.2:1"), rec(Role.DECODE, "10.0.0.3:1")
    st = choose([p, d], {p.address: refused(p.address), d.address: md(Role.DECODE)}, blocks=4)
    assert (st.prefill, st.decode, st.reference) == ([], [], "")


def test_many_strays_with_one_reason_share_one_note_naming_each_once() -> None:
    stale = [rec(Role.DECODE, f"10.0.1.1:{port}") for port in range(1, 501)]
    pending = {r.address: (r, "connection refused") for r in stale}
    notes = start_notes({}, pending)
    assert len(notes) == 1 and notes[0].startswith(
        "registry: 500 registered endpoints do not answer"
    )
    assert all(named_once(notes, r.address) for r in stale)
    few = {r.address: (r, "connection refused") for r in stale[: GROUP_AT - 1]}
    assert len(start_notes({}, few)) == GROUP_AT - 1


def test_registry_words_are_shown_on_one_line() -> None:
    bad = rec(Role.DECODE, "10.0.0.9:86", wire="vllm\n[red]drive: 100/100 ok\x1b[2J")
    why = unusable(bad)
    notes = start_notes({bad.address: (bad, why)}, {})
    assert len(notes) == 1 and "\n" not in notes[0] and "\x1b" not in notes[0]
    assert "\\n" in notes[0] and "\\x1b" in notes[0]


def test_contact_why_strips_the_address_and_says_whether_to_look_again() -> None:
    a = "10.0.0.5:7"
    assert contact_why(a, refused(a)) == ("connection refused", True)
    assert contact_why(a, PeerError(f"{a}: starting", "retry shortly")) == ("still starting", True)
    http = control.NotASideChannel(f"{a} answered but is not a side channel (HTTP)", "http")
    assert contact_why(a, http) == ("answered but is not a side channel (HTTP)", False)
    assert unusable(rec(Role.DECODE, "nowhere")).startswith("address 'nowhere' has no port")


# ------------------------------------------------------------------ one peer's fit


def test_misfit_names_role_pool_geometry_and_tp() -> None:
    ref = md(Role.PREFILL, tp=2)
    assert misfit(md(Role.DECODE), Role.DECODE, 4, ref, [ref]) == ""
    assert misfit(md(Role.PREFILL), Role.DECODE, 4) == "it is a prefill endpoint, not decode"
    assert misfit(md(Role.DECODE, blocks=2), Role.DECODE, 4) == (
        "its pool (2 blocks) is smaller than --blocks 4"
    )
    assert misfit(md(Role.DECODE, layers=4), Role.DECODE, 4, ref) == (
        "incompatible with the run's geometry: layers 4 vs 2, regions 8 vs 4"
    )
    assert misfit(md(Role.DECODE, tp=3), Role.DECODE, 4, ref, [ref]) == (
        "its TP size 3 and a prefill peer's 2 do not divide"
    )


# ------------------------------------------------------------------ sockets


@pytest.mark.parametrize("n_prefill", [1, 2, 10, 100, 2000])
@pytest.mark.parametrize("want", [1, 8, 64, 500, 5000])
def test_the_socket_plan_fits_the_budget_whatever_the_peers(n_prefill: int, want: int) -> None:
    workers, p_sockets = plan_sockets(want, n_prefill, p_threads=min(16, want))
    assert 1 <= workers <= want
    assert p_sockets <= workers + 16
    assert workers + p_sockets <= SOCKET_BUDGET
    if want <= 400:  # a fleet of Ps does not starve the workers (main gave 1 with 2,000 peers)
        assert workers == want


# ------------------------------------------------------------------ the checker's queue


def test_due_checks_runs_one_check_per_address_and_the_latest_record_next() -> None:
    started = threading.Event()
    release = threading.Event()
    seen: list[str] = []
    lock = threading.Lock()
    active: dict[str, int] = {}
    overlap: list[str] = []

    def check(r: EndpointRecord) -> float | None:
        with lock:
            active[r.address] = active.get(r.address, 0) + 1
            if active[r.address] > 1:
                overlap.append(r.address)
            seen.append(r.incarnation)
        if r.incarnation == "inc-1":
            started.set()
            release.wait(10)
        with lock:
            active[r.address] -= 1
        return None

    q = DueChecks(4, check)
    try:
        a = "10.0.0.1:1"
        q.want(rec(Role.DECODE, a, "inc-1"))
        assert started.wait(10)
        for inc in ("inc-2", "inc-3", "inc-4"):  # wanted while inc-1 is checked
            q.want(rec(Role.DECODE, a, inc))
        release.set()
        deadline = time.monotonic() + 10
        while seen[-1:] != ["inc-4"] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # nothing else is checked
        assert seen == ["inc-1", "inc-4"] and not overlap
        q.want(rec(Role.DECODE, "10.0.0.1:2"), 30.0)
        q.drop("10.0.0.1:2")  # its key went before it was due
    finally:
        q.stop()


# ------------------------------------------------------------------ the trace


def test_a_trace_record_says_whose_phases_are_missing(tmp_path: Path) -> None:
    t = Tracer(tmp_path / "t.jsonl")
    try:
        t.offsets["10.0.0.2:1"] = ClockOffset(0.0, 0.001)
        r = _Rec(t_wall=100.0, p="10.0.0.2:1", d="10.0.0.3:9")
        r.d_phases = {"allocated": 100.01}
        r.p_phases = {"write_posted": 100.02}
        r.result = RequestResult(0, "x-0", r.p, r.d, True, "", "", 0.05, 4096, True)
        out = t.record(0, r)
        assert out["phases_missing"] == "D 10.0.0.3:9: no clock offset (not measured)"
        assert "allocated" not in out["phases"] and out["phases"] == {"write_posted": 0.02}
    finally:
        t.close()

"""The fleet tools' pure parts: pair compatibility from records, record health, the watch model's
joins/leaves/restarts and push rates, the check's verdict, and the renderings of all three."""

from __future__ import annotations

import pytest
from rich.console import Console

from kvpush.commands.fleet import render as views
from kvpush.commands.fleet.check import CheckReport, PairResult
from kvpush.commands.fleet.command import parse_size
from kvpush.commands.fleet.view import FleetModel, rows_of
from kvpush.config import Role
from kvpush.errors import ConfigError, ExitStatus
from kvpush.fleet.pairs import blocks_for_size, pair_differences, record_health
from kvpush.fleet.record import EndpointRecord, Geometry, Load

T = 1_800_000_000.0


def rec(
    role: Role = Role.DECODE,
    address: str = "10.0.0.2:5601",
    incarnation: str = "inc-1",
    *,
    dtype: str = "bfloat16",
    layers: int = 2,
    tp: int = 1,
    kv_heads: int = 1,
    block_bytes: int = 4096,
    compat: str = "h1",
    load: Load | None = None,
    wire: str = "kvpush",
) -> EndpointRecord:
    return EndpointRecord(
        role=role,
        engine_id=f"{role[0]}-{address}",
        incarnation=incarnation,
        address=address,
        host="node-a",
        pid=42,
        tp_size=tp,
        wire=wire,
        geometry=Geometry(
            num_blocks=64,
            layers=layers,
            regions=2 * layers,
            block_bytes=block_bytes,
            dtype=dtype,
            kv_layout="NHD",
            kv_heads=kv_heads,
        ),
        compat_hash=compat,
        kvpush_version="0.1",
        started_at=T - 100,
        load=load or Load(free_blocks=60, in_flight=1, updated_at=T - 1),
    )


def test_pair_differences_names_each_field() -> None:
    p = rec(Role.PREFILL, "10.0.0.1:5600")
    assert pair_differences(p, rec()) == []
    d = rec(dtype="float16", layers=4, compat="h2")
    assert pair_differences(p, d) == [
        ("dtype", "bfloat16", "float16"), ("layers", 2, 4), ("regions", 4, 8)
    ]  # fmt: skip
    # Another protocol: the hash differs on no geometry field, and is named itself.
    assert pair_differences(p, rec(compat="h9")) == [("compat_hash", "h1", "h9")]
    # One model at TP 2 (per-rank page half the size) vs TP 1: the model's pages agree.
    p2 = rec(Role.PREFILL, "10.0.0.1:5600", tp=2, kv_heads=4, block_bytes=2048, compat="x")
    d1 = rec(tp=1, kv_heads=4, block_bytes=4096, compat="y")
    assert pair_differences(p2, d1) == [("compat_hash", "x", "y")]
    assert ("tp_size", 2, 3) in pair_differences(p2, rec(tp=3, compat="x"))


def test_record_health_and_blocks_for_size() -> None:
    assert record_health(rec(), T) == "ok"
    assert record_health(rec(load=Load(free_blocks=5, updated_at=T - 60)), T) == "stale"
    assert record_health(rec(load=Load(free_blocks=0, updated_at=T)), T) == "full"
    p = rec(Role.PREFILL, "10.0.0.1:5600")  # a block: 4 regions x 4096 = 16 KiB
    assert blocks_for_size(1 << 20, p, rec()) == (64, "")
    assert blocks_for_size(1, p, rec()) == (1, "")
    n, note = blocks_for_size(4 << 20, p, rec())
    assert n == 64 and "capped" in note


def test_model_join_update_restart_leave_and_rate() -> None:
    """The model takes the store's events as they are (``kvpush.fleet.store.change``: the one
    classification), so the kinds the views show are the store's."""
    from kvpush.fleet.store import change

    m = FleetModel()
    first = rec(Role.PREFILL, "10.0.0.1:5600")
    m.load([first])
    known = {first.address: first}
    a = "10.0.0.2:5601"

    def put(r: EndpointRecord | None, t: float, address: str = a):  # type: ignore[no-untyped-def]
        ev = change(known, address, r)
        return None if ev is None else m.apply(ev, t)

    ev = put(rec(address=a, load=Load(pushes_total=10, updated_at=T)), T)
    assert ev is not None and ev.kind == "join"
    assert put(rec(address=a, load=Load(pushes_total=40, updated_at=T + 2)), T + 2) is None
    row = next(r for r in m.rows(T + 2) if r.address == a)
    assert row.push_rate == pytest.approx(15.0)
    # Failures grow while nothing succeeds: "failing".
    bad = Load(pushes_total=40, failures_total=5, updated_at=T + 4)
    assert put(rec(address=a, load=bad), T + 4) is None
    assert next(r for r in m.rows(T + 4) if r.address == a).health == "failing"
    ev = put(rec(address=a, incarnation="inc-2"), T + 5)
    assert ev is not None and (ev.kind, ev.previous, ev.incarnation) == (
        "restart",
        "inc-1",
        "inc-2",
    )
    ev = put(None, T + 6)
    assert ev is not None and ev.kind == "leave"
    assert put(None, T + 7) is None
    assert [e.kind for e in m.events] == ["join", "restart", "leave"]
    line = views.event_line(m.events[1], T)
    assert line == "+5.0s restart decode 10.0.0.2:5601 (node-a) incarnation inc-1 -> inc-2"


def _render(obj: object) -> str:
    c = Console(width=200, no_color=True, record=True)
    c.print(obj)
    return c.export_text()


def test_ls_table_and_json() -> None:
    rows = rows_of([rec(), rec(Role.PREFILL, "10.0.0.1:5600", "abcdef0123456789")], T)
    text = _render(views.ls_table(rows, "prod"))
    assert "cluster prod: 1 prefill, 1 decode" in text
    assert text.index("10.0.0.1:5600") < text.index("10.0.0.2:5601")  # P first
    assert "abcdef01 " in text and "60/64" in text and "1m40s" in text
    js = views.rows_json(rows, "prod")
    assert [e["role"] for e in js["endpoints"]] == ["prefill", "decode"]
    assert js["endpoints"][1]["free_blocks"] == 60 and js["endpoints"][1]["health"] == "ok"
    assert "no endpoint registered" in _render(views.ls_table([], "prod"))


def test_check_verdict_and_matrix() -> None:
    ok = PairResult("P1", "D1", "ok", pushes=3, pushes_ok=3, p50_ms=1.5)
    inc = PairResult(
        "P1", "D2", "incompatible", "incompatible", "dtype bfloat16 vs float16",
        [("dtype", "bfloat16", "float16")],
    )  # fmt: skip
    fail = PairResult("P1", "D3", "failed", "no_free_blocks", "D D3: pool full")
    rep = CheckReport("c", ["P1"], ["D1", "D2"], [ok, inc], 1.0, 8)
    assert rep.exit_status is ExitStatus.OK
    strict = CheckReport("c", ["P1"], ["D1", "D2"], [ok, inc], 1.0, 8, strict=True)
    assert strict.exit_status is ExitStatus.NOT_READY
    rep3 = CheckReport("c", ["P1"], ["D1", "D2", "D3"], [ok, inc, fail], 1.0, 8)
    assert rep3.exit_status is ExitStatus.NOT_READY
    text = _render(views.check_text(rep3))
    assert "ok 1.5ms" in text and "FAIL no_free_blocks" in text
    assert "INCOMPATIBLE P1 -> D2: incompatible: dtype bfloat16 vs float16" in text
    assert "fleet check FAILED: 3 pairs (1 ok, 1 failed, 1 incompatible)" in text
    d = rep3.to_dict()
    assert d["counts"]["failed"] == 1 and d["exit_status"] == 3
    assert d["pairs"][1]["differences"] == [
        {"field": "dtype", "prefill": "bfloat16", "decode": "float16"}
    ]


def test_parse_size() -> None:
    assert parse_size("1MiB") == 1 << 20
    assert parse_size("256k") == 256 << 10
    assert parse_size("4096") == 4096
    with pytest.raises(ConfigError):
        parse_size("lots")

"""Records are data (issue 24, item 5): every rendering of the fleet tools -- ``fleet ls``'s
table, ``fleet watch``'s lines and live view, ``fleet check``'s matrix, lines and figures --
draws a registry or peer string literally (Rich markup not obeyed) and on one line (control
characters escaped: no terminal escape reaches the screen, no newline forges a row); the JSON
forms keep the strings exact. Pure: hand-built records rendered into a recording console.
"""

from __future__ import annotations

import json

from rich.console import Console

from kvpush.commands.fleet import render as views
from kvpush.commands.fleet.check import CheckReport, PairResult
from kvpush.commands.fleet.view import Change, rows_of
from kvpush.config import Role
from kvpush.fleet.record import EndpointRecord, Load
from tests.support.records import record

T = 1_800_000_000.0
#: Markup, a screen-clearing escape, a C1 control, a Unicode line separator and a newline
#: followed by what would pass for a row of its own.
HOSTILE = "[bold red]x[/]\x1b[2J\x9b\u2028\nP 6.6.6.6:666 forged"
SHOWN = "[bold red]x[/]\\x1b[2J\\x9b\\u2028\\nP 6.6.6.6:666 forged"


def rec(address: str = "10.0.0.2:5601", role: Role = Role.DECODE) -> EndpointRecord:
    return record(
        address,
        role,
        engine_id=HOSTILE,
        incarnation="\x1b]0;title\x07abcdef",
        host=HOSTILE,
        started_at=T - 100,
        load=Load(free_blocks=60, in_flight=1, updated_at=T - 1),
    )


def render(obj: object) -> str:
    c = Console(width=400, no_color=True, record=True, highlight=False)
    c.print(obj, soft_wrap=True)
    return c.export_text()


def assert_one_line_each(text: str) -> None:
    for bad in ("\x1b", "\x9b", "\u2028", "\x07"):
        assert bad not in text, (bad, text)
    assert not any(ln.lstrip().startswith("P 6.6.6.6") for ln in text.splitlines()), text


def test_ls_table_draws_hostile_strings_literally() -> None:
    rows = rows_of([rec(), rec("10.0.0.1:5600", Role.PREFILL)], T)
    text = render(views.ls_table(rows, "prod"))
    assert_one_line_each(text)
    assert text.count(SHOWN) == 4  # host and engine id of both rows, markup shown as text
    assert "\\x1b]0;tit" in text  # the incarnation's 8 characters, escaped
    assert len([ln for ln in text.splitlines() if "10.0.0." in ln]) == 2


def test_ls_json_keeps_strings_exact() -> None:
    rows = rows_of([rec()], T)
    back = json.loads(json.dumps(views.rows_json(rows, "prod")))
    assert back["endpoints"][0]["host"] == HOSTILE
    assert back["endpoints"][0]["engine_id"] == HOSTILE


def test_watch_lines_and_live_view_escape_events_and_status() -> None:
    r = rec()
    join = Change(T + 1, "join", r.address, r.role, r.host, r.incarnation)
    restart = Change(T + 2, "restart", r.address, r.role, r.host, "new\nP 6.6.6.6 x", "old")
    line = views.event_line(join, T)
    assert "\n" not in line and "\x1b" not in line
    assert line == f"+1.0s join decode 10.0.0.2:5601 ({SHOWN}) incarnation \\x1b]0;titl"
    assert "\n" not in views.event_line(restart, T)
    text = render(
        views.render_watch(rows_of([r], T), [join, restart], "prod", T, f"registry down: {HOSTILE}")
    )
    assert_one_line_each(text)
    assert f"registry down: {SHOWN}" in text


def test_check_text_escapes_addresses_reasons_and_details() -> None:
    p, d = "10.0.0.1:5600", f"10.0.0.2:1{HOSTILE}"
    failed = PairResult(p, d, "failed", f"deadline{HOSTILE}", f"D said {HOSTILE}", blocks=4,
                        pushes=3)  # fmt: skip
    inc = PairResult(p, "10.0.0.3:1", "incompatible", "incompatible", f"dtype bf16 vs {HOSTILE}",
                     [("dtype", "bf16", HOSTILE)])  # fmt: skip
    small = PairResult(p, "10.0.0.4:1", "skipped", "pool_too_small", "pool too small: ...")
    rep = CheckReport("prod", [p], sorted([d, "10.0.0.3:1", "10.0.0.4:1"]), [failed, inc, small],
                      1.0, 8, notes=[f"note {HOSTILE}"])  # fmt: skip
    text = render(views.check_text(rep))
    assert_one_line_each(text)
    assert f"FAILED {p} -> 10.0.0.2:1{SHOWN}: deadline{SHOWN}: D said {SHOWN}" in text
    assert f"INCOMPATIBLE {p} -> 10.0.0.3:1: incompatible: dtype bf16 vs {SHOWN}" in text
    assert f"note: note {SHOWN}" in text
    assert "pool too small" in text
    assert "fleet check FAILED: 3 pairs (0 ok, 1 failed, 1 incompatible, 1 skipped)" in text
    back = json.loads(json.dumps(views.check_json(rep)))
    assert back["pairs"][0]["detail"] == f"D said {HOSTILE}"
    assert back["pairs"][1]["differences"][0]["decode"] == HOSTILE

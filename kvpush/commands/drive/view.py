"""How ``kvpush drive`` prints its summary and progress for a person.

Pure functions of a ``DriveReport`` (``kvpush.commands.common.results``) returning rich
renderables or strings (``--json`` prints ``to_dict`` instead). Runs on the main thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.text import Text

from kvpush.commands.common.readings import fmt_bytes
from kvpush.commands.common.rows import Rows, in_ms

if TYPE_CHECKING:
    from kvpush.commands.common.reasons import Leg
    from kvpush.commands.common.results import DriveReport


def drive_summary(r: DriveReport, title: str = "drive") -> RenderableType:
    """The human form of a ``DriveReport``."""
    t = Rows()
    t.add("requests", f"{r.requests}: {r.ok} ok, {r.failed} failed")
    for reason, n in r.failures_by_reason.items():
        t.add("", f"{n} × {reason}")
    for line in r.first_failures:
        t.add("", f"e.g. {line}")
    t.add("latency", in_ms(*((q, r.latency_s[q]) for q in ("p50", "p90", "p99", "max"))))
    t.add("throughput", f"{r.requests_per_s:.1f} requests/s · {r.gb_per_s:.3f} GB/s")
    t.add("bytes", f"{fmt_bytes(r.bytes_total)} in {r.elapsed_s:.2f} s")
    t.add("by decode", " · ".join(f"{a} {n}" for a, n in r.by_decode.items()))
    t.add(
        "all bytes verified",
        Text.from_markup(
            "[green]yes[/green]" if r.all_verified else f"[red]no[/red] ({r.verified}/{r.requests})"
        ),
    )
    if getattr(r, "interrupted", False):
        t.add("interrupted", "yes: requests not sent or still in flight count as cancelled")
    for i, (name, st) in enumerate(getattr(r, "phases", {}).items()):
        t.add(
            "phases (since sent)" if i == 0 else "",
            f"{name}: {in_ms(('p50', st['p50']), ('p99', st['p99']))}",
        )
    for e in getattr(r, "peer_events", []):
        t.add("peer event", e)
    for n in getattr(r, "notes", []):
        t.add("note", n)
    return Group(Text.from_markup(f"[bold]{title} summary[/bold]"), t.render())


def drive_progress_line(
    done: int,
    ok: int,
    failed: int,
    in_flight: int,
    total: int,
    peers: list[tuple[str, Leg, bool, str, int]],
) -> str:
    """One progress line for stderr when it is not a terminal (every few seconds)."""
    down = [f"{addr} ({role}) down" for addr, role, up, _why, _n in peers if not up]
    tail = f"; {', '.join(down)}" if down else ""
    return f"drive: {done}/{total} done, {ok} ok, {failed} failed, {in_flight} in flight{tail}"

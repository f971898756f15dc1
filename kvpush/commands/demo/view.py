"""How ``kvpush demo`` prints itself: the live view, the progress line, the summary.

Pure functions of the demo's progress and ``DemoReport`` returning rich renderables or strings;
the summary starts with drive's (``kvpush.commands.drive.view``). Runs on the main thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from kvpush.commands.common.live import render_live
from kvpush.commands.drive.view import drive_summary
from kvpush.telemetry.snapshot import snapshot_from_dict

if TYPE_CHECKING:
    from kvpush.commands.demo.demo import DemoReport


def demo_summary(r: DemoReport) -> RenderableType:
    """The human form of a ``DemoReport``: the drive summary, the children, the events."""
    lines: list[RenderableType] = [drive_summary(r.drive, title="demo")]
    for c in r.children:
        state = f"exited {c['returncode']}"
        extra = " (joined mid-run)" if c["extra"] else ""
        lines.append(
            Text(
                f"  {c['name']:<4} {c['role']:<8} {c['address']:<22} {c['requests']:>5} "
                f"requests, {state}{extra}"
            )
        )
    lines += [Text(f"  {e}", style="dim") for e in r.events]
    if r.kept_logs:
        lines.append(Text(f"  logs kept in {r.workdir}"))
    if getattr(r, "interrupted", False):
        lines.append(Text.from_markup("[yellow]demo interrupted[/yellow]"))
    else:
        lines.append(
            Text.from_markup("[green]demo ok[/green]" if r.ok else "[red]demo FAILED[/red]")
        )
    return Group(*lines)


def demo_view(
    progress: tuple[int, int, int, int],
    total: int,
    events: list[str],
    snap: dict[str, object] | None,
) -> RenderableType:
    """The demo's live view: a progress bar, the last events and P's telemetry."""
    done, _ok, failed, ndec = progress
    head = Table.grid(padding=(0, 2))
    head.add_row(
        Text("demo", style="bold"),
        ProgressBar(total=total, completed=done, width=40),
        Text(f"{done}/{total} requests · {failed} failed · {ndec} decoders"),
    )
    parts: list[RenderableType] = [head, *[Text(e, style="dim") for e in events[-4:]], Text()]
    if snap is not None:
        parts.append(render_live(snapshot_from_dict(snap)))
    return Group(*parts)


def demo_progress_line(progress: tuple[int, int, int, int], total: int) -> str:
    done, _ok, failed, ndec = progress
    return f"demo: {done}/{total} requests, {failed} failed, {ndec} decoders"

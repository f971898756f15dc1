"""How ``kvpush leg`` prints one leg's report for a person (``--json`` prints ``to_dict``).

Pure: a ``LegReport`` (``kvpush.commands.leg.legs``) in, a rich renderable out. Main thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import RenderableType
from rich.text import Text

from kvpush.commands.common.readings import fmt_bytes
from kvpush.commands.common.rows import Rows
from kvpush.config import Role

if TYPE_CHECKING:
    from kvpush.commands.leg.legs import LegReport


def leg_report(r: LegReport) -> RenderableType:
    """The human form of a ``vllm_legs.LegReport`` (one decode or prefill leg)."""
    t = Rows()
    if r.ok:
        state = Text.from_markup("[green]ok[/green]")
    else:
        state = Text.from_markup(f"[red]{r.outcome}[/red]: {r.reason or 'no reason given'}")
    t.add(f"{r.leg} leg", state)
    params = r.kv_transfer_params or {}
    peer = (
        f"{params.get('remote_engine_id', '?')} at {params.get('remote_host', '?')}:"
        f"{params.get('remote_port', '?')} (tp {params.get('tp_size', 1)})"
    )
    if r.leg == Role.DECODE:
        t.add("D", r.address)
        t.add("P", peer)
        t.add("request", f"{r.request_id or '?'} (P's {params.get('remote_request_id', '?')})")
    else:
        t.add("P", r.address)
        t.add("request", r.request_id)
    if r.detail:
        t.add("detail", r.detail)
    moved = "received" if r.leg == Role.DECODE else "pushed"
    t.add(moved, f"{fmt_bytes(r.nbytes)} ({r.nbytes} bytes) in {r.seconds:.2f} s")
    if r.sha256:
        t.add("sha256", r.sha256)
    return t.render()

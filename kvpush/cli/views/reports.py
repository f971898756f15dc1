"""Renderers of the tools' results: a probe report, a drive summary, a demo summary and view.

Owns how ``kvpush probe``, ``kvpush drive`` and ``kvpush demo`` print their results for a
person (``--json`` prints the reports' ``to_dict`` instead). Pure functions of the report
dataclasses of ``kvpush.ops``, returning rich renderables: label/value lines without table
padding, so a pipe gets no trailing blanks. Runs on whichever thread prints (the main thread).
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from kvpush.cli.views.live import render_live
from kvpush.cli.views.readings import fmt_bytes, fmt_ms
from kvpush.config import Role
from kvpush.ops.probe_report import served_ranks  # pure: no sockets, safe for Tab completion
from kvpush.telemetry.snapshot import snapshot_from_dict


class Rows:
    """Label/value lines, printed without table padding (no trailing blanks in pipes)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, Any]] = []

    def add(self, label: str, value: Any) -> None:
        self.rows.append((label, value))

    def render(self) -> Group:
        width = max((len(k) for k, _ in self.rows), default=0)
        lines = []
        for k, v in self.rows:
            value = v if isinstance(v, Text) else Text(str(v))
            lines.append(Text.assemble((k.ljust(width), "dim"), "  ", value))
        return Group(*lines)


def ibytes(n: float) -> str:
    """Binary units for geometry (block sizes are powers of two): 4 KiB, 512 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


# ----------------------------------------------------------------------------------- probe


def _kvpush_rows(t: Rows, md: dict[str, Any]) -> None:
    t.add("role", md.get("role"))
    t.add("engine id", md.get("engine_id"))
    t.add("incarnation", md.get("incarnation"))
    t.add("agent", md.get("agent_name"))
    t.add(
        "versions",
        f"kvpush {md.get('kvpush_version')} · protocol v{md.get('protocol_version')} · "
        f"nixl {md.get('nixl_version') or '?'} · ucx {md.get('ucx_version') or '?'}",
    )
    t.add("device", f"{md.get('device_kind')} (id {md.get('device_id')})")
    try:
        total = ibytes(int(md["num_blocks"]) * int(md["regions"]) * int(md["block_bytes"]))
        t.add(
            "geometry",
            f"{md['num_blocks']} blocks × {md['regions']} regions ({md['layers']} layers × "
            f"K/V) × {ibytes(int(md['block_bytes']))}, {md.get('dtype')}, "
            f"{md.get('kv_layout')}: {total}",
        )
    except (KeyError, TypeError, ValueError):
        t.add("geometry", "?")
    ranks = served_ranks(md.get("ranks") or [], md.get("tp_size"))
    tp_size = md.get("tp_size")
    t.add("ranks", ranks if tp_size == 1 else f"{ranks}, describing rank {md.get('tp_rank')}")
    t.add("backends", ",".join(md.get("backends") or []))
    t.add("auth", "on" if md.get("auth") else "off")


def _vllm_rows(t: Rows, md: dict[str, Any]) -> None:
    for k, v in md.items():
        if k in ("agent_metadata_bytes", "ranks", "regions", "kv_caches_base_addr"):
            continue
        t.add(k, v)
    t.add("regions", f"{md.get('regions')}: base addresses {md.get('kv_caches_base_addr')}")
    t.add("agent metadata", f"{md.get('agent_metadata_bytes')} bytes (not loaded)")
    t.add("rank", f"pp {md['ranks'][0][0]}, tp {md['ranks'][0][1]}")


def probe_report(r: Any) -> RenderableType:
    """The human form of a ``ProbeReport``: a headline and label/value rows."""
    status = "healthy" if not r.differences else "INCOMPATIBLE"
    head = Text.from_markup(f"[bold]{r.kind} endpoint at {r.address}[/bold]: {status}")
    t = Rows()
    (_kvpush_rows if r.kind == "kvpush" else _vllm_rows)(t, r.metadata)
    t.add("compat hash", r.compat_hash)
    rtt = r.rtt
    t.add(
        "rtt",
        f"{_in_ms(('min', rtt.min_s), ('median', rtt.median_s))} ({len(rtt.samples_s)} samples)",
    )
    t.add("clock offset", f"{rtt.clock_offset_s * 1e3:+.3f} ms")
    _compat_rows(t, r)
    _timing_rows(t, r)
    mine = getattr(r, "local_versions", None)
    if mine:
        t.add(
            "this host",
            f"nixl {mine.get('nixl') or '?'} ({mine.get('nixl_build') or '?'}) · "
            f"ucx {mine.get('ucx') or '?'}",
        )
    for w in getattr(r, "version_warnings", []):
        t.add("known issue", w)
    for n in r.notes:
        t.add("note", n)
    for i, line in enumerate(getattr(r, "suggest", [])):
        t.add("kvpush to fit it" if i == 0 else "", line)
    return Group(head, t.render())


def _in_ms(*figures: tuple[str, float]) -> str:
    """Named durations in seconds, for a person: ``min 0.120 ms · median 0.250 ms``."""
    return " · ".join(f"{name} {fmt_ms(s)} ms" for name, s in figures)


def _compat_rows(t: Rows, r: Any) -> None:
    if r.differences:
        t.add("compatible", "NO")
        for f, local, remote in r.differences:
            t.add("", f"{f}: local {local}, remote {remote}")
    elif r.compat_checked:
        t.add("compatible", "yes")
    elif r.kind == "kvpush":
        t.add("compatible", "protocol yes; geometry not checked (give --block-bytes, --layers...)")


def _timing_rows(t: Rows, r: Any) -> None:
    """The handshake's phases (``--handshake``) and the NIXL pings (``--ping``)."""
    if r.handshake_timings_s is not None:
        phases = [(k.removesuffix("_s"), v) for k, v in r.handshake_timings_s.items()]
        t.add(f"handshake ({r.handshake_mode})", _in_ms(*phases))
    if r.ping_s:
        pings = sorted(r.ping_s)
        figures = _in_ms(("min", pings[0]), ("median", pings[len(pings) // 2]), ("max", pings[-1]))
        t.add("nixl ping", f"{figures} ({len(pings)} round trips)")


def probe_stats(r: Any) -> RenderableType | None:
    """The peer's live telemetry of ``probe --stats`` (None without it)."""
    return None if r.stats is None else render_live(snapshot_from_dict(r.stats))


# ------------------------------------------------------------------------------ drive, demo


def drive_summary(r: Any, title: str = "drive") -> RenderableType:
    """The human form of a ``DriveReport``."""
    t = Rows()
    t.add("requests", f"{r.requests}: {r.ok} ok, {r.failed} failed")
    for reason, n in r.failures_by_reason.items():
        t.add("", f"{n} × {reason}")
    for line in r.first_failures:
        t.add("", f"e.g. {line}")
    t.add("latency", _in_ms(*((q, r.latency_s[q]) for q in ("p50", "p90", "p99", "max"))))
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
            f"{name}: {_in_ms(('p50', st['p50']), ('p99', st['p99']))}",
        )
    for e in getattr(r, "peer_events", []):
        t.add("peer event", e)
    for n in getattr(r, "notes", []):
        t.add("note", n)
    return Group(Text.from_markup(f"[bold]{title} summary[/bold]"), t.render())


def drive_progress_line(
    done: int, ok: int, failed: int, in_flight: int, total: int, peers: list[Any]
) -> str:
    """One progress line for stderr when it is not a terminal (every few seconds)."""
    down = [f"{addr} ({role}) down" for addr, role, up, _why, _n in peers if not up]
    tail = f"; {', '.join(down)}" if down else ""
    return f"drive: {done}/{total} done, {ok} ok, {failed} failed, {in_flight} in flight{tail}"


def leg_report(r: Any) -> RenderableType:
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


def demo_summary(r: Any) -> RenderableType:
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
    progress: tuple[int, int, int, int], total: int, events: list[str], snap: dict[str, Any] | None
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

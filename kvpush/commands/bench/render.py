"""Text and markdown renderings of scenario results: pure functions of ``Report.to_dict()``.

``render_text`` is what ``kvpush bench`` prints; ``render_markdown`` one scenario's section of
``summary.md``, which ``render_summary`` writes for a whole ``bench all`` run (the host, then every
scenario). Run in the orchestrator process, on the caller's thread; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.commands.bench.report import Machine, ResultDict, TableDict


def _table_lines(t: TableDict, sep: str = "  ") -> list[str]:
    cols = t["columns"]
    rows = t["rows"]
    widths = [
        max(len(str(c)), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)
    ]
    out = [sep.join(str(c).ljust(w) for c, w in zip(cols, widths, strict=True))]
    out.append(sep.join("-" * w for w in widths))
    for r in rows:
        out.append(
            sep.join(
                c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths, strict=True)
            )
        )
    return out


def _numeric(cell: str) -> bool:
    s = cell.replace(",", "").replace("x", "").replace("%", "").strip()
    try:
        float(s)
        return True
    except ValueError:
        return False


def _md_table_lines(t: TableDict) -> list[str]:
    rows = ["| " + " | ".join(row) + " |" for row in t["rows"]]
    return [
        "| " + " | ".join(t["columns"]) + " |",
        "|" + "|".join("---" for _ in t["columns"]) + "|",
        *rows,
    ]


def _load(machine: Machine) -> str:
    """The host's 1-minute load average at the scenario's start and end."""
    start, end = machine["loadavg"][0], machine["loadavg_end"][0]
    return f"load average {start:.2f} at start, {end:.2f} at end"


def _met(m: bool | None) -> str:
    return "met" if m is True else "MISSED" if m is False else "n/a"


def render_text(r: ResultDict) -> str:
    lines = [f"== {r['title']} ({r['command']}, {r['elapsed_s']:.0f}s) =="]
    for t in r["tables"]:
        lines += ["", t["title"], *_table_lines(t)]
        if t.get("note"):
            lines.append(f"  {t['note']}")
    if r["targets"]:
        lines.append("")
        lines.append("targets")
        for tg in r["targets"]:
            lines.append(
                f"  [{_met(tg['met'])}] {tg['name']}: {tg['measured']} (target {tg['target']})"
            )
            if tg.get("note"):
                lines.append(f"      {tg['note']}")
    for n in r["notes"]:
        lines.append(f"note: {n}")
    for c in r["charts"]:
        lines.append(f"chart: {c}")
    if r.get("host_noise"):
        from kvpush.commands.bench.noise import describe

        lines.append(describe(r["host_noise"]))
    m = r["machine"]
    lines.append(f"host: {m.get('cpus')} CPUs ({m.get('cpu', '?')}), {_load(m)}")
    return "\n".join(lines)


def render_markdown(r: ResultDict) -> str:
    out = [f"### {r['title']}", "", f"`{r['command']}` — {r['elapsed_s']:.0f} s", ""]
    for t in r["tables"]:
        out += [f"**{t['title']}**", "", *_md_table_lines(t)]
        if t.get("note"):
            out += ["", t["note"]]
        out.append("")
    if r["targets"]:
        out += ["| target | asked | measured | |", "|---|---|---|---|"]
        out += [
            f"| {tg['name']} | {tg['target']} | {tg['measured']} | **{_met(tg['met'])}** |"
            for tg in r["targets"]
        ]
        out.append("")
    notes = list(r["notes"])
    if r.get("host_noise"):
        from kvpush.commands.bench.noise import describe

        notes.append(f"{describe(r['host_noise'])}; {_load(r['machine'])}")
    for n in notes:
        out.append(f"- {n}")
    if notes:
        out.append("")
    return "\n".join(out)


def render_summary(results: Sequence[ResultDict]) -> str:
    """Markdown of a whole ``bench all`` run: the host, then every scenario's tables."""
    if not results:
        return ""
    m = results[0]["machine"]
    total = sum(r["elapsed_s"] for r in results)
    quick = " --quick" if results[0]["quick"] else ""
    head = [
        f"Run `kvpush bench all{quick}` started {results[0]['started_at']}, {total:.0f} s in all.",
        "",
        f"Host: {m.get('cpus')} CPUs ({m.get('cpu', '?')}), {m.get('mem_gib', '?')} GiB, Linux "
        f"{m.get('kernel')}, Python {m.get('python')}, nixl {m.get('nixl', '?')}, torch "
        f"{m.get('torch', '?')}, UCX_TLS {m.get('ucx_tls')}. Load average (1 min) at the start "
        "of each scenario: "
        + ", ".join(f"{r['scenario']} {r['machine']['loadavg'][0]:.2f}" for r in results)
        + ".",
        "",
    ]
    return "\n".join(head + [render_markdown(r) for r in results])

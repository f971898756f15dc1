"""``drive --workload``'s report: drive's summary plus what a replayed trace needs said.

Owns ``Record`` (one replayed request: its trace line, size, when it was due, how late it
started, when it ended and how), ``build`` (pure: the records, D's pool samples and drive's
summary -> ``WorkloadReport``) and ``workload_summary`` (the text form). The figures:

* ``rate``: offered (the trace's requests over its span, after ``--speedup``) and achieved (ok
  requests per second of the run);
* ``lateness``: how long after its time each request started (p50, p99, max) against the
  tool's tolerance, and how many were later;
* ``latency_by_prompt``: per prompt-size bucket (tokens), requests, ok, failed and the p50/p99
  of drive's latency (request sent -> D's answer, the push included) of the ok ones (None when
  none was ok);
* ``gb_per_s``: bytes of the ok requests over time, by when they ended, in ``bin_s`` bins;
* ``pools``: per D, from its own gauges (``kvpush.commands.drive.occupancy``): peak blocks
  used of its pool, seconds at 100 % (no free block), the highest use in each bin; and
  ``demand_peak``: the most blocks of requests sent there and not yet answered at once
  (drive's exact view: the pool that would have held every request sent to it).

Failures by reason are drive's own (``failures_by_reason``). Pure; any thread.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from rich.console import Group, RenderableType
from rich.text import Text

from kvpush.commands.common.results import DriveReport, RequestResult
from kvpush.commands.common.rows import Rows, in_ms
from kvpush.commands.common.stats import percentile
from kvpush.commands.drive.schedule import Pools
from kvpush.commands.drive.view import drive_summary
from kvpush.commands.workload.trace import Workload

#: Prompt-size buckets (tokens): [low, high).
BUCKETS: tuple[tuple[int, int, str], ...] = (
    (0, 1024, "<1k"),
    (1024, 4096, "1k-4k"),
    (4096, 16384, "4k-16k"),
    (16384, 65536, "16k-64k"),
    (65536, 1 << 62, ">=64k"),
)
#: Bin widths (seconds) for the series: the smallest that gives at most ``MAX_BINS`` bins.
BIN_CHOICES = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
MAX_BINS = 40
SPARK = "▁▂▃▄▅▆▇█"

#: One sample of a D's pool: (seconds since the run started, address, used, total).
PoolPoint = tuple[float, str, int, int]


@dataclass(frozen=True)
class Record:
    line: int
    tokens: int
    blocks: int
    due_s: float
    late_s: float | None  # None: never started (interrupted before its time)
    ended_s: float
    result: RequestResult


class Quantiles(TypedDict):
    p50: float
    p99: float


class LatencyBucket(TypedDict):
    """One prompt-size bucket of ``latency_by_prompt``."""

    bucket: str
    tokens: list[int | None]  # [low, high); high None for the last
    requests: int
    ok: int
    failed: int
    latency_s: Quantiles | None  # of the ok ones (None when none was ok)


class PoolFigures(TypedDict):
    """One D's pool over the run, from its own gauges (``pools``)."""

    total_blocks: int
    peak_used_blocks: int
    peak_fraction: float
    time_full_s: float
    samples: int
    used_blocks: list[int | None]  # the highest use in each bin (None: no sample)
    demand_peak_blocks: int


class Rate(TypedDict):
    offered_per_s: float | None
    achieved_ok_per_s: float


class Lateness(TypedDict):
    p50: float
    p99: float
    max: float
    tolerance_s: float
    late: int


class WorkloadFigures(TypedDict):
    """The replay's figures: ``workload`` of ``drive --workload --json``."""

    source: str
    requests: int
    bad_lines: int
    before_start_at: int
    start_at_s: float
    speedup: float
    block_tokens: int
    blocks_total: int
    blocks_ok: int
    rate: Rate
    lateness_s: Lateness
    workers: int
    latency_by_prompt: list[LatencyBucket]
    bin_s: float
    gb_per_s: list[float]
    pools: dict[str, PoolFigures]


@dataclass(frozen=True)
class WorkloadReport:
    base: DriveReport
    workload: WorkloadFigures

    @property
    def all_verified(self) -> bool:
        return self.base.all_verified

    @property
    def interrupted(self) -> bool:
        return self.base.interrupted

    @property
    def notes(self) -> list[str]:
        return self.base.notes

    def to_dict(self) -> dict[str, object]:
        return {**self.base.to_dict(), "workload": self.workload}


def bin_width(elapsed_s: float) -> float:
    return next((w for w in BIN_CHOICES if elapsed_s / w <= MAX_BINS), BIN_CHOICES[-1])


def _q(xs: Sequence[float]) -> dict[str, float]:
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs, default=0.0)}


def _buckets(recs: Sequence[Record]) -> list[LatencyBucket]:
    out: list[LatencyBucket] = []
    for lo, hi, name in BUCKETS:
        inb = [r for r in recs if lo <= r.tokens < hi]
        if not inb:
            continue
        lat = [r.result.latency_s for r in inb if r.result.ok]
        out.append(
            {
                "bucket": name,
                "tokens": [lo, hi if hi < 1 << 62 else None],
                "requests": len(inb),
                "ok": len(lat),
                "failed": len(inb) - len(lat),
                "latency_s": {"p50": percentile(lat, 50), "p99": percentile(lat, 99)}
                if lat
                else None,
            }
        )
    return out


def _throughput(recs: Sequence[Record], width: float, bins: int) -> list[float]:
    got = [0.0] * bins
    for r in recs:
        if r.result.ok:
            got[min(bins - 1, max(0, int(r.ended_s // width)))] += r.result.nbytes
    return [b / width / 1e9 for b in got]


def _demand(recs: Sequence[Record]) -> dict[str, int]:
    """Per D: the most blocks of requests sent there and not answered yet, at once."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for r in recs:
        res = r.result
        if not res.decode or res.latency_s <= 0:
            continue  # never sent
        events[res.decode] += [(r.ended_s - res.latency_s, r.blocks), (r.ended_s, -r.blocks)]
    peaks = {}
    for d, evs in events.items():
        now = peak = 0
        for _t, n in sorted(evs, key=lambda e: (e[0], e[1])):  # an end before a start at a tie
            now += n
            peak = max(peak, now)
        peaks[d] = peak
    return peaks


def _pools(
    points: Sequence[PoolPoint], width: float, bins: int, demand: Mapping[str, int], pools: Pools
) -> dict[str, PoolFigures]:
    by: dict[str, list[PoolPoint]] = defaultdict(list)
    for p in points:
        by[p[1]].append(p)
    out: dict[str, PoolFigures] = {}
    for d in dict.fromkeys([*pools.decode, *by, *demand]):
        pts = sorted(by.get(d, []))
        total = max((p[3] for p in pts), default=pools.decode.get(d, 0))
        full = sum(b[0] - a[0] for a, b in itertools.pairwise(pts) if a[2] >= a[3])
        series: list[int | None] = [None] * bins
        for t, _a, used, _tot in pts:
            k = min(bins - 1, max(0, int(t // width)))
            series[k] = max(series[k] or 0, used)
        peak = max((p[2] for p in pts), default=0)
        out[d] = {
            "total_blocks": total,
            "peak_used_blocks": peak,
            "peak_fraction": peak / total if total else 0.0,
            "time_full_s": full,
            "samples": len(pts),
            "used_blocks": series,
            "demand_peak_blocks": demand.get(d, 0),
        }
    return out


def build(
    base: DriveReport,
    recs: Sequence[Record],
    points: Sequence[PoolPoint],
    pools: Pools,
    *,
    workload: Workload,
    block_tokens: int,
    speedup: float,
    tolerance_s: float,
    concurrency: int,
) -> WorkloadReport:
    span = max((r.due_s for r in recs), default=0.0)
    elapsed = base.elapsed_s
    width = bin_width(elapsed)
    bins = max(1, int(elapsed // width) + 1)
    late = [r.late_s for r in recs if r.late_s is not None]
    over = sum(1 for x in late if x > tolerance_s)
    q = _q(late)
    w: WorkloadFigures = {
        "source": workload.source,
        "requests": len(recs),
        "bad_lines": len(workload.problems),
        "before_start_at": workload.before_start,
        "start_at_s": workload.start_at_s,
        "speedup": speedup,
        "block_tokens": block_tokens,
        "blocks_total": sum(r.blocks for r in recs),
        "blocks_ok": sum(r.blocks for r in recs if r.result.ok),
        "rate": {
            "offered_per_s": (len(recs) - 1) / span if span > 0 else None,
            "achieved_ok_per_s": base.ok / elapsed if elapsed > 0 else 0.0,
        },
        "lateness_s": {
            "p50": q["p50"],
            "p99": q["p99"],
            "max": q["max"],
            "tolerance_s": tolerance_s,
            "late": over,
        },
        "workers": concurrency,
        "latency_by_prompt": _buckets(recs),
        "bin_s": width,
        "gb_per_s": _throughput(recs, width, bins),
        "pools": _pools(points, width, bins, _demand(recs), pools),
    }
    return WorkloadReport(base, w)


def spark(values: Sequence[float | None]) -> str:
    """A one-line chart of ``values`` (a blank where there is none), scaled to their peak."""
    peak = max((v for v in values if v is not None), default=0.0)
    if peak <= 0:
        return SPARK[0] * len(values)
    top = len(SPARK) - 1
    return "".join(" " if v is None else SPARK[min(top, round(v / peak * top))] for v in values)


def workload_summary(r: WorkloadReport) -> RenderableType:
    """The human form of a ``WorkloadReport``: drive's summary, then the replay's."""
    w = r.workload
    t = Rows()
    bad = f" ({w['bad_lines']} bad lines skipped)" if w["bad_lines"] else ""
    t.add(
        "workload",
        f"{w['source']}: {w['requests']} requests{bad} · speedup {w['speedup']:g} · "
        f"{w['block_tokens']} tokens per block",
    )
    offered = w["rate"]["offered_per_s"]
    off = f"{offered:.2f}" if offered is not None else "-"
    t.add("rate", f"offered {off} requests/s · achieved {w['rate']['achieved_ok_per_s']:.2f} ok/s")
    lt = w["lateness_s"]
    t.add(
        "start lateness",
        f"{in_ms(('p50', lt['p50']), ('p99', lt['p99']), ('max', lt['max']))} "
        f"({lt['late']} later than {lt['tolerance_s'] * 1000:g} ms; {w['workers']} workers)",
    )
    for i, b in enumerate(w["latency_by_prompt"]):
        q = b["latency_s"]
        lat = f" · {in_ms(('p50', q['p50']), ('p99', q['p99']))}" if q else ""
        failed = f", {b['failed']} failed" if b["failed"] else ""
        t.add(
            "latency by prompt" if i == 0 else "",
            f"{b['bucket']} tokens: {b['ok']} ok{failed}{lat}",
        )
    gb = w["gb_per_s"]
    t.add(f"GB/s per {w['bin_s']:g} s", f"{spark(gb)} peak {max(gb, default=0.0):.3f}")
    for d, p in w["pools"].items():
        t.add(
            f"D pool {d}",
            f"{spark(p['used_blocks'])} peak {p['peak_used_blocks']:,}/{p['total_blocks']:,} "
            f"blocks ({p['peak_fraction']:.0%}) · {p['time_full_s']:.1f} s full · in flight at "
            f"most {p['demand_peak_blocks']:,} blocks",
        )
    return Group(drive_summary(r.base), Text(""), t.render())

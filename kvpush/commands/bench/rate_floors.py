"""``kvpush bench rate``'s small-request figures beside their floors, from one run: kvpush's
1-block pushes and its notifications each way, raw NIXL's WRITE+notification loop and its
notifications alone, and UCX's own message rates (``kvpush.commands.bench.ucx_floors``). Pure
functions of the measured rounds; runs in the orchestrator process after every round.
"""

from __future__ import annotations

import math
from typing import Literal

from kvpush.commands.bench.rate_report import InflightRounds, KvRound
from kvpush.commands.bench.report import Report, fmt_num
from kvpush.commands.bench.stats import median, ratio
from kvpush.commands.bench.ucx_floors import Floor

#: A direction of kvpush's notifications in a round (``KvRound``'s counted deltas).
Direction = Literal["d_to_p_notifs", "p_to_d_notifs"]

_KINDS = {
    "ucp_am_bw": "messages back to back",
    "ucp_am_lat": "ping-pong",
    "ucp_put_bw": "puts back to back",
}


def _per_s(rounds: list[KvRound], key: Direction) -> float:
    """Notifications a second of one direction (median of rounds), from counted deltas."""
    vals = [r.get(key, 0) / r.get("elapsed_s", math.nan) for r in rounds if key in r]
    return median(vals) if vals else math.nan


def _per_notif(rounds: list[KvRound], key: Direction) -> float:
    """Pushes a notification of one direction carried (median of rounds)."""
    vals = [
        ratio(r["per_s"] * r.get("elapsed_s", math.nan), r.get(key, 0)) for r in rounds if key in r
    ]
    return median(vals) if vals else math.nan


def kvpush_rows(e: InflightRounds, inflight: int) -> list[list[str]]:
    """kvpush's pushes and notifications, and raw NIXL's WRITE loop and notifications."""
    kv, raw, notifs = e["kvpush"], e["raw"], e.get("raw_notifs") or []
    post = [r["post_us_per_desc"] for r in raw if "post_us_per_desc" in r]
    rows = [
        [
            f"kvpush: 1-block pushes, {inflight} in flight",
            fmt_num(median([r["per_s"] for r in kv]), 0),
            f"P writer {fmt_num(median([r['writer_cpu_us'] for r in kv]), 1)}, "
            f"D process {fmt_num(median([r['d_cpu_us'] for r in kv]), 1)}",
            f"P posts {fmt_num(median([r['post_us_per_desc'] for r in kv]), 1)} us a descriptor",
        ],
    ]
    directions: tuple[tuple[Direction, str], ...] = (
        ("d_to_p_notifs", "kvpush: notifications D -> P (PUSH_REG batches)"),
        ("p_to_d_notifs", "kvpush: notifications P -> D (completions)"),
    )
    for key, what in directions:
        rows.append(
            [
                what,
                fmt_num(_per_s(kv, key), 0),
                "-",
                f"{fmt_num(_per_notif(kv, key), 1)} pushes each",
            ]
        )
    rows.append(
        [
            f"raw NIXL: WRITE + notification, {inflight} in flight",
            fmt_num(median([r["per_s"] for r in raw]), 0),
            f"loop thread {fmt_num(median([r['thread_cpu_s'] / r['n'] * 1e6 for r in raw]), 1)}",
            f"posts {fmt_num(median(post), 1)} us a descriptor" if post else "-",
        ]
    )
    if notifs:
        rows.append(
            [
                f"raw NIXL: notifications of {notifs[0]['size']} B, back to back",
                fmt_num(median([r["per_s"] for r in notifs]), 0),
                f"sender's thread {fmt_num(median([r['thread_cpu_us'] for r in notifs]), 1)}",
                f"send_notif {fmt_num(median([r['send_us'] for r in notifs]), 1)} us",
            ]
        )
    return rows


def ucx_rows(floors: list[Floor], version: str) -> list[list[str]]:
    """One row per UCX case: its rate, both processes' CPU and UCX's 50th percentile."""
    rows = []
    for f in floors:
        lat = f["test"].endswith("_lat")
        kind = _KINDS.get(f["test"], f["test"])
        cpu = f"sender {fmt_num(f['client_cpu_us'], 2)}, receiver {fmt_num(f['server_cpu_us'], 2)}"
        rows.append(
            [
                f"UCX {version}, UCX_TLS {f['lane']}: {f['label']}, {kind}",
                fmt_num(f["per_s"], 0),
                cpu,
                f"p50 {f['p50_us']:.2f} us ({'latency, half a round trip' if lat else 'a send'})",
            ]
        )
    return rows


def floors_report(
    rep: Report,
    e: InflightRounds,
    inflight: int,
    floors: list[Floor],
    notes: list[str],
    version: str,
) -> None:
    """The table "small requests beside their floors", its figures and notes."""
    rep.table(
        "small requests beside their floors, same run (per second: medians of rounds)",
        ["what", "per second", "CPU us each", "wall time"],
        kvpush_rows(e, inflight) + ucx_rows(floors, version),
        note="kvpush's notifications are counted by the side that receives them (its "
        "notifs_received counter) over each timed round. Raw NIXL notifications: one agent "
        "sends them back to back (nothing windowed), the other polls and counts; rate to the "
        "last one counted. UCX: ucx_perftest (on PATH, else the one scripts/ucx-setup.sh unpacked "
        "into .venv; not the UCX inside NIXL's wheel), server and client on 127.0.0.1; UCX_TLS "
        "tcp: the lane NIXL's notifications take on a host without RDMA (kvpush probe --lanes "
        "names it), unset: UCX's own choice (shared memory between two processes); CPU each "
        "includes each process's start-up.",
    )
    rep.figures["floors"] = {
        "inflight": inflight,
        "raw_notifs": e.get("raw_notifs") or [],
        "kvpush_d_to_p_notifs_per_s": _per_s(e["kvpush"], "d_to_p_notifs"),
        "kvpush_p_to_d_notifs_per_s": _per_s(e["kvpush"], "p_to_d_notifs"),
        "ucx_version": version,
        "ucx": list(floors),
    }
    rep.notes.extend(notes)

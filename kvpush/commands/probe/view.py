"""How ``kvpush probe`` prints its report for a person (``--json`` prints ``to_dict`` instead).

Pure functions of a ``ProbeReport`` (``kvpush.commands.probe.report``) returning rich
renderables; ``probe_stats`` draws the peer's live telemetry. Runs on the main thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.text import Text

from kvpush.commands.common.live import render_live
from kvpush.commands.common.rows import Rows, ibytes, in_ms
from kvpush.commands.probe.report import served_ranks  # pure: no sockets, safe for Tab completion
from kvpush.telemetry.snapshot import snapshot_from_dict

if TYPE_CHECKING:
    from kvpush.commands.probe.report import LaneRow, ProbeReport


def _kvpush_rows(t: Rows, md: dict[str, object]) -> None:
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
        total = ibytes(_int(md["num_blocks"]) * _int(md["regions"]) * _int(md["block_bytes"]))
        t.add(
            "geometry",
            f"{md['num_blocks']} blocks × {md['regions']} regions ({md['layers']} layers × "
            f"K/V) × {ibytes(_int(md['block_bytes']))}, {md.get('dtype')}, "
            f"{md.get('kv_layout')}: {total}",
        )
    except (KeyError, TypeError, ValueError):
        t.add("geometry", "?")
    listed = md.get("ranks")
    ranks = served_ranks(listed if isinstance(listed, list) else [], md.get("tp_size"))
    tp_size = md.get("tp_size")
    t.add("ranks", ranks if tp_size == 1 else f"{ranks}, describing rank {md.get('tp_rank')}")
    backends = md.get("backends")
    t.add("backends", ",".join(backends if isinstance(backends, list | tuple) else []))
    t.add("auth", "on" if md.get("auth") else "off")


def _int(v: object) -> int:
    """A count of the peer's metadata (``TypeError`` when there is none to read)."""
    if isinstance(v, int | float | str):
        return int(v)
    raise TypeError(f"not a count: {v!r}")


def _vllm_rows(t: Rows, md: dict[str, object]) -> None:
    for k, v in md.items():
        if k in ("agent_metadata_bytes", "ranks", "regions", "kv_caches_base_addr"):
            continue
        t.add(k, v)
    t.add("regions", f"{md.get('regions')}: base addresses {md.get('kv_caches_base_addr')}")
    t.add("agent metadata", f"{md.get('agent_metadata_bytes')} bytes (not loaded)")
    ranks = md["ranks"]
    assert isinstance(ranks, list), "vllm_peer.measure lists the rank it asked for"
    t.add("rank", f"pp {ranks[0][0]}, tp {ranks[0][1]}")


def probe_report(r: ProbeReport) -> RenderableType:
    """The human form of a ``ProbeReport``: a headline and label/value rows."""
    status = "healthy" if not r.differences else "INCOMPATIBLE"
    head = Text.from_markup(f"[bold]{r.kind} endpoint at {r.address}[/bold]: {status}")
    t = Rows()
    (_kvpush_rows if r.kind == "kvpush" else _vllm_rows)(t, r.metadata)
    t.add("compat hash", r.compat_hash)
    rtt = r.rtt
    t.add(
        "rtt",
        f"{in_ms(('min', rtt.min_s), ('median', rtt.median_s))} ({len(rtt.samples_s)} samples)",
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
    for row in getattr(r, "lanes", None) or []:
        for label, value in lane_text(row):
            t.add(label, value)
    for w in getattr(r, "version_warnings", []):
        t.add("known issue", w)
    for n in r.notes:
        t.add("note", n)
    for i, line in enumerate(getattr(r, "suggest", [])):
        t.add("kvpush to fit it" if i == 0 else "", line)
    return Group(head, t.render())


def _compat_rows(t: Rows, r: ProbeReport) -> None:
    if r.differences:
        t.add("compatible", "NO")
        for f, local, remote in r.differences:
            t.add("", f"{f}: local {local}, remote {remote}")
    elif r.compat_checked:
        t.add("compatible", "yes")
    elif r.kind == "kvpush":
        t.add("compatible", "protocol yes; geometry not checked (give --block-bytes, --layers...)")


def _timing_rows(t: Rows, r: ProbeReport) -> None:
    """The handshake's phases (``--handshake``) and the NIXL pings (``--ping``)."""
    if r.handshake_timings_s is not None:
        phases = [(k.removesuffix("_s"), v) for k, v in r.handshake_timings_s.items()]
        t.add(f"handshake ({r.handshake_mode})", in_ms(*phases))
    if r.ping_s:
        pings = sorted(r.ping_s)
        figures = in_ms(("min", pings[0]), ("median", pings[len(pings) // 2]), ("max", pings[-1]))
        t.add("nixl ping", f"{figures} ({len(pings)} round trips)")


def probe_stats(r: ProbeReport) -> RenderableType | None:
    """The peer's live telemetry of ``probe --stats`` (None without it)."""
    return None if r.stats is None else render_live(snapshot_from_dict(r.stats))


def lane_text(row: LaneRow) -> list[tuple[str, str]]:
    """A lane row's label/value lines for a person."""
    lane = row["lane"]

    def joined(key: str) -> str:
        v = lane.get(key)
        return ",".join(str(x) for x in v) if isinstance(v, list) and v else "?"

    out = [
        ("peer", f"{row.get('peer')} ({row.get('writer')})"),
        ("write lane", f"{joined('write')} on {joined('devices')}"),
        ("notification lane", f"{joined('notif')} on {joined('notif_devices')}"),
        ("locality", str(lane.get("locality") or "?")),
    ]
    if lane.get("descs_per_push") is not None:
        per = lane.get("post_us_per_desc")
        out.append(("descriptors per push", f"{lane.get('descs_per_push')}"))
        out.append(("post per descriptor", f"{per:.2f} µs" if isinstance(per, float) else "?"))
    out.append(("flags", ", ".join(row.get("lane_flags") or []) or "none"))
    out.append(("evidence", f"{lane.get('evidence')}" + _cfg(lane)))
    return out


def _cfg(lane: dict[str, object]) -> str:
    return f" (UCX cfg#{lane['cfg']})" if isinstance(lane.get("cfg"), int) else ""

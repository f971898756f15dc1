"""Part of scenario ``handshake``: the handshake with NIXL agent metadata through etcd
(``--nixl-metadata etcd``) beside the same handshake over the side channel, in the same rounds.

Two P/D pairs of one geometry (``LAYERS`` x ``BLOCKS``, both sides): one with the default
(agent metadata in the side-channel reply), one whose agents publish to, and load from, NIXL's
own etcd backend (``AgentConfig.etcd_endpoints`` / ``etcd_namespace``). Each round does, on each
pair (the pair that goes first alternates), D->P notif-only handshakes (the D worker) and
P->D full ones (the P worker, as ``drive`` does), forgetting the peer after each so every one
starts from nothing. etcd is a throwaway server from the ``etcd`` binary next to the
interpreter (or ``KVPUSH_ETCD_BIN``, or on ``PATH``), started by
``kvpush.commands.bench.fleet.Fleet`` on free loopback ports; without one the etcd rows are skipped
with a note, not an error.

Threads: the scenario's calling thread (the workers are processes).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from kvpush.commands.bench.common import EndpointCfg, Progress, endpoint_cfg
from kvpush.commands.bench.probes import HandshakeSeries
from kvpush.commands.bench.procs import BenchError, Worker
from kvpush.commands.bench.report import Report, fmt_ms, fmt_x
from kvpush.commands.bench.stats import median, percentile, ratio
from kvpush.config import Role

LAYERS = 4  # 8 regions x 128 blocks = 1,024 descriptors on either side
BLOCKS = 128
BLOCK_BYTES = 128  # as the pool-size rows
NAMESPACE = "/nixl/kvpush/bench-handshake"
TRANSPORTS = ("sidechannel", "etcd")
#: (label, the worker that asks, the peer it asks, mode)
KINDS = (("D->P notif", "d", "p", "notif"), ("P->D full", "p", "d", "full"))
#: The phases of a handshake as kvpush times them (here and in ``kvpush.commands.bench.handshake``),
#: and the columns that show their medians.
PHASES = ("side_channel_s", "load_s", "prep_s", "warm_s", "total_s")
PHASE_COLUMNS = ["side channel", "load agent", "prep descs", "warm conn", "total"]


def phase_cells(e: dict[str, float], tail: str) -> list[str]:
    """The ``PHASE_COLUMNS`` cells of one entry of phase medians, then its ``tail`` key (ms)."""
    return [fmt_ms(e[ph]) for ph in (*PHASES, tail)]


def start_etcd(stack: contextlib.ExitStack, run_dir: Path, progress: Progress) -> tuple[str, str]:
    """A throwaway etcd for this run: ``(url, "")``, or ``("", why not)`` when none can run."""
    from kvpush.commands.bench.fleet import Fleet, etcd_binary

    try:
        etcd_binary()
    except BenchError as e:
        return "", f"etcd rows skipped: {e} ({e.hint})"
    fl = stack.enter_context(Fleet(run_dir))
    progress("handshake: starting a throwaway etcd for the --nixl-metadata etcd rows")
    try:
        return fl.start_etcd(), ""
    except (BenchError, OSError) as e:  # OSError: the binary named would not start
        return "", f"etcd rows skipped: etcd did not start: {e}"


def specs(etcd_url: str) -> dict[str, EndpointCfg]:
    """The endpoints of the comparison: a side-channel pair, and an etcd pair when etcd runs."""
    out: dict[str, EndpointCfg] = {}
    for t in TRANSPORTS:
        if t == "etcd" and not etcd_url:
            continue
        for role, short in ((Role.PREFILL, "p"), (Role.DECODE, "d")):
            cfg = endpoint_cfg(role, layers=LAYERS, block_bytes=BLOCK_BYTES, num_blocks=BLOCKS)
            if t == "etcd":
                cfg["agent"] = {
                    **cfg["agent"],
                    "etcd_endpoints": etcd_url,
                    "etcd_namespace": NAMESPACE,
                }
            out[f"cmp-{short}-{t}"] = cfg
    return out


def one_round(
    ws: dict[str, Worker],
    k: int,
    samples: dict[str, dict[str, list[dict[str, float]]]] | None,
    per_round: int = 1,
) -> None:
    """One round: ``per_round`` handshakes of each kind on each pair; ``samples`` None for a
    warm-up round."""
    ts = [t for t in TRANSPORTS if f"cmp-p-{t}" in ws]
    if k % 2:
        ts.reverse()
    for t in ts:
        for label, asker, peer, mode in KINDS:
            r = ws[f"cmp-{asker}-{t}"].call(
                "handshake_series",
                reply=HandshakeSeries,
                p_addr=ws[f"cmp-{peer}-{t}"].address,
                modes=[mode],
                repeats=per_round,
                call_timeout=120,
            )
            if samples is not None:
                samples.setdefault(t, {}).setdefault(label, []).extend(r[mode])


def report(
    rep: Report, samples: dict[str, dict[str, list[dict[str, float]]]], skipped: str
) -> None:
    """The side-by-side table, the etcd/side-channel ratios, and the raw samples."""
    rows = []
    fig: dict[str, dict[str, float]] = {}
    for label, *_ in KINDS:
        for t in TRANSPORTS:
            got = samples.get(t, {}).get(label)
            if not got:
                continue
            tot = [row["total_s"] for row in got]
            e = {ph: median([row[ph] for row in got]) for ph in PHASES}
            e["total_p99_s"] = percentile(tot, 99)
            e["n"] = len(got)
            fig[f"{label}/{t}"] = e
            rows.append(
                [
                    label,
                    t,
                    str(len(got)),
                    *phase_cells(e, "total_p99_s"),
                ]
            )
    descs = 2 * LAYERS * BLOCKS
    rep.table(
        f"agent metadata over the side channel vs NIXL's etcd backend ({descs:,} descriptors "
        "each side), median ms per phase",
        [
            "handshake",
            "agent metadata",
            "n",
            *PHASE_COLUMNS,
            "total p99",
        ],
        rows,
        note="etcd: load agent = fetch_remote_metadata, polled with check_remote_metadata "
        "every 2 ms until NIXL's watch has it (instead of add_remote_agent on the reply's "
        "bytes); the side-channel round trip (kvpush metadata, checks) is there either way. "
        "p99 of a few dozen samples is close to their maximum."
        + (f" {skipped}." if skipped else ""),
    )
    if skipped:
        rep.notes.append(skipped)
    for label, *_ in KINDS:
        sc, et = fig.get(f"{label}/sidechannel"), fig.get(f"{label}/etcd")
        if sc and et:
            rep.target(
                f"{label}: etcd / side channel (median total)",
                "measured, no target",
                fmt_x(ratio(et["total_s"], sc["total_s"]))
                + f" ({fmt_ms(et['total_s'])} vs {fmt_ms(sc['total_s'])} ms)",
                None,
            )
    rep.figures["nixl_metadata"] = fig
    rep.data["nixl_metadata_samples_total_s"] = {
        f"{label}/{t}": [row["total_s"] for row in got]
        for t, by in samples.items()
        for label, got in by.items()
    }

"""``kvpush fleet check``: a few verified pushes through every P x D pair of a cluster.

Owns ``check_fleet`` (its data: ``kvpush.commands.fleet.outcomes``). Semantics (docs/fleet.md,
"fleet check"):

* the pairs are every prefill x every decode record -- registered, or listed with
  ``--endpoints``/``--peer`` and seen by ``kvpush.commands.fleet.sight``; a pair whose records
  disagree on a compatibility field (``kvpush.fleet.pairs.pair_differences``) is
  ``incompatible`` with the fields named and is not driven; a compatible pair on vLLM's wire
  (a vLLM engine, or a kvpush endpoint standing in for one) is ``compatible`` by metadata only:
  its push starts only at the vLLM engine's router, and a vLLM engine is sent nothing but
  ``get_meta_msg``;
* every other pair gets ``pushes`` verified pushes through the endpoints themselves, one at a
  time, with drive's machinery (``kvpush.commands.drive.driver.Driver``: its preflight asks both for
  their metadata -- roles, pools, geometry -- then each request's decode leg goes to D and its
  prefill leg to P; D verifies every byte). From them: ``first`` (the first push, which carries the
  D -> P handshake of a pair that never met), ``handshake`` (first minus the median of the
  rest), push latency p50 and GB/s (bytes of one push / p50), and the lane P's WRITEs took
  (``kvpush.commands.fleet.lanes``: P's own peer row, from UCX's report);
* each pair runs within ``deadline_s``; at most ``concurrency`` pairs run at a time, and pairs
  that share an endpoint only as many at once as its pool holds (``kvpush.commands.fleet.pools``:
  the free blocks its record shows), so the check never fills a pool with its own pushes; a pair
  held back only by the blocks a failed pair's push may still hold, while the endpoint itself
  shows too few free for a whole deadline, is ``skipped`` (``pool_too_small``), never failed;
* a pair whose pushes fail is ``failed`` with the reason (drive's ``Failure`` values:
  ``no_free_blocks`` for a full D, ``decode_unreachable`` for a cut link, ``deadline`` for a
  frozen peer...). When the registry is read again after the check and one of its endpoints has
  left it (key gone, or a new incarnation), that is a hint, not proof -- a frozen endpoint's
  lease lapses too: the pair is ``left`` only when the data path proves the endpoint gone (its
  side channel refuses connections, or the new incarnation answers there); otherwise it stays
  ``failed``, the registry's word added to its detail;
* ``CheckReport.exit_status``: 0 when no pair failed, ``NOT_READY`` (3) when one did -- and, with
  ``strict``, when a pair is incompatible or skipped too.

Threads: ``check_fleet`` runs on the caller's thread, which schedules the pairs (and asks an
endpoint for its free blocks, or for proof that it is gone, with short side-channel requests);
a bounded executor runs the pairs, each pair's ``Driver`` owns its own worker and monitor
threads; a timer thread per pair cancels a driver at its deadline. Nothing here imports typer
or rich.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import TypedDict

from kvpush.commands.common import reasons
from kvpush.commands.common.results import DriveConfig, RequestResult
from kvpush.commands.common.stats import median
from kvpush.commands.fleet.lanes import pair_lane
from kvpush.commands.fleet.outcomes import CheckConfig, CheckReport, Outcome, PairResult
from kvpush.commands.fleet.pools import ASK_EVERY_S, WAIT, Pools, TooSmall
from kvpush.commands.fleet.proof import free_now, gone_proof
from kvpush.config import Role
from kvpush.errors import IncompatiblePeerError, KvpushError
from kvpush.fleet.pairs import blocks_for_size, format_differences, pair_differences
from kvpush.fleet.record import EndpointRecord

log = logging.getLogger(__name__)

__all__ = ["CheckConfig", "CheckReport", "Outcome", "PairResult", "check_fleet", "settle_left"]

#: The share of ``--deadline`` one push may take at D (its request deadline).
PUSH_SHARE = 0.6


def plan_pairs(
    records: list[EndpointRecord],
) -> tuple[list[str], list[str], dict[str, EndpointRecord]]:
    """The prefill and decode addresses (sorted) and every record by address."""
    by_addr = {r.address: r for r in records}
    ps = sorted(r.address for r in records if r.role == Role.PREFILL)
    ds = sorted(r.address for r in records if r.role == Role.DECODE)
    return ps, ds, by_addr


@dataclass(frozen=True)
class PairPlan:
    """A pair the records say can work: what the check pushes through it."""

    p: EndpointRecord
    d: EndpointRecord
    blocks: int
    note: str = ""


def plan_pair(p: EndpointRecord, d: EndpointRecord, cfg: CheckConfig) -> PairResult | PairPlan:
    """What the records alone settle (``incompatible``, ``skipped``), else the pair's plan."""
    diffs = pair_differences(p, d)
    if diffs:
        return PairResult(
            p.address, d.address, "incompatible", "incompatible", format_differences(diffs), diffs
        )
    if p.wire != "kvpush":
        return PairResult(p.address, d.address, "compatible", "metadata", _metadata_only(p, d))
    blocks, note = blocks_for_size(cfg.size_bytes, p, d)
    return PairPlan(p, d, blocks, note)


def _metadata_only(p: EndpointRecord, d: EndpointRecord) -> str:
    """Why a compatible pair on vLLM's wire is checked by its metadata alone."""
    engines = [r for r in (p, d) if not r.kvpush_version]
    if len(engines) == 2:
        return "two vLLM engines: only a vLLM router can start their push"
    if engines:
        return (
            f"the vLLM engine {engines[0].address} pushes or registers only for a request its "
            "router sent it"
        )
    return "both speak vLLM's wire: fleet check drives kvpush's wire"


def check_pair(p: EndpointRecord, d: EndpointRecord, cfg: CheckConfig) -> PairResult:
    """One pair: compatibility from the records, then ``cfg.pushes`` verified pushes."""
    plan = plan_pair(p, d, cfg)
    return plan if isinstance(plan, PairResult) else drive_pair(plan, cfg)


def drive_pair(plan: PairPlan, cfg: CheckConfig) -> PairResult:
    """``cfg.pushes`` verified pushes through the pair, within ``cfg.deadline_s``."""
    p, d, blocks = plan.p, plan.d, plan.blocks
    t0 = time.monotonic()
    try:
        return _drive_pair(p.address, d.address, blocks, cfg, plan.note, t0)
    except IncompatiblePeerError as e:  # the live metadata disagrees although the records do not
        return PairResult(
            p.address, d.address, "incompatible", "incompatible", e.message,
            list(e.differences), blocks, elapsed_s=time.monotonic() - t0,
        )  # fmt: skip
    except KvpushError as e:
        # The preflight's error names the endpoint it is about.
        leg: reasons.Leg = (
            Role.PREFILL if p.address in e.message and d.address not in e.message else Role.DECODE
        )
        reason, detail = reasons.from_error(e, leg)
        return PairResult(
            p.address, d.address, "failed", reason.value, detail, [], blocks,
            elapsed_s=time.monotonic() - t0,
        )  # fmt: skip


def _drive_pair(p: str, d: str, blocks: int, cfg: CheckConfig, note: str, t0: float) -> PairResult:
    from kvpush.commands.drive.driver import DriveHooks, Driver

    results: list[RequestResult] = []
    lock = threading.Lock()

    def keep(r: RequestResult) -> None:
        with lock:
            results.append(r)
        if not r.ok and r.reason != "cancelled":
            lapse()  # the first failure names the pair: no need to wait for the others

    dcfg = DriveConfig(
        prefill=(p,),
        decode=(d,),
        requests=cfg.pushes,
        concurrency=1,
        blocks=blocks,
        # D's own deadline for a push lapses before the pair's: its reason (a handshake that
        # failed, P unreachable from D) is what the pair reports, not the check's timer.
        timeout_s=max(0.5, cfg.deadline_s * PUSH_SHARE),
        auth_token=cfg.auth_token,
        grace_s=0.0,
        stall_s=min(3.0, cfg.deadline_s / 2),
        liveness_s=min(2.0, cfg.deadline_s / 3),
    )
    driver: Driver | None = None

    def lapse() -> None:
        if driver is not None:
            driver.cancel()
            driver.cancel()  # the second call ends the grace as well

    driver = Driver(dcfg, DriveHooks(on_result=keep))

    timer = threading.Timer(cfg.deadline_s, lapse)
    timer.daemon = True
    timer.start()
    try:
        report = driver.run()
    finally:
        timer.cancel()
    elapsed = time.monotonic() - t0
    with lock:
        ordered = sorted(results, key=lambda r: r.index)
    ok = [r for r in ordered if r.ok]
    first = ordered[0].latency_s if ordered and ordered[0].ok else None
    rest = [r.latency_s for r in ok if r.index > 0] or [r.latency_s for r in ok]
    p50 = median(rest) if rest else None
    nbytes = ok[0].nbytes if ok else 0
    common: _Figures = {
        "blocks": blocks,
        "pushes": cfg.pushes,
        "pushes_ok": len(ok),
        "first_ms": first * 1e3 if first is not None else None,
        "handshake_ms": max(0.0, first - p50) * 1e3
        if first is not None and p50 is not None and len(ok) > 1
        else None,
        "p50_ms": p50 * 1e3 if p50 is not None else None,
        "gb_per_s": nbytes / p50 / 1e9 if p50 else None,
        "elapsed_s": elapsed,
    }
    if ok:  # P wrote to D: which lane carried it, in P's own word
        lane = pair_lane(p, d, cfg.auth_token)
        common["lane"], common["lane_flags"] = lane.word, lane.flags
    if len(ok) == cfg.pushes and report.verified == cfg.pushes:
        return PairResult(p, d, "ok", "", note, **common)
    bad = next((r for r in ordered if not r.ok and r.reason != "cancelled"), None)
    if bad is not None:
        return PairResult(p, d, "failed", bad.reason, bad.detail, **common)
    if report.interrupted:
        return PairResult(
            p, d, "failed", "deadline",
            f"{len(ok)} of {cfg.pushes} pushes within --deadline {cfg.deadline_s:g}s", **common,
        )  # fmt: skip
    return PairResult(p, d, "failed", "verify_failed", "a push did not verify", **common)


class _Figures(TypedDict, total=False):
    """A pair's figures, as ``PairResult`` takes them."""

    blocks: int
    pushes: int
    pushes_ok: int
    first_ms: float | None
    handshake_ms: float | None
    p50_ms: float | None
    gb_per_s: float | None
    elapsed_s: float
    lane: str
    lane_flags: list[str]


def _registered(
    addr: str, before: Mapping[str, EndpointRecord], now: Mapping[str, EndpointRecord]
) -> bool:
    cur = now.get(addr)
    return cur is not None and cur.incarnation == before[addr].incarnation


def settle_left(
    r: PairResult,
    before: Mapping[str, EndpointRecord],
    now: Mapping[str, EndpointRecord],
    proof_of: Callable[[str], str],
) -> PairResult:
    """A failed pair one of whose endpoints left the registry: ``left`` with the proof, else
    still ``failed``, the registry's hint added to its detail."""
    hints = []
    for addr in (r.prefill, r.decode):
        if _registered(addr, before, now):
            continue
        cur = now.get(addr)
        proof = proof_of(addr)
        if proof:
            return PairResult(
                r.prefill, r.decode, "left", "left",
                f"{proof} ({r.reason}: {r.detail})", elapsed_s=r.elapsed_s,
            )  # fmt: skip
        what = "its key went" if cur is None else "another incarnation registered"
        hints.append(f"{addr}: {what}, but it is not proven gone")
    if not hints:
        return r
    return replace(r, detail=f"{r.detail} (registry: {'; '.join(hints)})")


def check_fleet(
    cluster: str,
    records: list[EndpointRecord],
    cfg: CheckConfig,
    relist: Callable[[], list[EndpointRecord]] | None = None,
    on_pair: Callable[[PairResult], None] | None = None,
) -> CheckReport:
    """Check every P x D pair of ``records``; ``relist`` reads the registry again after the
    check, so that a failed pair whose endpoint is gone -- proven so -- is told apart
    (``left``)."""
    t0 = time.monotonic()
    ps, ds, by_addr = plan_pairs(records)
    notes: list[str] = []
    if not ps or not ds:
        missing = Role.PREFILL if not ps else Role.DECODE
        where = "listed and seen" if cluster == "listed" else "registered"
        notes.append(f"no {missing} endpoint {where}: no pair to check")
    pairs = [(p, d) for p in ps for d in ds]
    out: dict[tuple[str, str], PairResult] = {}

    def done(pd: tuple[str, str], r: PairResult) -> None:
        out[pd] = r
        if on_pair is not None:
            on_pair(r)

    plans: list[PairPlan] = []
    for pd in pairs:
        plan = plan_pair(by_addr[pd[0]], by_addr[pd[1]], cfg)
        if isinstance(plan, PairResult):
            done(pd, plan)
        else:
            plans.append(plan)
    if plans:
        tp = {a: r.tp_size for a, r in by_addr.items()}
        pools = Pools(by_addr, cfg.deadline_s, free_now(cfg.auth_token, tp))
        notes += pools.serialised(*_load_of(plans), cfg.concurrency)
        _run(plans, cfg, pools, done)
    if relist is not None and any(r.outcome == "failed" for r in out.values()):
        notes += _settle_failed(out, by_addr, relist, cfg.auth_token)
    return CheckReport(
        cluster=cluster,
        prefills=ps,
        decodes=ds,
        pairs=[out[pd] for pd in pairs],
        elapsed_s=time.monotonic() - t0,
        concurrency=cfg.concurrency,
        strict=cfg.strict,
        notes=notes,
    )


def _settle_failed(
    out: dict[tuple[str, str], PairResult],
    by_addr: Mapping[str, EndpointRecord],
    relist: Callable[[], list[EndpointRecord]],
    token: bytes | None,
) -> list[str]:
    """Read the fleet again: each failed pair one of whose endpoints is proven gone is ``left``
    (``settle_left``); the notes say when the registry could not be read."""
    try:
        now = {r.address: r for r in relist()}
    except KvpushError as e:
        return [f"could not read the registry again after the check: {e.message}"]
    proofs: dict[str, str] = {}

    def proof_of(addr: str) -> str:
        if addr not in proofs:
            proofs[addr] = gone_proof(addr, now.get(addr), token)
        return proofs[addr]

    for pd, r in out.items():
        if r.outcome == "failed":
            out[pd] = settle_left(r, by_addr, now, proof_of)
    return []


def _load_of(plans: list[PairPlan]) -> tuple[dict[str, int], dict[str, int]]:
    """Pairs per endpoint and the largest push there."""
    n: dict[str, int] = {}
    b: dict[str, int] = {}
    for pl in plans:
        for a in (pl.p.address, pl.d.address):
            n[a] = n.get(a, 0) + 1
            b[a] = max(b.get(a, 0), pl.blocks)
    return n, b


def _run(
    plans: list[PairPlan],
    cfg: CheckConfig,
    pools: Pools,
    done: Callable[[tuple[str, str], PairResult], None],
) -> None:
    """Drive the pairs, at most ``cfg.concurrency`` at a time and only as many at one endpoint
    as its pool holds (``Pools``): the first pending pair that fits starts whenever one ends."""

    def one(pl: PairPlan) -> PairResult:
        try:
            return drive_pair(pl, cfg)
        except Exception as e:  # never a vanished pair: it fails with a reason
            log.exception("fleet check of %s -> %s failed", pl.p.address, pl.d.address)
            return PairResult(
                pl.p.address, pl.d.address, "failed", "internal_error", f"{type(e).__name__}: {e}"
            )

    pending = list(plans)
    running: dict[Future[PairResult], PairPlan] = {}
    with ThreadPoolExecutor(min(cfg.concurrency, len(plans)), "fleet-check") as ex:
        while pending or running:
            for pl in _admitted(pending, cfg.concurrency - len(running), pools, done):
                running[ex.submit(one, pl)] = pl
            if not running:
                if pending:  # held back only by a failed pair's blocks: ask again soon
                    time.sleep(ASK_EVERY_S)
                continue
            finished, _ = wait(
                running, timeout=ASK_EVERY_S if pending else None, return_when=FIRST_COMPLETED
            )
            for f in finished:
                pl = running.pop(f)
                r = f.result()
                pools.release(pl.p.address, pl.d.address, pl.blocks, r.outcome == "ok")
                done((pl.p.address, pl.d.address), r)


def _admitted(
    pending: list[PairPlan],
    room: int,
    pools: Pools,
    done: Callable[[tuple[str, str], PairResult], None],
) -> list[PairPlan]:
    """The pending pairs that may start now (at most ``room``), taken out of ``pending``; a
    pair whose pool can never hold it is ``skipped`` on the way."""
    start: list[PairPlan] = []
    for pl in list(pending):
        if len(start) >= room:
            break
        gate = pools.admit(pl.p.address, pl.d.address, pl.blocks)
        if gate == WAIT:
            continue
        pending.remove(pl)
        if isinstance(gate, TooSmall):
            done((pl.p.address, pl.d.address), PairResult(
                pl.p.address, pl.d.address, "skipped", "pool_too_small", gate.detail,
                blocks=pl.blocks,
            ))  # fmt: skip
        else:
            start.append(pl)
    return start

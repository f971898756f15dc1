"""Heterogeneous tensor parallelism (issue 9): every (P_tp, D_tp) in {1, 2, 4}^2 on a sharded
model, the replicated latent (MLA), refused ratios, and head-by-head verification.

Integration tests run real endpoint processes (``kvpush.commands.common.node``) over real NIXL (UCX,
DRAM) and ZMQ on 127.0.0.1. To keep the matrix to seconds, each group of tests starts its processes
once, in parallel (a class-scoped fixture per group), and every test measures what it changed:
counters as deltas, pools against their counts before the test. The pure tests of ``KvPool``
and ``kvpush.peers.tp`` (head-by-head verification, the write slices) are
``tests/unit/test_tp_pages.py``.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.commands.common.ports import free_port
from kvpush.peers.tp import sources
from tests.support.legs import Outcome, run_many, run_request, stats
from tests.support.procs import Proc, launch, node_cmd, wait_ready

pytestmark = pytest.mark.integration

HEAD = 256  # bytes of one head slice of one region's page
HEADS = 4  # the sharded model's KV heads: every TP in {1, 2, 4} divides it
LAYERS = 2
NUM_BLOCKS = 128
REQUESTS = 50
CONCURRENCY = 4
TPS = (1, 2, 4)
# (P_tp, D_tp) pairs of the replicated latent: D larger, D smaller (k completions), D larger k=2.
MLA_PAIRS = [(2, 1), (1, 2), (2, 4)]
PAIRS = [(p, d) for p in TPS for d in TPS]


def _pairs(pairs: list[tuple[int, int]]) -> list[Any]:
    return [pytest.param(p, d, id=f"P{p}-D{d}") for p, d in pairs]


def _page(kv_heads: int, tp: int) -> int:
    """One rank's page of one region: its share of the heads (all of a single head)."""
    return HEAD * (1 if kv_heads == 1 else kv_heads // tp)


def _pool(kv_heads: int, tp: int, layout: str = "NHD") -> dict[str, Any]:
    return {
        "num_blocks": NUM_BLOCKS,
        "layers": LAYERS,
        "block_bytes": _page(kv_heads, tp),
        "kv_heads": kv_heads,
        "tp_size": tp,
        "kv_layout": "MLA" if kv_heads == 1 else layout,
    }


def _cfg(role: str, tp: int, kv_heads: int, layout: str = "NHD", **extra: Any) -> dict[str, Any]:
    return {"role": role, "tp_size": tp, "pool": _pool(kv_heads, tp, layout), **extra}


@contextlib.contextmanager
def _started(cfgs: dict[str, dict[str, Any]], tmp: Path) -> Iterator[dict[str, Proc]]:
    """Start every endpoint at once (their imports dominate; in parallel they overlap), yield
    them by name, stop them at the end: each must exit 0."""
    procs: dict[str, Proc] = {}
    try:
        for name, cfg in cfgs.items():
            ready = tmp / f"{name}.ready"
            procs[name] = launch(node_cmd(cfg, ready), ready, tmp / f"{name}.log", wait=False)
        for p in procs.values():
            wait_ready(p, 90)
        yield procs
    finally:
        # All drain at once. One SIGTERM each: a second one may land after the node's handler is
        # gone (interpreter shutdown) and kill it with -15.
        for p in procs.values():
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        rcs: dict[str, int | None] = {}
        for name, p in procs.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(20)
            p.kill()  # only if it is still running
            rcs[name] = p.popen.returncode
    bad = {name: rc for name, rc in rcs.items() if rc != 0}
    assert not bad, "\n".join(f"{n} exited {rc}:\n{procs[n].log_text()}" for n, rc in bad.items())


# ---------------------------------------------------------------------------------- snapshots


def _ranks(snap: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-rank snapshots (a one-rank endpoint's snapshot is its rank's)."""
    return list(snap.get("ranks", [])) or [snap]


def _counter(snap: dict[str, Any], name: str, kind: str = "counters") -> int:
    """A counter (or, ``kind="failures"``, a failure count) of a snapshot; 0 when absent."""
    return int(snap[kind].get(name, 0))


def _pool_counts(snap: dict[str, Any]) -> list[tuple[float, float, float, float]]:
    """(free, total, quarantined, inflight) of the endpoint, then of each of its ranks."""
    rows = [snap, *snap.get("ranks", [])]
    return [
        (g["pool_free"], g["pool_total"], g["pool_quarantined"], g["pool_inflight"])
        for g in (r["gauges"] for r in rows)
    ]


def _idle(tp: int) -> list[tuple[float, float, float, float]]:
    """An idle endpoint's pool counts: every block free, on every rank."""
    whole = float(NUM_BLOCKS * tp)
    rank = float(NUM_BLOCKS)
    return [(whole, whole, 0.0, 0.0)] + ([(rank, rank, 0.0, 0.0)] * tp if tp > 1 else [])


def _wait_pools(
    addr: str, want: list[tuple[float, float, float, float]], timeout: float = 10.0
) -> dict[str, Any]:
    """Poll until ``addr``'s pool counts are ``want`` (D frees after its reply; P after the
    WRITE's completion), at most ``timeout`` s; return the last snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        snap = stats(addr)
        if _pool_counts(snap) == want or time.monotonic() > deadline:
            assert _pool_counts(snap) == want, (addr, _pool_counts(snap), want)
            return snap
        time.sleep(0.05)


def _push_matrix(p: Proc, d: Proc, p_tp: int, d_tp: int, kv_heads: int, tag: str) -> None:
    """``REQUESTS`` requests of 1..8 blocks P -> D, every one ok and verified; counters move by
    what the ratio implies; pools end where they started."""
    _wait_pools(p.address, _idle(p_tp))
    _wait_pools(d.address, _idle(d_tp))
    p0, d0 = stats(p.address), stats(d.address)
    items = [(f"{tag}-{i}", p.address, d.address, i % 8 + 1) for i in range(REQUESTS)]
    t0 = time.perf_counter()
    out = run_many(items, concurrency=CONCURRENCY)
    elapsed = time.perf_counter() - t0
    bad = [o for o in out if o.rep.outcome != "ok" or o.rep.verified is not True]
    assert not bad, [(o.transfer_id, o.rep.reason, o.rep.detail) for o in bad[:3]]

    # D's ranks together receive their whole pages of every block of every region.
    for o, (_, _, _, blocks) in zip(out, items, strict=True):
        assert o.rep.nbytes == blocks * LAYERS * 2 * _page(kv_heads, d_tp) * d_tp, o

    p1 = _wait_pools(p.address, _idle(p_tp))
    d1 = _wait_pools(d.address, _idle(d_tp))
    # D counts a request once, whatever its ranks; each D rank counts its own share.
    assert _counter(d1, "requests_ok") - _counter(d0, "requests_ok") == REQUESTS
    for r0, r1 in zip(_ranks(d0), _ranks(d1), strict=True):
        assert _counter(r1, "requests_ok") - _counter(r0, "requests_ok") == REQUESTS
    # Each P rank makes one push per request (written to len(targets) D ranks in legs).
    for r, (r0, r1) in enumerate(zip(_ranks(p0), _ranks(p1), strict=True)):
        assert _counter(r1, "pushes_ok") - _counter(r0, "pushes_ok") == REQUESTS, r
    assert _counter(p1, "pushes_ok") - _counter(p0, "pushes_ok") == p_tp * REQUESTS
    # D rank r registers with every P rank it draws from, once per request.
    for r, (r0, r1) in enumerate(zip(_ranks(d0), _ranks(d1), strict=True)):
        want = len(sources(r, d_tp, p_tp)) * REQUESTS
        assert _counter(r1, "push_regs_sent") - _counter(r0, "push_regs_sent") == want, r
    assert p1["failures"] == p0["failures"] and d1["failures"] == d0["failures"]
    print(f"\nP tp {p_tp} -> D tp {d_tp}: {REQUESTS} requests in {elapsed:.2f}s")


# ------------------------------------------------------------------------ sharded: 3 x 3 pairs


class TestSharded:
    """One P and one D per TP size in {1, 2, 4}, sharing a 4-head model; each P serves every D."""

    @pytest.fixture(scope="class")
    @classmethod
    def eps(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
        cfgs = {f"p{tp}": _cfg("prefill", tp, HEADS) for tp in TPS}
        cfgs.update({f"d{tp}": _cfg("decode", tp, HEADS) for tp in TPS})
        with _started(cfgs, tmp_path_factory.mktemp("tp-sharded")) as procs:
            yield procs

    @pytest.mark.parametrize(("p_tp", "d_tp"), _pairs(PAIRS))
    def test_every_ratio(self, eps, p_tp: int, d_tp: int) -> None:
        _push_matrix(eps[f"p{p_tp}"], eps[f"d{d_tp}"], p_tp, d_tp, HEADS, f"s{p_tp}{d_tp}")

    def test_one_d_draws_from_three_p_sizes_at_once(self, eps) -> None:
        """D's ranks learn each P's TP size separately (a cache shared by its ranks, keyed by
        P's address): interleaved requests from P tp 1, 2 and 4 must not mix them up."""
        ps = [eps[f"p{tp}"] for tp in TPS]
        for d_tp in (2, 4):
            d = eps[f"d{d_tp}"]
            items = [(f"mix{d_tp}-{i}", ps[i % 3].address, d.address, i % 5 + 1) for i in range(60)]
            out = run_many(items, concurrency=6)
            bad = [o for o in out if o.rep.outcome != "ok" or o.rep.verified is not True]
            assert not bad, [(o.transfer_id, o.rep.reason, o.rep.detail) for o in bad[:3]]
        for tp in TPS:
            _wait_pools(eps[f"p{tp}"].address, _idle(tp))
            _wait_pools(eps[f"d{tp}"].address, _idle(tp))


# ------------------------------------------------------------------------ replicated latent


class TestLatent:
    """An MLA-style model: one latent head, the same bytes on every rank."""

    @pytest.fixture(scope="class")
    @classmethod
    def eps(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
        p_tps = sorted({p for p, _ in MLA_PAIRS})
        d_tps = sorted({d for _, d in MLA_PAIRS})
        cfgs = {f"p{tp}": _cfg("prefill", tp, 1) for tp in p_tps}
        cfgs.update({f"d{tp}": _cfg("decode", tp, 1) for tp in d_tps})
        with _started(cfgs, tmp_path_factory.mktemp("tp-latent")) as procs:
            yield procs

    @pytest.mark.parametrize(("p_tp", "d_tp"), _pairs(MLA_PAIRS))
    def test_replicated(self, eps, p_tp: int, d_tp: int) -> None:
        _push_matrix(eps[f"p{p_tp}"], eps[f"d{d_tp}"], p_tp, d_tp, 1, f"m{p_tp}{d_tp}")


# ------------------------------------------------------------------------ refused ratios

LEASE_S = 2.0  # P's lease on blocks no D registers for: a refused D never does


class TestRefused:
    """A 6-head model at TP 2 and 3 on both sides: 2 and 3 neither divide the other."""

    @pytest.fixture(scope="class")
    @classmethod
    def eps(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
        short = {"lease_s": LEASE_S, "heartbeat_s": 0.5}
        cfgs = {f"p{tp}": _cfg("prefill", tp, 6, timeouts=short) for tp in (2, 3)}
        cfgs.update({f"d{tp}": _cfg("decode", tp, 6) for tp in (2, 3)})
        with _started(cfgs, tmp_path_factory.mktemp("tp-refused")) as procs:
            yield procs

    @pytest.mark.parametrize(("p_tp", "d_tp"), _pairs([(3, 2), (2, 3)]))
    def test_at_handshake_naming_both_sizes(self, eps, p_tp: int, d_tp: int) -> None:
        p, d = eps[f"p{p_tp}"], eps[f"d{d_tp}"]
        _wait_pools(p.address, _idle(p_tp))
        d0 = stats(d.address)
        first: Outcome | None = None
        max_s = 0.0
        for i in range(5):
            o = run_request(f"x{p_tp}{d_tp}-{i}", p.address, d.address, i + 1)
            assert o.rep.outcome == "failed" and o.rep.reason == "incompatible", o.rep
            assert f"P has {p_tp} ranks, D has {d_tp}" in o.rep.detail, o.rep.detail
            assert o.t_done - o.t_sent < 5.0, o  # at once: no deadline, no lease waited for
            first = first or o
            max_s = max(max_s, o.t_done - o.t_sent)
        # D refused before it registered: nothing of it is left allocated, nothing counted ok.
        d1 = _wait_pools(d.address, _idle(d_tp), timeout=2.0)
        assert _counter(d1, "requests_failed") - _counter(d0, "requests_failed") == 5
        assert _counter(d1, "requests_ok") == _counter(d0, "requests_ok")
        assert _counter(d1, "push_regs_sent") == _counter(d0, "push_regs_sent")
        # Every D rank's share ends refused, or cancelled by its group once a sibling was; the
        # rank that answered counted ``incompatible`` each time.
        shares = [
            {k: v - r0["failures"].get(k, 0) for k, v in r1["failures"].items()}
            for r0, r1 in zip(_ranks(d0), _ranks(d1), strict=True)
        ]
        assert all(set(f) <= {"incompatible", "cancelled"} for f in shares), shares
        assert all(f.get("incompatible", 0) + f.get("cancelled", 0) == 5 for f in shares), shares
        assert sum(f.get("incompatible", 0) for f in shares) >= 5, shares
        # D never loaded P as a peer; P never heard of D (no PUSH_REG, no P->D handshake).
        # (A sibling rank cancelled mid-handshake finishes that handshake a moment later.)
        deadline = time.monotonic() + 5.0
        while True:
            peers = stats(d.address)["peers"]
            assert isinstance(peers, list), peers
            rows = [row for row in peers if row["peer"] == p.address]
            if {row["state"] for row in rows} == {"failed"} or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert rows and {row["state"] for row in rows} == {"failed"}, rows
        assert stats(p.address)["peers"] == []
        assert first is not None
        print(f"\nrefused in at most {max_s * 1e3:.0f} ms: {first.rep.detail}; D ranks: {shares}")
        # P filled its share and was never told (D sent no PUSH_REG): its lease gives it back.
        _wait_pools(p.address, _idle(p_tp), timeout=LEASE_S + 5.0)
        # The same P serves a fitting D afterwards, every byte verified.
        _push_matrix(p, eps[f"d{p_tp}"], p_tp, p_tp, 6, f"f{p_tp}")


# ------------------------------------------------------------------------ P restarted


def test_p_restarted_at_another_tp_size_is_learnt_afresh(tmp_path: Path) -> None:
    """D (TP 1) draws from P ranks 0 and 1; P restarts at TP 4 on the same address. D's
    receiver means to learn the new size once; at most the first request may fail."""
    port = free_port()
    short = {"lease_s": LEASE_S, "heartbeat_s": 0.5}

    def p_cfg(tp: int) -> dict[str, Any]:
        return _cfg("prefill", tp, HEADS, port=port, engine_id="p-fixed", timeouts=short)

    with _started({"p2": p_cfg(2), "d": _cfg("decode", 1, HEADS)}, tmp_path) as eps:
        d = eps["d"]
        before = run_request("before", eps["p2"].address, d.address, 2)
        assert before.rep.outcome == "ok" and before.rep.verified, before.rep
        assert eps["p2"].stop() == 0
        with _started({"p4": p_cfg(4)}, tmp_path) as again:
            p = again["p4"]
            out = [run_request(f"after-{i}", p.address, d.address, 2) for i in range(5)]
            late = [(o.transfer_id, o.rep.reason, o.rep.detail) for o in out[1:]]
            assert all(o.rep.outcome == "ok" and o.rep.verified for o in out[1:]), late
            _wait_pools(d.address, _idle(1))
            _wait_pools(p.address, _idle(4), timeout=LEASE_S + 5.0)

"""Unit tests of telemetry: histogram precision, thread-safe counters, rates, round trips."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import subprocess
import sys
import threading
from typing import Any

import msgspec
import numpy as np
import pytest

from kvpush.config import Role
from kvpush.telemetry.merge import merge
from kvpush.telemetry.names import RATE_COUNTERS
from kvpush.telemetry.snapshot import (
    BUCKET_BOUNDS,
    HistSnapshot,
    Snapshot,
    expand_buckets,
    snapshot_from_dict,
    window_rates,
)
from kvpush.telemetry.snapshot import bucket_index as _bucket_index
from kvpush.telemetry.store import Histogram, Telemetry

BUCKET_RATIO = 10**0.1  # one bucket width


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def sample_telemetry(clock: FakeClock | None = None) -> Telemetry:
    """A small but complete telemetry store: every section of a snapshot has content."""
    clock = clock or FakeClock()
    tel = Telemetry(Role.PREFILL, "p-abc", "inc-1", clock=clock, wall_clock=lambda: 1.8e9 + clock.t)
    tel.info(address="127.0.0.1:5600", device="cpu", writer="deferred", workers=4, ratio=0.5)
    tel.gauge_fn("deferred", lambda: 2)
    tel.gauge_fn("pool_free", lambda: 1000)
    tel.gauge_fn("pool_total", lambda: 1024)
    tel.peers_fn(
        lambda: [
            {
                "peer": "127.0.0.1:5700",
                "engine_id": "d-1",
                "mode": "full",
                "state": "ready",
                "duration_s": 0.041,
                "failures": 0,
                "last_error": None,
            },
        ]
    )
    tel.inc("pushes_ok", 10)
    tel.inc("bytes_pushed", 10 * 16384)
    tel.fail("deadline")
    for x in (1e-5, 2e-5, 4e-5, 3e-3):
        tel.observe("push_latency", x)
    return tel


# --- histogram --------------------------------------------------------------------------------


def test_bucket_bounds_are_log_spaced_ten_per_decade() -> None:
    assert BUCKET_BOUNDS[0] == 1e-6
    assert BUCKET_BOUNDS[-1] == 1e3
    assert len(BUCKET_BOUNDS) == 91
    assert BUCKET_BOUNDS[10] == 1e-5
    ratios = [b / a for a, b in itertools.pairwise(BUCKET_BOUNDS)]
    assert all(1.2 < r < 1.32 for r in ratios)


@pytest.mark.parametrize("i", range(len(BUCKET_BOUNDS)))
def test_bucket_index_is_exact_at_every_bound(i: int) -> None:
    le = BUCKET_BOUNDS[i]
    assert _bucket_index(le) == i  # le is inclusive
    assert _bucket_index(math.nextafter(le, math.inf)) == i + 1
    if i:
        assert _bucket_index(math.nextafter(le, 0.0)) == i


def test_observe_puts_values_in_the_same_bucket_as_bucket_index() -> None:
    rng = np.random.default_rng(7)
    for x in 10 ** rng.uniform(-7, 4, 2000):
        h = Histogram()
        h.observe(float(x))
        h.snapshot()  # (folds the queued value into its bucket)
        (i,) = [k for k, c in enumerate(h._counts) if c]
        assert i == _bucket_index(float(x))


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("lognormal", np.random.default_rng(1).lognormal(mean=-10.0, sigma=1.0, size=20_000)),
        ("uniform", np.random.default_rng(2).uniform(1e-4, 2e-3, size=20_000)),
        (
            "bimodal",
            np.concatenate([np.full(800, 5e-5), np.random.default_rng(3).uniform(0.1, 1, 200)]),
        ),
    ],
)
def test_percentiles_within_one_bucket_of_numpy(name: str, data: np.ndarray) -> None:
    h = Histogram()
    for x in data:
        h.observe(float(x))
    s = h.snapshot()
    assert s.count == len(data)
    assert s.sum == pytest.approx(float(data.sum()), rel=1e-9)
    assert s.max == float(data.max())
    for q, got in ((50, s.p50), (90, s.p90), (99, s.p99)):
        want = float(np.percentile(data, q))
        assert want / BUCKET_RATIO <= got <= want * BUCKET_RATIO, (name, q, got, want)


def test_empty_histogram_is_all_zero() -> None:
    s = Histogram().snapshot()
    assert s == HistSnapshot(count=0, sum=0.0, p50=0.0, p90=0.0, p99=0.0, max=0.0, buckets=[])


def test_odd_values_negative_nan_tiny_and_overflow() -> None:
    h = Histogram()
    h.observe(-1.0)  # a clock step counts as zero
    h.observe(float("nan"))  # ignored
    h.observe(0.0)
    h.observe(5e-7)
    h.observe(5000.0)  # above the last bound
    s = h.snapshot()
    assert s.count == 4
    assert s.max == 5000.0
    assert s.sum == 5000.0 + 5e-7
    assert s.buckets == [(1e-6, 3)]  # the overflow sits under no finite le
    assert s.p50 <= 1e-6
    assert 1000.0 < s.p99 <= 5000.0  # the overflow bucket is open: only its edges are known


def test_buckets_are_sparse_cumulative_and_expand_to_every_bound() -> None:
    h = Histogram()
    for x in (1e-5, 1e-5, 2e-4, 2e-4, 2e-4, 10.0):
        h.observe(x)
    s = h.snapshot()
    assert s.buckets == [(1e-5, 2), (2e-4, 5), (10.0, 6)]
    full = expand_buckets(s)
    assert [le for le, _ in full] == list(BUCKET_BOUNDS)
    counts = [c for _, c in full]
    assert counts == sorted(counts)  # cumulative
    assert dict(full)[1e-5] == 2
    assert dict(full)[1.58e-4] == 2
    assert dict(full)[2e-4] == 5
    assert counts[-1] == 6


# --- counters ---------------------------------------------------------------------------------


def test_counters_from_several_threads_sum_exactly() -> None:
    tel = Telemetry(Role.PREFILL, "p-1")
    n_threads, n_iter = 8, 5_000
    start = threading.Barrier(n_threads)

    def work(k: int) -> None:
        start.wait()
        for _ in range(n_iter):
            tel.inc("pushes_ok")
            tel.inc("bytes_pushed", 4096)
            tel.fail("deadline")
            tel.observe("push_latency", 1e-4 * (k + 1))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = tel.snapshot()
    assert s.counters == {
        "pushes_ok": n_threads * n_iter,
        "bytes_pushed": n_threads * n_iter * 4096,
    }
    assert s.failures == {"deadline": n_threads * n_iter}
    assert s.histograms["push_latency"].count == n_threads * n_iter
    assert s.histograms["push_latency"].buckets[-1][1] == n_threads * n_iter


def test_snapshots_taken_while_threads_bump_lose_nothing() -> None:
    """``inc`` and ``observe`` queue and fold in runs; a snapshot folds what is queued.
    Snapshots racing the bumping threads must never drop or double-count a value: counts only
    grow, and the last snapshot holds every value, with its exact sum."""
    tel = Telemetry(Role.PREFILL, "p-1")
    n_threads, n_iter = 4, 20_000
    start = threading.Barrier(n_threads + 1)
    seen: list[tuple[int, int]] = []

    def work() -> None:
        start.wait()
        for _ in range(n_iter):
            tel.observe("push_latency", 0.5)
            tel.inc("bytes_pushed", 3)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    start.wait()
    while any(t.is_alive() for t in threads):
        s = tel.snapshot()
        h = s.histograms.get("push_latency")
        seen.append((h.count if h else 0, s.counters.get("bytes_pushed", 0)))
    for t in threads:
        t.join()
    assert seen == sorted(seen)
    last = tel.snapshot()
    h = last.histograms["push_latency"]
    assert h.count == n_threads * n_iter
    assert h.sum == 0.5 * n_threads * n_iter
    assert h.buckets[-1][1] == n_threads * n_iter
    assert last.counters == {"bytes_pushed": 3 * n_threads * n_iter}


def test_a_value_below_the_fold_run_is_in_the_next_snapshot() -> None:
    tel = Telemetry(Role.DECODE, "d-1")
    tel.inc("requests_ok")
    assert tel.snapshot().counters == {"requests_ok": 1}
    h = Histogram()
    for _ in range(Histogram.FOLD_AT - 1):
        h.observe(2e-3)
    assert h.snapshot().count == Histogram.FOLD_AT - 1
    h.observe(float("nan"))  # a broken clock reading is never counted, queued or not
    h.observe(-1.0)  # a clock step counts as zero
    s = h.snapshot()
    assert s.count == Histogram.FOLD_AT
    assert s.buckets[0][1] == 1  # the zero, alone in the lowest bucket


def test_declare_shows_names_at_zero() -> None:
    tel = Telemetry(Role.DECODE, "d-1")
    tel.declare(counters=["requests_ok"], failures=["peer_dead"], histograms=["decode_latency"])
    tel.inc("requests_ok")
    s = tel.snapshot()
    assert s.counters == {"requests_ok": 1}
    assert s.failures == {"peer_dead": 0}
    assert s.histograms["decode_latency"].count == 0


# --- rates ------------------------------------------------------------------------------------


def test_window_rates_is_pure_arithmetic() -> None:
    names = ("a", "b")
    assert window_rates((0.0, (0, 0)), (2.0, (10, 4)), names) == {"a": 5.0, "b": 2.0}
    assert window_rates((1.0, (5, 5)), (1.0, (9, 9)), names) == {"a": 0.0, "b": 0.0}
    assert window_rates((0.0, (5, 5)), (1.0, (0, 9)), names) == {"a": 0.0, "b": 4.0}


def test_rates_follow_a_sliding_window() -> None:
    clock = FakeClock()
    tel = Telemetry(Role.PREFILL, "p-1", clock=clock)
    assert set(tel.snapshot().rates) == set(RATE_COUNTERS)
    # 1000 pushes/s and 1 MB/s for ten seconds, sampled every half second.
    for _ in range(20):
        clock.t += 0.5
        tel.inc("pushes_ok", 500)
        tel.inc("bytes_pushed", 500_000)
        r = tel.snapshot().rates
    assert r["pushes_ok"] == pytest.approx(1000.0)
    assert r["bytes_pushed"] == pytest.approx(1e6)
    assert r["requests_ok"] == 0.0
    # The load stops: the rate decays and is zero once a whole window has passed.
    for _ in range(2):
        clock.t += 1.0
        r = tel.snapshot().rates
    assert 0.0 < r["pushes_ok"] < 1000.0
    clock.t += Telemetry.RATE_WINDOW_S
    assert tel.snapshot().rates["pushes_ok"] == 0.0
    assert len(tel._samples) <= Telemetry.RATE_WINDOW_S / Telemetry.RATE_SAMPLE_MIN_S + 2


def test_rate_uses_the_start_as_base_before_the_window_fills() -> None:
    clock = FakeClock()
    tel = Telemetry(Role.PREFILL, "p-1", clock=clock)
    clock.t += 0.5
    tel.inc("pushes_ok", 50)
    assert tel.snapshot().rates["pushes_ok"] == pytest.approx(100.0)


# --- gauges, peers, info ----------------------------------------------------------------------


def test_gauges_and_peers_are_read_at_snapshot_time() -> None:
    depth = [3]
    tel = Telemetry(Role.PREFILL, "p-1")
    tel.gauge_fn("deferred", lambda: depth[0])
    tel.peers_fn(lambda: [{"peer": "a", "state": "ready"}])
    tel.peers_fn(
        lambda: [
            {"peer": "b", "state": "failed", "err": ValueError("x"), "duration_s": float("nan")}
        ]
    )
    assert tel.snapshot().gauges == {"deferred": 3.0}
    depth[0] = 7
    s = tel.snapshot()
    assert s.gauges == {"deferred": 7.0}
    assert s.peers == [
        {"peer": "a", "state": "ready"},
        {"peer": "b", "state": "failed", "err": "x", "duration_s": None},
    ]


def test_broken_gauge_is_left_out_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    tel = Telemetry(Role.PREFILL, "p-1")

    def broken() -> float:
        raise RuntimeError("queue gone")

    tel.gauge_fn("deferred", broken)
    tel.gauge_fn("nan", lambda: float("nan"))
    tel.gauge_fn("ok", lambda: 1)
    with caplog.at_level(logging.WARNING, logger="kvpush.telemetry.store"):
        assert tel.snapshot().gauges == {"ok": 1.0}
        assert tel.snapshot().gauges == {"ok": 1.0}
    assert [r.getMessage() for r in caplog.records] == [
        "telemetry: gauge deferred raised RuntimeError: queue gone (left out of snapshots)"
    ]


# --- the snapshot -----------------------------------------------------------------------------


def test_snapshot_fields() -> None:
    clock = FakeClock()
    tel = sample_telemetry(clock)
    clock.t += 2.0
    s = tel.snapshot()
    assert (s.role, s.engine_id, s.incarnation) == ("prefill", "p-abc", "inc-1")
    assert s.uptime_s == 2.0
    assert s.ts == 1.8e9 + clock.t
    assert s.info["workers"] == 4
    assert s.counters == {"pushes_ok": 10, "bytes_pushed": 163840}
    assert s.failures == {"deadline": 1}
    assert s.gauges == {"deferred": 2.0, "pool_free": 1000.0, "pool_total": 1024.0}
    assert s.rates["pushes_ok"] == pytest.approx(5.0)
    assert s.histograms["push_latency"].count == 4
    assert s.peers[0]["peer"] == "127.0.0.1:5700"
    with pytest.raises(AttributeError):
        s.role = Role.DECODE  # type: ignore[misc]


def test_snapshot_round_trips_through_dict_json_and_msgpack() -> None:
    s = sample_telemetry().snapshot()
    d = s.to_dict()
    assert d == json.loads(json.dumps(d))  # plain JSON types only
    assert snapshot_from_dict(d) == s
    assert snapshot_from_dict(msgspec.msgpack.decode(msgspec.msgpack.encode(s))) == s
    assert isinstance(snapshot_from_dict(d).histograms["push_latency"].buckets[0], tuple)


def test_ranks_round_trip_and_one_rank_encodes_as_before() -> None:
    one = sample_telemetry().snapshot()
    assert "ranks" not in one.to_dict()  # the form of a one-rank endpoint did not change
    other = sample_telemetry()
    other.inc("pushes_ok", 5)
    merged = merge([one, other.snapshot()])
    d = merged.to_dict()
    assert d == json.loads(json.dumps(d))
    ranks: Any = d["ranks"]
    assert [r["counters"]["pushes_ok"] for r in ranks] == [10, 15]
    assert d["counters"] == {"pushes_ok": 25, "bytes_pushed": 2 * 163840}
    assert snapshot_from_dict(d) == merged
    assert snapshot_from_dict(msgspec.msgpack.decode(msgspec.msgpack.encode(merged))) == merged
    assert snapshot_from_dict(d).ranks[1].histograms["push_latency"].count == 4


def test_snapshot_from_dict_rejects_a_bad_dict() -> None:
    d = sample_telemetry().snapshot().to_dict()
    del d["counters"]
    with pytest.raises(msgspec.ValidationError, match="counters"):
        snapshot_from_dict(d)
    d = sample_telemetry().snapshot().to_dict()
    d["counters"] = {"pushes_ok": "many"}
    with pytest.raises(msgspec.ValidationError):
        snapshot_from_dict(d)


def test_snapshot_is_a_copy() -> None:
    tel = sample_telemetry()
    s = tel.snapshot()
    tel.inc("pushes_ok")
    tel.observe("push_latency", 1.0)
    assert s.counters["pushes_ok"] == 10
    assert s.histograms["push_latency"].count == 4
    assert isinstance(s, Snapshot)


def test_core_layer_imports_no_ui_or_native_modules() -> None:
    code = (
        "import sys, kvpush.telemetry.store; "
        "bad = {'rich', 'typer', 'torch', 'nixl', 'zmq', 'prometheus_client'} & set(sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_merged_fragmentation_gauges_are_not_summed() -> None:
    """Free blocks add up over ranks; the largest free run and the mean run length do not."""
    snaps = []
    for values in ((10.0, 8.0, 4.0), (6.0, 3.0, 2.0)):
        t = Telemetry(Role.DECODE, "d-x")
        names = ("pool_free", "pool_largest_free_run", "alloc_mean_run_len")
        for name, v in zip(names, values, strict=True):
            t.gauge_fn(name, functools.partial(float, v))
        snaps.append(t.snapshot())
    g = merge(snaps).gauges
    assert (g["pool_free"], g["pool_largest_free_run"], g["alloc_mean_run_len"]) == (16, 8, 3.0)

"""Tests of kvpush.telemetry.prom: a real exporter on a free port, scraped over HTTP."""

from __future__ import annotations

import functools
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush.config import Role
from kvpush.errors import BindError
from kvpush.telemetry.merge import merge
from kvpush.telemetry.names import Counter, Failure
from kvpush.telemetry.prom import (
    ENDPOINT_COUNTERS,
    PrometheusExporter,
    metric_name,
    snapshot_families,
)
from kvpush.telemetry.store import Telemetry
from tests.conftest import SMALL
from tests.support.procs import Launcher


def busy_telemetry() -> Telemetry:
    tel = Telemetry(Role.PREFILL, "p-abc", "inc-1")
    tel.info(device="cpu", writer="deferred", backends="UCX", version="0.1.0")
    for name, value in {
        "deferred": 2,
        "inflight_writes": 5,
        "pool_free": 1000,
        "pool_inflight": 24,
        "pool_total": 1024,
        "handshake_workers": 4,
    }.items():
        tel.gauge_fn(name, functools.partial(int, value))
    tel.peers_fn(
        lambda: [
            {
                "peer": "127.0.0.1:5700",
                "engine_id": "d-1",
                "mode": "full",
                "state": "ready",
                "duration_s": 0.041,
                "failures": 1,
                "last_error": None,
            },
        ]
    )
    tel.inc("pushes_ok", 7)
    tel.inc("bytes_pushed", 7 * 16384)
    tel.fail("deadline", 2)
    tel.observe("push_latency", 5e-5)
    tel.observe("push_latency", 2e-3)
    return tel


@pytest.fixture(scope="module")  # stop() waits for the server's 0.5 s poll: share one
def exporter() -> Iterator[tuple[PrometheusExporter, Telemetry]]:
    tel = busy_telemetry()
    exp = PrometheusExporter(tel.snapshot)
    exp.start()
    try:
        yield exp, tel
    finally:
        exp.stop()


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``{sample name: {sorted labels: value}}`` of one /metrics page."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


BASE = (("engine_id", "p-abc"), ("role", "prefill"))


def labels(**kv: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted([*BASE, *kv.items()]))


def test_serves_metrics_over_http(exporter: tuple[PrometheusExporter, Telemetry]) -> None:
    exp, tel = exporter
    assert exp.host == "127.0.0.1"
    assert exp.port > 0
    assert exp.url == f"http://127.0.0.1:{exp.port}/metrics"
    m = scrape(exp.url)
    assert m["kvpush_pushes_ok_total"] == {labels(): 7}
    assert m["kvpush_pushed_bytes_total"] == {labels(): 7 * 16384}
    fails = m["kvpush_failures_total"]
    assert {k: v for k, v in fails.items() if v} == {labels(kind="deadline"): 2}
    assert set(fails) == {labels(kind=str(k)) for k in Failure}  # every kind, 0 until it moves
    assert m["kvpush_queue_depth"] == {
        labels(queue="deferred"): 2,
        labels(queue="inflight_writes"): 5,
    }
    assert m["kvpush_pool_blocks"] == {labels(state="free"): 1000, labels(state="inflight"): 24}
    assert m["kvpush_pool_capacity_blocks"] == {labels(): 1024}
    assert m["kvpush_handshake_workers"] == {labels(): 4}
    buckets = m["kvpush_push_latency_seconds_bucket"]
    assert buckets[labels(le="+Inf")] == 2
    assert buckets[labels(le="5.01e-05")] == 1
    assert buckets[labels(le="0.002")] == 2
    assert len(buckets) == 92  # 91 fixed bounds + Inf: the same series at every scrape
    assert m["kvpush_push_latency_seconds_count"] == {labels(): 2}
    assert m["kvpush_push_latency_seconds_sum"][labels()] == pytest.approx(2.05e-3)
    assert m["kvpush_peer_handshake_state"] == {
        labels(peer="127.0.0.1:5700", peer_rank="0", mode="full", state="ready"): 1
    }
    assert m["kvpush_peer_handshake_failures_total"] == {
        labels(peer="127.0.0.1:5700", peer_rank="0"): 1
    }
    assert m["kvpush_peer_handshake_duration_seconds"] == {
        labels(peer="127.0.0.1:5700", peer_rank="0"): 0.041
    }
    assert m["kvpush_info"] == {
        labels(
            device="cpu", writer="deferred", backends="UCX", version="0.1.0", incarnation="inc-1"
        ): 1
    }
    assert "kvpush_uptime_seconds" in m

    # The page is drawn from a fresh snapshot at every scrape.
    tel.inc("pushes_ok", 3)
    tel.fail("peer_dead")
    m = scrape(exp.url)
    assert m["kvpush_pushes_ok_total"] == {labels(): 10}
    assert m["kvpush_failures_total"][labels(kind="peer_dead")] == 1


def test_port_in_use_is_a_bind_error(exporter: tuple[PrometheusExporter, Telemetry]) -> None:
    exp, tel = exporter
    second = PrometheusExporter(tel.snapshot, port=exp.port)
    with pytest.raises(BindError) as info:
        second.start()
    assert info.value.message == (
        f"cannot bind metrics port 127.0.0.1:{exp.port}: address already in use"
    )
    assert "0 means off" in info.value.hint
    second.stop()  # nothing started: a no-op


def test_stop_closes_the_port_and_is_idempotent() -> None:
    exp = PrometheusExporter(Telemetry(Role.DECODE, "d-1").snapshot)
    exp.start()
    url = exp.url
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    assert "# TYPE kvpush_failures_total counter" in text  # there before any failure
    exp.stop()
    exp.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_family_names_are_sanitised_and_unique() -> None:
    tel = Telemetry(Role.PREFILL, "p-1")
    tel.inc("weird-name.x")
    tel.inc("already_total")
    tel.inc("failures")  # would clash with kvpush_failures_total: the first family wins
    tel.observe("rtt_seconds", 1e-3)
    names = [f.name for f in snapshot_families(tel.snapshot())]
    assert len(names) == len(set(names))
    assert {"kvpush_weird_name_x", "kvpush_already", "kvpush_rtt_seconds"} <= set(names)
    assert metric_name("9lives") == "_9lives"


# --- tensor-parallel ranks --------------------------------------------------------------------


def decode_rank(rank: int) -> Telemetry:
    """Rank ``rank`` of a TP-2 decode endpoint: its own queue, pool, peers and shares."""
    tel = Telemetry(Role.DECODE, "p-abc", "inc-1")
    tel.info(device=f"cuda:{rank}", agent=f"p-abc#inc.r{rank}", version="0.1.0", rank=rank,
             tp_size=2, handshake="notif")  # fmt: skip
    for name, value in {"d_waiting": 3 + rank, "pool_free": 60 - rank, "pool_total": 64}.items():
        tel.gauge_fn(name, functools.partial(float, value))
    peer = "127.0.0.1:5600" if rank == 0 else f"127.0.0.1:5600 rank {rank}"  # peer_name's form
    tel.peers_fn(lambda: [{"peer": peer, "mode": "notif", "state": "connected",
                           "failures": rank, "duration_s": 0.01}])  # fmt: skip
    tel.inc("requests_ok", 4)  # its share of each of the 4 requests
    tel.inc("notifs_received", 4 + rank)
    tel.inc("bytes_received", 4 * 8192)
    tel.fail("deadline", rank)
    tel.observe("decode_latency", 1e-3)
    tel.observe("handshake_duration", 0.01)
    return tel


def test_ranks_have_a_rank_label_and_sums_count_once() -> None:
    ranks = [decode_rank(0), decode_rank(1)]
    top = Telemetry(Role.DECODE, "p-abc", "inc-1")
    top.inc("requests_ok", 4)
    top.declare(counters=["requests_failed"])
    for _ in range(4):
        top.observe("decode_latency", 2e-3)
    exp = PrometheusExporter(lambda: merge([r.snapshot() for r in ranks], top.snapshot()))
    exp.start()
    try:
        m = scrape(exp.url)
    finally:
        exp.stop()
    base = (("engine_id", "p-abc"), ("role", "decode"))

    def lab(**kv: str) -> tuple[tuple[str, str], ...]:
        return tuple(sorted([*base, *kv.items()]))

    # Rank-level: one series per rank, never also the total.
    assert m["kvpush_notifs_received_total"] == {lab(rank="0"): 4, lab(rank="1"): 5}
    assert m["kvpush_received_bytes_total"] == {lab(rank="0"): 32768, lab(rank="1"): 32768}
    fails = m["kvpush_failures_total"]
    assert fails[lab(rank="0", kind="deadline")] == 0
    assert {k: v for k, v in fails.items() if v} == {lab(rank="1", kind="deadline"): 1}
    assert m["kvpush_queue_depth"] == {
        lab(rank="0", queue="d_waiting"): 3,
        lab(rank="1", queue="d_waiting"): 4,
    }
    assert m["kvpush_pool_blocks"] == {
        lab(rank="0", state="free"): 60,
        lab(rank="1", state="free"): 59,
    }
    assert m["kvpush_pool_capacity_blocks"] == {lab(rank="0"): 64, lab(rank="1"): 64}
    assert m["kvpush_handshake_duration_seconds_count"] == {lab(rank="0"): 1, lab(rank="1"): 1}
    assert m["kvpush_peer_handshake_state"] == {
        lab(rank=r, peer="127.0.0.1:5600", peer_rank=r, mode="notif", state="connected"): 1
        for r in "01"
    }
    assert m["kvpush_peer_handshake_failures_total"] == {
        lab(rank="0", peer="127.0.0.1:5600", peer_rank="0"): 0,
        lab(rank="1", peer="127.0.0.1:5600", peer_rank="1"): 1,
    }
    # Request-level: the endpoint's count, once, without rank (the ranks' shares left out).
    assert m["kvpush_requests_ok_total"] == {lab(): 4}
    assert m["kvpush_requests_failed_total"] == {lab(): 0}
    assert m["kvpush_decode_latency_seconds_count"] == {lab(): 4}
    assert m["kvpush_decode_latency_seconds_sum"][lab()] == pytest.approx(8e-3)
    # The endpoint's own facts once; what differs between ranks per rank.
    assert list(m["kvpush_uptime_seconds"]) == [lab()]
    assert m["kvpush_info"] == {
        lab(version="0.1.0", tp_size="2", handshake="notif", incarnation="inc-1"): 1
    }
    assert m["kvpush_rank_info"] == {
        lab(rank="0", device="cuda:0", agent="p-abc#inc.r0"): 1,
        lab(rank="1", device="cuda:1", agent="p-abc#inc.r1"): 1,
    }
    # No sample carries both a rank and a total of the same name: sum() never counts twice.
    for name, series in m.items():
        ranked = {dict(k).get("rank") is not None for k in series}
        assert len(ranked) <= 1, name


def test_one_rank_keeps_its_series_without_a_rank_label() -> None:
    tel = decode_rank(0)
    tel.info(tp_size=1)
    names = snapshot_families(merge([tel.snapshot()]))
    assert all("rank" not in s.labels for f in names for s in f.samples)
    (info,) = [f for f in names if f.name == "kvpush"]
    assert info.samples[0].labels["tp_size"] == "1" and "device" in info.samples[0].labels
    assert "kvpush_rank" not in {f.name for f in names}
    requests = next(f for f in names if f.name == "kvpush_requests_ok")
    assert [s.value for s in requests.samples] == [4]  # one rank: its own count


@pytest.mark.integration
@pytest.mark.parametrize("tp", [1, 2])
def test_every_counter_and_failure_is_on_the_page_at_zero_after_start_up(
    tp: int, serve: Launcher, free_port: int
) -> None:
    """A real endpoint, scraped right after it is ready: every counter and every failure kind
    is a series at 0 (the first failure is an increase from 0, not a new series), at TP 1 as at
    TP 2."""
    d = serve.serve("decode", *SMALL, "--tp", str(tp), "--metrics-port", str(free_port))
    m = scrape(str(d.info["metrics"]))
    ranks = [()] if tp == 1 else [(("rank", str(r)),) for r in range(tp)]

    def lab(*extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted([("engine_id", d.engine_id), ("role", "decode"), *extra]))

    want = {lab(*r, ("kind", str(k))) for r in ranks for k in Failure}
    assert set(m["kvpush_failures_total"]) == want
    assert set(m["kvpush_failures_total"].values()) == {0}
    for c in Counter:
        name = metric_name(c)
        name = f"{name.removeprefix('bytes_')}_bytes" if name.startswith("bytes_") else name
        series = m[f"kvpush_{name}_total"]
        once = tp > 1 and c in ENDPOINT_COUNTERS  # a request-level count: once, no rank label
        assert set(series) == ({lab()} if once or tp == 1 else {lab(*r) for r in ranks}), c
        if c not in (Counter.HANDSHAKES_STARTED,):  # nothing moved yet
            assert set(series.values()) == {0}, c
    assert m["kvpush_requests_failed_total"] == {lab(): 0}

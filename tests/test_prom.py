"""Tests of kvpush.telemetry.prom: a real exporter on a free port, scraped over HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush.errors import BindError
from kvpush.telemetry.prom import PrometheusExporter, metric_name, snapshot_families
from kvpush.telemetry.store import Telemetry


def busy_telemetry() -> Telemetry:
    tel = Telemetry("prefill", "p-abc", "inc-1")
    tel.info(device="cpu", writer="deferred", backends="UCX", version="0.1.0")
    for name, value in {
        "deferred": 2,
        "inflight_writes": 5,
        "pool_free": 1000,
        "pool_inflight": 24,
        "pool_total": 1024,
        "handshake_workers": 4,
    }.items():
        tel.gauge_fn(name, lambda v=value: v)
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
    assert m["kvpush_failures_total"] == {labels(kind="deadline"): 2}
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
        labels(peer="127.0.0.1:5700", mode="full", state="ready"): 1
    }
    assert m["kvpush_peer_handshake_failures"] == {labels(peer="127.0.0.1:5700"): 1}
    assert m["kvpush_peer_handshake_duration_seconds"] == {labels(peer="127.0.0.1:5700"): 0.041}
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
    assert "0 picks a free one" in info.value.hint
    second.stop()  # nothing started: a no-op


def test_stop_closes_the_port_and_is_idempotent() -> None:
    exp = PrometheusExporter(Telemetry("decode", "d-1").snapshot)
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
    tel = Telemetry("prefill", "p-1")
    tel.inc("weird-name.x")
    tel.inc("already_total")
    tel.inc("failures")  # would clash with kvpush_failures_total: the first family wins
    tel.observe("rtt_seconds", 1e-3)
    names = [f.name for f in snapshot_families(tel.snapshot())]
    assert len(names) == len(set(names))
    assert {"kvpush_weird_name_x", "kvpush_already", "kvpush_rtt_seconds"} <= set(names)
    assert metric_name("9lives") == "_9lives"

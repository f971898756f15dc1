"""Prometheus exporter: serves ``/metrics`` drawn from the same ``Snapshot`` as the live view.

Owns one HTTP server thread (``prometheus_client.start_http_server``, a daemon thread that it stops
in ``stop()``) and a private ``CollectorRegistry``, so nothing leaks into the process-global
registry. A custom collector calls ``source()`` on the scrape thread and translates the snapshot
(``snapshot_families`` is a pure function of it):

- ``kvpush_<counter>_total`` for every counter; ``bytes_<x>`` becomes ``kvpush_<x>_bytes_total``
- ``kvpush_failures_total{kind}``: failures by kind
- ``kvpush_queue_depth{queue}``: the queue gauges (``QUEUE_GAUGES``)
- ``kvpush_pool_blocks{state}`` (free, allocated, inflight, quarantined) and
  ``kvpush_pool_capacity_blocks`` (``pool_total``); ``kvpush_<gauge>`` for any other gauge
- ``kvpush_<hist>_seconds``: histograms on the fixed ``BUCKET_BOUNDS``
- ``kvpush_peer_handshake_state{peer,mode,state}`` = 1 per peer row, with
  ``kvpush_peer_handshake_failures{peer}`` and ``kvpush_peer_handshake_duration_seconds{peer}``
- ``kvpush_uptime_seconds``; ``kvpush_info{incarnation,...}`` = 1 with the static info as labels

Every series carries ``role`` and ``engine_id``. Rates are left to PromQL ``rate()``. Binds
127.0.0.1 unless told otherwise: the side-channel advisories in this space are about services
bound to all interfaces.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvpush.errors import BindError
from kvpush.telemetry.names import POOL_GAUGES, QUEUE_GAUGES
from kvpush.telemetry.snapshot import Snapshot, expand_buckets

logger = logging.getLogger(__name__)

__all__ = ["PrometheusExporter", "metric_name", "snapshot_families"]

_BASE = ("role", "engine_id")
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(raw: str) -> str:
    """A Prometheus-safe name fragment: invalid characters become ``_``."""
    name = _INVALID.sub("_", raw)
    return f"_{name}" if name[:1].isdigit() else name


def _counter_base(counter: str) -> str:
    """``bytes_pushed`` → ``kvpush_pushed_bytes`` (CounterMetricFamily adds ``_total``)."""
    name = metric_name(counter)
    if name.startswith("bytes_"):
        name = f"{name[len('bytes_') :]}_bytes"
    return f"kvpush_{name.removesuffix('_total')}"


def _hist_name(hist: str) -> str:
    name = metric_name(hist)
    return f"kvpush_{name}" if name.endswith("_seconds") else f"kvpush_{name}_seconds"


def snapshot_families(snap: Snapshot) -> list[Metric]:
    """Pure: the metric families of one snapshot, each name once (a clash keeps the first)."""
    seen: set[str] = set()
    out: list[Metric] = []
    for fam in _families(snap):
        if fam.name not in seen:
            seen.add(fam.name)
            out.append(fam)
    return out


def _families(snap: Snapshot) -> Iterator[Metric]:
    base = [snap.role, snap.engine_id]

    for counter, value in sorted(snap.counters.items()):
        c = CounterMetricFamily(_counter_base(counter), f"kvpush counter {counter}", labels=_BASE)
        c.add_metric(base, value)
        yield c

    fails = CounterMetricFamily(
        "kvpush_failures",
        "Failures by kind (each counted once, where handled)",
        labels=[*_BASE, "kind"],
    )
    for kind, value in sorted(snap.failures.items()):
        fails.add_metric([*base, kind], value)
    yield fails

    queues = GaugeMetricFamily(
        "kvpush_queue_depth", "Items waiting in each queue", labels=[*_BASE, "queue"]
    )
    pool = GaugeMetricFamily(
        "kvpush_pool_blocks", "KV blocks of the pool by state", labels=[*_BASE, "state"]
    )
    others: list[GaugeMetricFamily] = []
    for gauge, level in sorted(snap.gauges.items()):
        if gauge in QUEUE_GAUGES:
            queues.add_metric([*base, gauge], level)
        elif gauge == "pool_total":
            g = GaugeMetricFamily(
                "kvpush_pool_capacity_blocks", "KV blocks in the pool", labels=_BASE
            )
            g.add_metric(base, level)
            others.append(g)
        elif gauge in POOL_GAUGES:
            pool.add_metric([*base, gauge.removeprefix("pool_")], level)
        else:
            g = GaugeMetricFamily(
                f"kvpush_{metric_name(gauge)}", f"kvpush gauge {gauge}", labels=_BASE
            )
            g.add_metric(base, level)
            others.append(g)
    yield queues
    yield pool
    yield from others

    for hist, h in sorted(snap.histograms.items()):
        fam = HistogramMetricFamily(_hist_name(hist), f"kvpush {hist} in seconds", labels=_BASE)
        buckets: list[tuple[str, float]] = [
            (repr(le), cum)
            for le, cum in expand_buckets(h)  # repr: '5.01e-05', as Go writes it
        ]
        buckets.append(("+Inf", h.count))
        fam.add_metric(base, buckets, h.sum)
        yield fam

    state = GaugeMetricFamily(
        "kvpush_peer_handshake_state",
        "1 for each peer, labelled with its handshake mode and state",
        labels=[*_BASE, "peer", "mode", "state"],
    )
    failures = GaugeMetricFamily(
        "kvpush_peer_handshake_failures", "Failed handshakes per peer", labels=[*_BASE, "peer"]
    )
    duration = GaugeMetricFamily(
        "kvpush_peer_handshake_duration_seconds",
        "Duration of the last handshake per peer",
        labels=[*_BASE, "peer"],
    )
    for row in snap.peers:
        peer = str(row.get("peer", ""))
        state.add_metric([*base, peer, str(row.get("mode", "")), str(row.get("state", ""))], 1)
        n = row.get("failures")
        if isinstance(n, int | float):
            failures.add_metric([*base, peer], n)
        d = row.get("duration_s")
        if isinstance(d, int | float):
            duration.add_metric([*base, peer], d)
    yield state
    yield failures
    yield duration

    up = GaugeMetricFamily(
        "kvpush_uptime_seconds", "Seconds since the endpoint started", labels=_BASE
    )
    up.add_metric(base, snap.uptime_s)
    yield up

    labels = {metric_name(k): str(v) for k, v in sorted(snap.info.items()) if k}
    labels.pop("role", None)
    labels.pop("engine_id", None)
    labels["incarnation"] = snap.incarnation
    info = InfoMetricFamily("kvpush", "Static facts about this endpoint", labels=_BASE)
    info.add_metric(base, labels)
    yield info


class _SnapshotCollector(Collector):
    def __init__(self, source: Callable[[], Snapshot]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []  # names depend on the snapshot: do not call source() at register time

    def collect(self) -> list[Metric]:
        return snapshot_families(self._source())


class PrometheusExporter:
    """Serve ``source()`` snapshots at ``http://host:port/metrics`` until ``stop()``."""

    def __init__(
        self, source: Callable[[], Snapshot], host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.host = host
        self.port = port  # the bound port once started (port 0 picks a free one)
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_SnapshotCollector(source))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        """Bind and serve; returns once the socket is listening. Raises ``BindError``."""
        if self._server is not None:
            return
        try:
            server, thread = start_http_server(self.port, addr=self.host, registry=self._registry)
        except OSError as e:
            where = f"{self.host}:{self.port}"
            hint = "choose another --metrics-port (0 picks a free one) or stop the process using it"
            if e.errno == errno.EADDRINUSE:
                raise BindError(
                    f"cannot bind metrics port {where}: address already in use", hint=hint
                ) from e
            reason = e.strerror or str(e)
            raise BindError(
                f"cannot bind metrics port {where}: {reason}",
                hint="check --metrics-host names an address of this machine",
            ) from e
        self._server, self._thread = server, thread
        self.port = server.server_port
        logger.info("serving Prometheus metrics at %s", self.url)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket; idempotent."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout)

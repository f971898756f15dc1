"""Prometheus exporter: serves ``/metrics`` drawn from the same ``Snapshot`` as the live view,
and, given a ``Health``, the probes ``/healthz`` and ``/readyz`` (200 ``ok``, or 503 with a
one-line reason; ``?format=json`` or ``Accept: application/json`` answers
``{"ok": ..., "reason": ...}``).

Owns one HTTP server thread (``metrics-http``: it accepts connections, closes those past their
deadline and ticks the ``Health``'s samples; stopped in ``stop()``), one daemon thread per open
connection (``metrics-conn``), and a private ``CollectorRegistry``, so nothing leaks into the
process-global registry. The server is bounded (``BoundedServer``): at most ``max_connections``
connections (threads) at a time -- one more is answered 503 and closed by the accepting thread,
no thread started --, each closed when it sends nothing for ``idle_timeout_s`` or is still open
after ``connection_deadline_s`` (a client that trickles its request a byte at a time). An idle
scraper, a port scan or a flood of idle connections therefore costs at most that many threads,
and probes answer again within the idle timeout once it stops. A custom collector calls
``source()`` on the scrape thread and translates the snapshot (``snapshot_families`` is a pure
function of it):

- ``kvpush_<counter>_total`` for every counter; ``bytes_<x>`` becomes ``kvpush_<x>_bytes_total``
- ``kvpush_failures_total{kind}``: failures by kind
- ``kvpush_queue_depth{queue}``: the queue gauges (``QUEUE_GAUGES``)
- ``kvpush_pool_blocks{state}`` (free, allocated, inflight, quarantined) and
  ``kvpush_pool_capacity_blocks`` (``pool_total``); ``kvpush_<gauge>`` for any other gauge
- ``kvpush_<hist>_seconds``: histograms on the fixed ``BUCKET_BOUNDS``
- the peer rows (``kvpush.telemetry.prom_peers``): ``kvpush_peer_handshake_state``,
  ``..._failures_total``, ``..._duration_seconds`` and, on a P, which lane carries each D's KV
  (``kvpush_peer_lane_info``) and what posting costs there
- ``kvpush_uptime_seconds``; ``kvpush_info{incarnation,...}`` = 1 with the static info as labels

Every counter (``names.Counter``) and failure kind (``names.Failure``) this version knows is
exported from the first scrape, at 0 until it moves, at every TP size. Every series carries
``role`` and ``engine_id``. Rates are left to PromQL ``rate()``. Binds
127.0.0.1 unless told otherwise: the side-channel advisories in this space are about services
bound to all interfaces.

Tensor-parallel ranks (a snapshot with ``ranks``): a series carries ``rank`` exactly when it
is one rank's, so that ``sum()`` over any metric never counts a thing twice:

- rank-level data -- every counter, failure, queue, pool, other gauge, histogram and peer row
  that the ranks keep themselves -- is exported once per rank, from the rank's own snapshot,
  with ``rank="0"``, ``"1"``, ... and never also as the endpoint's total (the total is
  ``sum without (rank) (...)``);
- what the endpoint counts once per request (``ENDPOINT_COUNTERS``, ``ENDPOINT_HISTS``:
  prefills, requests_ok/failed, decode_latency) is exported once, without ``rank``; the
  ranks' own shares of those names are left out (each rank completes its part of every
  request: summed they would count a request once per rank);
- ``kvpush_uptime_seconds`` and ``kvpush_info`` are the endpoint's (no ``rank``);
  ``kvpush_info`` keeps the facts every rank shares (``tp_size`` among them) and
  ``kvpush_rank_info{rank,...}`` = 1 per rank holds those that differ (agent, device).

One rank exports exactly the series it did before ranks existed (no ``rank`` label, not even
``rank="0"``): dashboards and alerts of one-rank endpoints keep working, the request-level
series keep one identity at every TP size, and ``sum by (...)`` reads the same either way.
"""

from __future__ import annotations

import errno
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvpush.errors import BindError
from kvpush.telemetry.health import Health
from kvpush.telemetry.httpserver import (
    CONNECTION_DEADLINE_S,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    BoundedServer,
    QuietHandler,
    probe_app,
)
from kvpush.telemetry.names import (
    POOL_GAUGES,
    QUEUE_GAUGES,
    REQUEST_COUNTERS,
    REQUEST_HISTS,
    Counter,
    Failure,
)
from kvpush.telemetry.prom_peers import peer_families, split_peer
from kvpush.telemetry.snapshot import HistSnapshot, Snapshot, expand_buckets
from kvpush.telemetry.tracing import SPANS_DROPPED

logger = logging.getLogger(__name__)

__all__ = [
    "ENDPOINT_COUNTERS",
    "ENDPOINT_HISTS",
    "PrometheusExporter",
    "metric_name",
    "snapshot_families",
    "split_peer",
]

_BASE = ("role", "engine_id")

#: What a multi-rank endpoint counts once per request (``names.REQUEST_COUNTERS`` and
#: ``REQUEST_HISTS``, all roles). Their ranks' own shares (each rank completes its part of every
#: request) are left out of the page.
ENDPOINT_COUNTERS = frozenset(c for cs in REQUEST_COUNTERS.values() for c in cs)
ENDPOINT_HISTS = frozenset(h for hs in REQUEST_HISTS.values() for h in hs)
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


@dataclass(frozen=True)
class _View:
    """How one snapshot's series are labelled: the rank-level ``parts`` (one per rank, with
    its ``rank`` label, or the one snapshot) and the names the endpoint counts once."""

    snap: Snapshot
    base: list[str]
    parts: list[tuple[list[str], Snapshot]]
    lab: list[str]
    once_counters: frozenset[str]
    once_hists: frozenset[str]


def _view(snap: Snapshot) -> _View:
    ranked = bool(snap.ranks)
    base = [snap.role, snap.engine_id]
    # The series of rank-level data: one part per rank (rank label) or the one snapshot.
    parts: list[tuple[list[str], Snapshot]] = (
        [([*base, str(r.info.get("rank", i))], r) for i, r in enumerate(snap.ranks)]
        if ranked
        else [(base, snap)]
    )
    return _View(
        snap=snap,
        base=base,
        parts=parts,
        lab=[*_BASE, "rank"] if ranked else list(_BASE),
        once_counters=ENDPOINT_COUNTERS if ranked else frozenset(),
        once_hists=ENDPOINT_HISTS if ranked else frozenset(),
    )


def _families(snap: Snapshot) -> Iterator[Metric]:
    v = _view(snap)
    yield from _counter_families(v)
    yield _failure_family(v)
    yield from _gauge_families(v)
    yield from _hist_families(v)
    yield from peer_families(v.parts, v.lab)
    up = GaugeMetricFamily(
        "kvpush_uptime_seconds", "Seconds since the endpoint started", labels=_BASE
    )
    up.add_metric(v.base, snap.uptime_s)
    yield up
    yield from _info(snap, v.parts)


def _counter_families(v: _View) -> Iterator[Metric]:
    # Every counter this version knows is on the page from the first scrape, at 0 until it
    # moves (rate() and increase() then see the first event, and an absent series means a
    # missing endpoint, not a quiet one), whatever the TP size.
    once_counters, snap = v.once_counters, v.snap
    names = {c for _, s in v.parts for c in s.counters if c not in once_counters}
    names |= {c for c in snap.counters if c in once_counters}
    names |= {str(c) for c in Counter} | {SPANS_DROPPED}  # the last: --otlp-traces-endpoint
    for counter in sorted(names):
        doc = f"kvpush counter {counter}"
        if counter in once_counters:
            c = CounterMetricFamily(_counter_base(counter), doc, labels=_BASE)
            c.add_metric(v.base, snap.counters.get(counter, 0))
        else:
            c = CounterMetricFamily(_counter_base(counter), doc, labels=v.lab)
            for key, s in v.parts:
                c.add_metric(key, s.counters.get(counter, 0))
        yield c


def _failure_family(v: _View) -> Metric:
    fails = CounterMetricFamily(
        "kvpush_failures",
        "Failures by kind (each counted once, where handled)",
        labels=[*v.lab, "kind"],
    )
    for key, s in v.parts:
        known = {str(k): 0 for k in Failure}  # every kind at 0 from the start, as counters
        for kind, value in sorted({**known, **s.failures}.items()):
            fails.add_metric([*key, kind], value)
    return fails


def _gauge_families(v: _View) -> Iterator[Metric]:
    lab = v.lab
    queues = GaugeMetricFamily(
        "kvpush_queue_depth", "Items waiting in each queue", labels=[*lab, "queue"]
    )
    pool = GaugeMetricFamily(
        "kvpush_pool_blocks", "KV blocks of the pool by state", labels=[*lab, "state"]
    )
    others: dict[str, GaugeMetricFamily] = {}
    for key, s in v.parts:
        for gauge, level in sorted(s.gauges.items()):
            if gauge in QUEUE_GAUGES:
                queues.add_metric([*key, gauge], level)
            elif gauge in POOL_GAUGES and gauge != "pool_total":
                pool.add_metric([*key, gauge.removeprefix("pool_")], level)
            else:
                g = others.get(gauge)
                if g is None:
                    g = others[gauge] = _other_gauge(gauge, lab)
                g.add_metric(key, level)
    yield queues
    yield pool
    yield from (others[g] for g in sorted(others))


def _other_gauge(gauge: str, lab: list[str]) -> GaugeMetricFamily:
    if gauge == "pool_total":
        return GaugeMetricFamily("kvpush_pool_capacity_blocks", "KV blocks in the pool", labels=lab)
    return GaugeMetricFamily(f"kvpush_{metric_name(gauge)}", f"kvpush gauge {gauge}", labels=lab)


def _hist_families(v: _View) -> Iterator[Metric]:
    once_hists, snap = v.once_hists, v.snap
    hist_names = {h for _, s in v.parts for h in s.histograms if h not in once_hists}
    hist_names |= {h for h in snap.histograms if h in once_hists}
    for hist in sorted(hist_names):
        doc = f"kvpush {hist} in seconds"
        if hist in once_hists:
            fam = HistogramMetricFamily(_hist_name(hist), doc, labels=_BASE)
            _add_hist(fam, v.base, snap.histograms[hist])
        else:
            fam = HistogramMetricFamily(_hist_name(hist), doc, labels=v.lab)
            for key, s in v.parts:
                if hist in s.histograms:
                    _add_hist(fam, key, s.histograms[hist])
        yield fam


def _add_hist(fam: HistogramMetricFamily, key: list[str], h: HistSnapshot) -> None:
    buckets: list[tuple[str, float]] = [
        (repr(le), cum)
        for le, cum in expand_buckets(h)  # repr: '5.01e-05', as Go writes it
    ]
    buckets.append(("+Inf", h.count))
    fam.add_metric(key, buckets, h.sum)


def _info_labels(info: dict[str, str | int | float]) -> dict[str, str]:
    labels = {metric_name(k): str(v) for k, v in sorted(info.items()) if k}
    for k in ("role", "engine_id", "rank"):
        labels.pop(k, None)
    return labels


def _info(snap: Snapshot, parts: list[tuple[list[str], Snapshot]]) -> Iterator[Metric]:
    """``kvpush_info``: what the endpoint's ranks share; ``kvpush_rank_info``: what differs."""
    base = [snap.role, snap.engine_id]
    ranks = [_info_labels(s.info) for _, s in parts] if snap.ranks else []
    labels = _info_labels(snap.info)
    varying = {k for k in labels if any(r.get(k) != labels[k] for r in ranks)}
    labels = {k: v for k, v in labels.items() if k not in varying}
    labels["incarnation"] = snap.incarnation
    info = InfoMetricFamily("kvpush", "Static facts about this endpoint", labels=_BASE)
    info.add_metric(base, labels)
    yield info
    if ranks:
        per_rank = InfoMetricFamily(
            "kvpush_rank", "Static facts that differ between the ranks", labels=[*_BASE, "rank"]
        )
        for (key, _), r in zip(parts, ranks, strict=True):
            per_rank.add_metric(key, {k: v for k, v in r.items() if k in varying})
        yield per_rank


class _SnapshotCollector(Collector):
    def __init__(self, source: Callable[[], Snapshot]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []  # names depend on the snapshot: do not call source() at register time

    def collect(self) -> list[Metric]:
        return snapshot_families(self._source())


class PrometheusExporter:
    """Serve ``source()`` snapshots at ``http://host:port/metrics`` (and ``health``'s probes)
    until ``stop()``."""

    def __init__(
        self,
        source: Callable[[], Snapshot],
        host: str = "127.0.0.1",
        port: int = 0,
        health: Health | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        connection_deadline_s: float = CONNECTION_DEADLINE_S,
    ) -> None:
        self.host = host
        self.port = port  # the bound port once started (port 0 picks a free one)
        self.health = health
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.connection_deadline_s = connection_deadline_s
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_SnapshotCollector(source))
        self._server: BoundedServer | None = None
        self._thread: threading.Thread | None = None
        self._held: socket.socket | None = None  # the port, bound by ``reserve``

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def reserve(self) -> None:
        """Bind the port now and hold it until ``start`` (which serves on it): a port in use
        is refused before the endpoint allocates its pool. Raises ``BindError``."""
        if self._held is not None or self._server is not None:
            return
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((self.host, self.port))
            s.listen(1)  # held, so nobody else binds it meanwhile
        except OSError as e:
            s.close()
            raise self._bind_error(e) from e
        except BaseException:
            s.close()
            raise
        self._held = s
        self.port = s.getsockname()[1]

    def start(self) -> None:
        """Bind and serve; returns once the socket is listening. Raises ``BindError``."""
        if self._server is not None:
            return
        if self._held is not None:
            self._held.close()  # handed over: the server binds the same port at once
            self._held = None
        try:
            server, thread = self._serve()
        except OSError as e:
            raise self._bind_error(e) from e
        self._server, self._thread = server, thread
        self.port = server.server_port
        logger.info("serving Prometheus metrics at %s", self.url)

    @property
    def open_connections(self) -> int:
        """Connections being served now (each holds a thread)."""
        return self._server.open_connections if self._server is not None else 0

    def _tick(self) -> None:
        if self.health is not None:
            self.health.tick()

    def _serve(self) -> tuple[BoundedServer, threading.Thread]:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET

        class Handler(QuietHandler):
            timeout = self.idle_timeout_s

        server = BoundedServer(
            (self.host, self.port),
            Handler,
            family=family,
            max_connections=self.max_connections,
            deadline_s=self.connection_deadline_s,
            tick=self._tick,
        )
        server.set_app(probe_app(make_wsgi_app(self._registry), self.health))
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        return server, thread

    def _bind_error(self, e: OSError) -> BindError:
        where = f"{self.host}:{self.port}"
        if e.errno == errno.EADDRINUSE:
            return BindError(
                f"cannot bind metrics port {where}: address already in use",
                hint="choose another --metrics-port (0 means off) or stop the process using it",
            )
        return BindError(
            f"cannot bind metrics port {where}: {e.strerror or e}",
            hint="check --metrics-host names an address of this machine",
        )

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket; idempotent."""
        if self._held is not None:
            self._held.close()
            self._held = None
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.close_connections()  # their threads end now, not at their idle timeout
        if thread is not None:
            thread.join(timeout)

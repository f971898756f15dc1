"""The bench reads an endpoint's ``stats`` histograms through the one schema its producer
encodes (``kvpush.stats_schema``): a real telemetry store's snapshot, sent as JSON the way a
bench worker answers ``stats``, is read back by ``kvpush.commands.bench.probes.histogram`` to
the very histogram the telemetry holds; a reply that breaks the schema is refused."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvpush.commands.bench.probes import histogram
from kvpush.config import Role
from kvpush.stats_schema import HistSnapshot
from kvpush.telemetry import snapshot
from kvpush.telemetry.store import Telemetry


def test_the_telemetry_and_the_bench_share_one_histogram_type() -> None:
    assert snapshot.HistSnapshot is HistSnapshot


def test_a_stats_reply_reads_back_as_the_telemetrys_histogram() -> None:
    tel = Telemetry(Role.PREFILL, "p-1", "inc-1")
    tel.declare(histograms=["write_duration"])
    for x in (2e-5, 4e-5, 3e-3):
        tel.observe("write_duration", x)
    held = tel.snapshot().histograms["write_duration"]
    reply = json.loads(json.dumps(tel.snapshot().to_dict()))  # what the worker's line carries
    got = histogram(reply["histograms"]["write_duration"])
    assert got == held
    assert got.count == 3 and got.sum == pytest.approx(2e-5 + 4e-5 + 3e-3)
    assert isinstance(got.buckets[0], tuple) and got.buckets[-1][1] == 3  # cumulative (le, n)


def test_a_reply_that_breaks_the_schema_is_refused() -> None:
    raw: dict[str, object] = {"count": 1, "sum": 0.5, "p50": 0.5, "p90": 0.5, "p99": 0.5}
    with pytest.raises(msgspec.ValidationError, match="max"):
        histogram(raw)

"""The metric contract against live endpoints: docs/metrics.md, the Grafana dashboard and the
alert rules name exactly what a real P and D export.

One real P (TP 1) and one real D (TP 2, so the rank-level form and ``kvpush_rank_info`` are on
its page), both registered in a real etcd (the registry gauges), with ``drive`` pushing requests
through them (histograms, peer rows); then both ``/metrics`` pages are scraped and parsed with
``prometheus_client``'s parser. Checked: every metric of the contract's table is exported by P or
D with the type and labels the table gives, every exported metric is in the table (a row with
``<status>`` stands for a family of names that appear with their first transport error), and
every metric the dashboard's queries or the alert rules read is exported. The label values the
rules and panels match (``kind``, ``state``, ``role``, ``queue``) are kvpush's own, and the
data-path rule counts exactly the failure kinds /readyz counts. No Prometheus server here:
``make test-prom`` (tests/prometheus) runs the rules and the panels in a real one.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush.commands.common.ports import free_port
from kvpush.telemetry.names import OWN_FAILURES, QUEUE_GAUGES, Failure, PeerState
from tests.conftest import SMALL, run_cli
from tests.prometheus import contract
from tests.support.etcd import EtcdServer
from tests.support.procs import Launcher, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

POOL_STATES = {"free", "allocated", "inflight", "quarantined"}
#: ``kvpush_rank_info`` holds the facts that differ between the ranks on this host (``agent``
#: always; ``device`` where the ranks sit on different devices): its documented labels are the
#: ones that can appear, a superset of those on a CPU host.
HOST_DEPENDENT_LABELS = {"kvpush_rank_info"}


@dataclass(frozen=True)
class Exported:
    """What the live pages hold: by the name PromQL uses (a counter with ``_total``), its type
    and its own labels (beyond ``contract.BASE_LABELS``); and every sample name."""

    metrics: dict[str, tuple[str, frozenset[str]]]
    samples: frozenset[str]

    def knows(self, name: str) -> bool:
        return name in self.metrics or name in self.samples


def _page(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


def _exported(pages: list[str]) -> Exported:
    metrics: dict[str, tuple[str, set[str]]] = {}
    samples: set[str] = set()
    for text in pages:
        for fam in text_string_to_metric_families(text):
            name = f"{fam.name}_total" if fam.type == "counter" else fam.name
            typ, labels = metrics.setdefault(name, (fam.type, set()))
            assert typ == fam.type, f"{name}: {typ} on one page, {fam.type} on another"
            for s in fam.samples:
                samples.add(s.name)
                labels.update(set(s.labels) - contract.BASE_LABELS)
    return Exported({k: (t, frozenset(ls)) for k, (t, ls) in metrics.items()}, frozenset(samples))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    tmp = tmp_path_factory.mktemp("contract")
    etcd = EtcdServer(tmp / "etcd")
    etcd.start()
    launcher = Launcher(tmp)
    try:
        reg = ("--registry", etcd.url, "--cluster", "contract")
        p = launcher.serve("prefill", *SMALL, "--metrics-port", str(free_port()), *reg, wait=False)
        d = launcher.serve(
            "decode", *SMALL, "--tp", "2", "--metrics-port", str(free_port()), *reg, wait=False
        )
        wait_ready(p)
        wait_ready(d)
        r = run_cli("drive", "-p", p.address, "-d", d.address, "-n", "24", "-c", "4", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        yield _exported([_page(str(p.info["metrics"])), _page(str(d.info["metrics"]))])
    finally:
        launcher.close()
        etcd.stop()


def test_every_documented_metric_is_exported_with_its_type_and_labels(exported: Exported) -> None:
    rows = contract.doc_metrics()
    names = [r.name for r in rows]
    assert len(names) == len(set(names)), "a metric is listed twice in docs/metrics.md"
    problems = []
    for row in rows:
        if row.pattern is not None:
            continue  # a family of names that appear with their first error
        if row.name not in exported.metrics:
            problems.append(f"{row.name}: documented, not exported by P or D")
            continue
        typ, labels = exported.metrics[row.name]
        if typ != row.type:
            problems.append(f"{row.name}: documented as {row.type}, exported as {typ}")
        if row.name in HOST_DEPENDENT_LABELS:
            if not labels <= row.labels:
                problems.append(f"{row.name}: labels {sorted(labels - row.labels)} undocumented")
        elif labels != row.labels:
            problems.append(
                f"{row.name}: documented labels {sorted(row.labels)}, exported {sorted(labels)}"
            )
    assert not problems, "\n".join(problems)


def test_every_exported_metric_is_documented(exported: Exported) -> None:
    rows = contract.doc_metrics()
    plain = {r.name for r in rows if r.pattern is None}
    patterns = [p for r in rows if (p := r.pattern) is not None]
    missing = [
        name
        for name in sorted(exported.metrics)
        if name not in plain and not any(p.match(name) for p in patterns)
    ]
    assert not missing, f"exported but not in docs/metrics.md: {missing}"
    assert len(exported.metrics) >= 60, sorted(exported.metrics)  # the pages were read whole


def test_the_dashboard_reads_only_exported_metrics(exported: Exported) -> None:
    queries = contract.dashboard_queries()
    assert len(queries) >= 50
    problems = []
    for q in queries:
        names = contract.metric_names(q.expr)
        if not names:
            problems.append(f"{q.panel} [{q.ref}]: reads no kvpush metric: {q.expr}")
        problems += [
            f"{q.panel} [{q.ref}]: {n} is not exported" for n in sorted(names)
            if not exported.knows(n)
        ]  # fmt: skip
    for name, var in contract.dashboard_variables().items():
        query = var.get("query")
        if isinstance(query, dict):
            problems += [
                f"variable {name}: {n} is not exported"
                for n in contract.metric_names(str(query["query"]))
                if not exported.knows(n)
            ]
    assert not problems, "\n".join(problems)


def test_the_alert_rules_read_only_exported_metrics(exported: Exported) -> None:
    rules = contract.rules()
    names = [r.alert for r in rules]
    assert len(rules) >= 9 and len(names) == len(set(names)), names
    problems = []
    for rule in rules:
        assert "summary:" in rule.text and "runbook:" in rule.text, rule.alert
        reads = contract.metric_names(rule.text)
        if not reads:
            problems.append(f"{rule.alert}: reads no kvpush metric")
        problems += [f"{rule.alert}: {n} is not exported" for n in sorted(reads)
                     if not exported.knows(n)]  # fmt: skip
    assert not problems, "\n".join(problems)


def test_the_label_values_matched_are_kvpush_own() -> None:
    texts = [r.text for r in contract.rules()] + [q.expr for q in contract.dashboard_queries()]
    text = "\n".join(texts)
    kinds = {str(k) for k in Failure}
    assert contract.label_values(text, "kind") <= kinds, contract.label_values(text, "kind") - kinds
    states = POOL_STATES | {str(s) for s in PeerState}
    assert contract.label_values(text, "state") <= states
    assert contract.label_values(text, "role") <= {"prefill", "decode"}
    assert contract.label_values(text, "queue") <= {str(q) for q in QUEUE_GAUGES}


def test_the_data_path_rule_counts_what_readyz_counts() -> None:
    """KvpushDataPathFailing is the /readyz condition: the failure kinds it counts are exactly
    ``names.OWN_FAILURES`` (a kind reclassified in kvpush fails this until the rule follows)."""
    (rule,) = [r for r in contract.rules() if r.alert == "KvpushDataPathFailing"]
    assert contract.label_values(rule.text, "kind") == set(OWN_FAILURES)


def test_every_rule_has_unit_tests_that_fire_and_stay_quiet() -> None:
    """kvpush-alerts.test.yml has, for every rule, a case expecting an alert and one expecting
    none (promtool runs them: tests/prometheus)."""
    cases = contract.rule_test_cases()
    for rule in contract.rules():
        mine = [c for c in cases if c.alert == rule.alert]
        assert any(c.fires for c in mine), f"{rule.alert}: no case where it fires"
        assert any(not c.fires for c in mine), f"{rule.alert}: no case where it stays quiet"
    assert {c.alert for c in cases} == {r.alert for r in contract.rules()}

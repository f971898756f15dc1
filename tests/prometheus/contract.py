"""The observability artefacts read as data: the metric contract (docs/metrics.md), the Grafana
dashboard (deploy/grafana/kvpush.json) and the alert rules (deploy/prometheus/kvpush-alerts.yml),
for the tests that hold them to what kvpush exports (tests/component/test_metric_contract.py) and
to a real Prometheus (tests/prometheus/test_prometheus_real.py).

Pure functions over the files' text, no YAML library: the rules file is read for its alert
names, its expressions' metric names and label values, which plain patterns find (the real
Prometheus test checks the same names against what Prometheus itself loaded).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "kvpush-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvpush-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpush.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"

#: The one name the rules use that kvpush does not export: Prometheus's own per-target ``up``.
PROMETHEUS_OWN = frozenset({"up"})
#: Labels every kvpush series carries (``role``, ``engine_id``), a tensor-parallel rank's series
#: (``rank``) and a histogram's buckets (``le``): the contract's table lists the others.
BASE_LABELS = frozenset({"role", "engine_id", "rank", "le"})

_METRIC = re.compile(r"\bkvpush_[a-z0-9_]+\b")
_HIST_SUFFIX = re.compile(r"_(bucket|sum|count)$")


@dataclass(frozen=True)
class DocMetric:
    """One row of the contract's table: the name PromQL uses (a counter with ``_total``, a
    histogram without its ``_bucket``/``_sum``/``_count``), its type, its own labels."""

    name: str
    type: str
    labels: frozenset[str]

    @property
    def pattern(self) -> re.Pattern[str] | None:
        """A row for a family of names (``kvpush_transport_errors_<status>_total``)."""
        if "<" not in self.name:
            return None
        return re.compile("^" + re.sub(r"<[^>]+>", "[a-z0-9_]+", self.name) + "$")


def doc_metrics(text: str | None = None) -> list[DocMetric]:
    """The rows of docs/metrics.md's contract table: ``| `name` | type | `l1`, `l2` | ...``."""
    text = METRICS_DOC.read_text() if text is None else text
    rows: list[DocMetric] = []
    for line in text.splitlines():
        if not line.startswith("| `kvpush_"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = cells[0].strip("`")
        labels = frozenset(re.findall(r"`([a-z_]+)`", cells[2]))
        rows.append(DocMetric(name, cells[1], labels))
    return rows


def metric_names(expr: str) -> set[str]:
    """The kvpush metric names an expression reads (histogram series keep their suffix)."""
    return set(_METRIC.findall(expr))


def base_name(sample: str) -> str:
    """``kvpush_x_seconds_bucket`` -> ``kvpush_x_seconds`` (a histogram's series -> its name)."""
    return _HIST_SUFFIX.sub("", sample)


@dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str
    instant: bool


def dashboard() -> dict[str, object]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def dashboard_queries(dash: dict[str, object] | None = None) -> list[Query]:
    """Every query of every panel (rows' nested panels included)."""
    dash = dashboard() if dash is None else dash
    out: list[Query] = []

    def walk(panels: object) -> None:
        assert isinstance(panels, list)
        for p in panels:
            for t in p.get("targets", []):
                out.append(Query(p["title"], t["refId"], t["expr"], bool(t.get("instant"))))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def dashboard_variables(dash: dict[str, object] | None = None) -> dict[str, dict[str, object]]:
    dash = dashboard() if dash is None else dash
    templating = dash["templating"]
    assert isinstance(templating, dict)
    return {v["name"]: v for v in templating["list"]}


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variables replaced as it would send the query (``values`` maps a name without
    ``$`` to its text); longest names first, so ``$__rate_interval`` is not read as ``$__r...``."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", values[name]).replace(f"${name}", values[name])
    return expr


_REGEX_SPECIAL = re.compile(r"([$^*{}\[\]'+?.()|\\])")


def grafana_regex(values: list[str]) -> str:
    """A multi-value variable in a ``=~`` matcher, as Grafana's Prometheus data source formats
    it: ``(a|b)``, each regex character escaped with a doubled backslash (one is the PromQL
    string's own escape): ``127.0.0.1:9400`` -> ``127\\\\.0\\\\.0\\\\.1:9400``."""
    return "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\\\1", v) for v in values) + ")"


@dataclass(frozen=True)
class Rule:
    alert: str
    text: str  # the rule's block in the file: its expression, for, labels and annotations


def rules(text: str | None = None) -> list[Rule]:
    """The alert rules of kvpush-alerts.yml, each with its block of the file."""
    text = RULES.read_text() if text is None else text
    parts = re.split(r"^\s*- alert:\s*", text, flags=re.M)[1:]
    out = []
    for part in parts:
        name, _, rest = part.partition("\n")
        block = re.split(r"^\s*#", rest, maxsplit=1, flags=re.M)[0]  # up to the next comment
        out.append(Rule(name.strip(), block))
    return out


def label_values(text: str, label: str) -> set[str]:
    """Every value a ``label="v"`` or ``label=~"a|b"`` matcher in ``text`` names."""
    out: set[str] = set()
    for m in re.finditer(rf'\b{label}\s*=~?\s*"([^"]*)"', text):
        out.update(v for v in m.group(1).split("|") if v)
    return out


def shorten_for(text: str, duration: str) -> str:
    """The rules with every ``for:`` set to ``duration`` (a test copy: watch them fire quickly)."""
    return re.sub(r"^(\s+for:\s*)\S+\s*$", rf"\g<1>{duration}", text, flags=re.M)


@dataclass(frozen=True)
class RuleCase:
    alert: str
    eval_time: str
    fires: bool  # at least one alert expected (else ``exp_alerts: []``)


def rule_test_cases(text: str | None = None) -> list[RuleCase]:
    """The ``alert_rule_test`` cases of kvpush-alerts.test.yml (eval time, name, and whether it
    expects an alert)."""
    text = RULE_TESTS.read_text() if text is None else text
    out = []
    pat = re.compile(
        r"- eval_time:\s*(\S+)\s*\n\s*alertname:\s*(\S+)\s*\n\s*exp_alerts:\s*(\[\])?", re.M
    )
    for m in pat.finditer(text):
        out.append(RuleCase(m.group(2), m.group(1), m.group(3) is None))
    return out

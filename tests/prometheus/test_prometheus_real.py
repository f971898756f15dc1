"""The alert rules and the Grafana dashboard against a real Prometheus (marker ``prometheus``;
``make test-prom`` installs Debian's package and runs this suite; ``make test`` deselects it).

- ``promtool check rules`` accepts deploy/prometheus/kvpush-alerts.yml, ``promtool test rules``
  passes its unit tests, and those tests fail when a rule is wrong (a rule copy that counts a
  peer's failure kind as the endpoint's own).
- A real Prometheus (1 s scrapes and evaluations) scrapes a real P and D, registered in a real
  etcd, while ``drive`` pushes through them. It loads a copy of the rules whose ``for:`` is
  shortened to 1 s (the production file's durations are minutes; nothing else changes): every
  rule is loaded healthy with its summary and runbook; no kvpush alert is pending or firing under
  healthy load; the dashboard's variables find the cluster and both endpoints; every query of
  every panel, with the variables substituted as Grafana sends them, returns at least one finite
  sample. Then P is SIGKILLed while drive keeps going (it holds requests for P, --peer-grace) and
  a router-like client keeps naming P to D: KvpushEndpointDown fires for P's target and
  KvpushPeerUnreachable on D for P's address, while D's KvpushDataPathFailing stays quiet (a dead
  P is a peer's failure, not D's: /readyz's design). A new P on the same addresses clears both,
  every rule is still healthy, and pushes resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.commands.common.ports import free_port
from kvpush.wire import protocol
from tests.conftest import SMALL
from tests.prometheus import contract
from tests.prometheus.promserver import PrometheusServer, binaries, config_text
from tests.support import side
from tests.support.etcd import EtcdServer
from tests.support.procs import KVPUSH, Launcher, Proc, clean_env, wait_ready
from tests.support.waits import wait_for

pytestmark = [pytest.mark.prometheus, pytest.mark.integration]

CLUSTER = "kvpush-test"
#: Grafana's interval variables, as a dashboard over the last few minutes at 1 s scrapes has them.
INTERVALS = {"__rate_interval": "10s", "__range": "5m", "__interval": "1s"}


@pytest.fixture(scope="module")
def tools() -> tuple[str, str]:
    prom, tool = binaries()
    if prom is None or tool is None:
        why = (
            "Debian's prometheus package is missing (no prometheus or promtool): "
            "make test-prom installs it (scripts/prometheus-setup.sh)"
        )
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return prom, tool


def promtool(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(90)
def test_promtool_checks_the_rules(tools: tuple[str, str]) -> None:
    r = promtool(tools[1], "check", "rules", str(contract.RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(contract.rules())} rules found" in r.stdout, r.stdout


@pytest.mark.timeout(90)
def test_promtool_runs_the_rule_unit_tests(tools: tuple[str, str]) -> None:
    r = promtool(tools[1], "test", "rules", str(contract.RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout, r.stdout


@pytest.mark.timeout(90)
def test_the_rule_unit_tests_fail_on_a_wrong_rule(tools: tuple[str, str], tmp_path: Path) -> None:
    """The unit tests can fail: a copy of the rules that counts ``deadline`` (a peer's failure)
    against the endpoint's own data path fails them, naming the rule."""
    own = 'kind=~"callback_error|'
    text = contract.RULES.read_text()
    assert own in text
    wrong = text.replace(own, 'kind=~"deadline|callback_error|')
    (tmp_path / contract.RULES.name).write_text(wrong)
    tests = tmp_path / contract.RULE_TESTS.name
    tests.write_text(contract.RULE_TESTS.read_text())
    r = promtool(tools[1], "test", "rules", str(tests))
    assert r.returncode != 0, r.stdout
    assert "alertname: KvpushDataPathFailing" in r.stdout + r.stderr


# ---------------------------------------------------------------------- the live check
class Stack:
    """etcd, P, D, Prometheus and drive of the live test; ``close`` stops what is running."""

    def __init__(self, tmp: Path, prometheus_exe: str) -> None:
        self.tmp = tmp
        self.exe = prometheus_exe
        self.etcd = EtcdServer(tmp / "etcd")
        self.launcher = Launcher(tmp)
        self.p_port, self.p_metrics, self.d_metrics = free_port(), free_port(), free_port()
        self.targets = [f"127.0.0.1:{self.p_metrics}", f"127.0.0.1:{self.d_metrics}"]
        self.server: PrometheusServer | None = None
        self.drive: subprocess.Popen[bytes] | None = None
        self.p: Proc | None = None
        self.d: Proc | None = None

    def p_args(self) -> list[str]:
        reg = ["--registry", self.etcd.url, "--cluster", CLUSTER]
        return [*SMALL, "--port", str(self.p_port), "--metrics-port", str(self.p_metrics), *reg]

    def start(self) -> PrometheusServer:
        self.etcd.start()
        reg = ["--registry", self.etcd.url, "--cluster", CLUSTER]
        self.p = self.launcher.serve("prefill", *self.p_args(), wait=False)
        self.d = self.launcher.serve(
            "decode", *SMALL, "--metrics-port", str(self.d_metrics), *reg, wait=False
        )
        wait_ready(self.p)
        wait_ready(self.d)
        rules = self.tmp / "kvpush-alerts.yml"
        rules.write_text(contract.shorten_for(contract.RULES.read_text(), "1s"))
        config = self.tmp / "prometheus.yml"
        config.write_text(config_text(self.targets, rules, CLUSTER))
        self.server = PrometheusServer(
            self.exe, config, self.tmp / "tsdb", self.tmp / "prometheus.log"
        )
        self.server.start()
        # drive keeps pushing for the whole test: --peer-grace holds its requests while P is
        # down (instead of failing them all at once) and it takes P back when P serves again.
        cmd = [
            *KVPUSH, "drive", "-p", self.p.address, "-d", self.d.address, "-n", "20000",
            "-c", "4", "--rate", "40", "--peer-grace", "600", "--json",
        ]  # fmt: skip
        with (self.tmp / "drive.out").open("wb") as out, (self.tmp / "drive.err").open("wb") as err:
            self.drive = subprocess.Popen(cmd, stdout=out, stderr=err, env=clean_env())
        return self.server

    def drive_log(self) -> str:
        return (self.tmp / "drive.err").read_text(errors="replace")[-3000:]

    def close(self) -> None:
        try:
            if self.drive is not None and self.drive.poll() is None:
                self.drive.send_signal(signal.SIGINT)
                try:
                    self.drive.wait(60)
                except subprocess.TimeoutExpired:
                    self.drive.kill()
                    self.drive.wait(10)
        finally:
            try:
                if self.server is not None:
                    self.server.stop()
            finally:
                try:
                    self.launcher.close()
                finally:
                    self.etcd.stop()


@pytest.fixture
def stack(tools: tuple[str, str], tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path, tools[0])
    try:
        yield s
    finally:
        s.close()


def kvpush_alerts(server: PrometheusServer) -> list[dict[str, Any]]:
    """kvpush's alerts, pending or firing."""
    return [a for a in server.alerts() if str(a["labels"]["alertname"]).startswith("Kvpush")]


def firing(server: PrometheusServer, alertname: str, **labels: str) -> bool:
    return any(
        a["state"] == "firing"
        and a["labels"]["alertname"] == alertname
        and all(a["labels"].get(k) == v for k, v in labels.items())
        for a in server.alerts()
    )


def active(server: PrometheusServer, alertname: str, **labels: str) -> bool:
    """Pending or firing."""
    return any(
        a["labels"]["alertname"] == alertname
        and all(a["labels"].get(k) == v for k, v in labels.items())
        for a in server.alerts()
    )


def check_rules_loaded(server: PrometheusServer) -> None:
    """Every rule of the file loaded, evaluated and healthy, with its summary and runbook."""
    names = {r.alert for r in contract.rules()}

    def healthy() -> list[dict[str, Any]] | None:
        rules = server.rules()
        done = {r["name"] for r in rules if r["health"] == "ok"}
        return rules if done == names else None

    rules = wait_for(healthy, 30, f"every rule evaluated healthy: {server.rules()}", 0.5)
    assert {r["name"] for r in rules} == names
    for r in rules:
        assert r["type"] == "alerting", r
        assert r["annotations"].get("summary") and r["annotations"].get("runbook"), r
        assert r["duration"] == 1, r  # the test copy's shortened for:
        assert not r.get("lastError"), r


def check_variables(server: PrometheusServer, targets: list[str]) -> dict[str, str]:
    """The dashboard's variables as Grafana resolves them (label_values over kvpush_info)."""
    variables = contract.dashboard_variables()
    assert set(variables) == {"datasource", "cluster", "endpoint"}
    assert variables["datasource"]["query"] == "prometheus"
    clusters = server.api("label/cluster/values", **{"match[]": "kvpush_info"})
    assert clusters == [CLUSTER], clusters
    match = f'kvpush_info{{cluster=~"{contract.grafana_regex([CLUSTER])}"}}'
    instances = server.api("label/instance/values", **{"match[]": match})
    assert sorted(instances) == sorted(targets), instances
    return {
        "cluster": contract.grafana_regex([CLUSTER]),
        "endpoint": contract.grafana_regex(targets),
        "datasource": "prometheus",
        **INTERVALS,
    }


def check_panels(server: PrometheusServer, values: dict[str, str]) -> None:
    """Every query of every panel answers at least one finite sample (retried while the series
    fill: a rate needs two scrapes, a histogram its first observations)."""
    queries = contract.dashboard_queries()
    left = {(q.panel, q.ref): contract.substitute(q.expr, values) for q in queries}
    assert not any("$" in e for e in left.values()), [e for e in left.values() if "$" in e]
    deadline = time.monotonic() + 90
    while left and time.monotonic() < deadline:
        left = {k: e for k, e in left.items() if not server.finite(e)}
        if left:
            time.sleep(2)
    assert not left, "panels without data:\n" + "\n".join(f"{k}: {e}" for k, e in left.items())


def name_dead_p(d: Proc, p_address: str, n: int) -> None:
    """What a router that has not noticed does: one decode request naming P, sent to D."""
    host, port = p_address.rsplit(":", 1)
    req = protocol.DecodeReq(
        transfer_id=f"names-dead-p-{n}",
        prefill_host=host,
        prefill_port=int(port),
        num_blocks=2,
        deadline_s=2.0,
    )
    side.request(d.address, req, timeout_s=15)


@pytest.mark.timeout(480)
def test_dashboard_and_alerts_in_a_real_prometheus(stack: Stack) -> None:
    server = stack.start()
    p, d = stack.p, stack.d
    assert p is not None and d is not None and stack.drive is not None
    p_target, d_target = stack.targets
    wait_for(
        lambda: server.finite("sum(rate(kvpush_pushes_ok_total[5s])) > 0"),
        90,
        f"Prometheus sees pushes\n{stack.drive_log()}",
        1.0,
    )
    check_rules_loaded(server)
    values = check_variables(server, stack.targets)
    check_panels(server, values)
    assert kvpush_alerts(server) == [], "an alert under healthy load"

    # P dies under load. drive holds its requests for P; a router-like client keeps naming it.
    p.kill()
    sent = [0]

    def fired() -> bool:
        sent[0] += 1
        name_dead_p(d, p.address, sent[0])
        return firing(server, "KvpushEndpointDown", instance=p_target) and firing(
            server, "KvpushPeerUnreachable", instance=d_target, peer=p.address
        )

    wait_for(fired, 90, f"P's alerts firing: {kvpush_alerts(server)}", 1.0)
    assert not active(server, "KvpushDataPathFailing", instance=d_target), kvpush_alerts(server)
    assert stack.drive.poll() is None, stack.drive_log()

    # A new P on the same addresses: the alerts clear and pushes resume.
    stack.p = stack.launcher.serve("prefill", *stack.p_args())

    def cleared() -> bool:
        return not active(server, "KvpushEndpointDown", instance=p_target) and not active(
            server, "KvpushPeerUnreachable", instance=d_target, peer=p.address
        )

    wait_for(cleared, 120, f"P's alerts clear: {kvpush_alerts(server)}\n{stack.drive_log()}", 1.0)
    new_pushes = f'sum(rate(kvpush_pushes_ok_total{{instance="{p_target}"}}[5s])) > 0'
    wait_for(
        lambda: server.finite(new_pushes),
        60,
        f"pushes through the new P\n{stack.drive_log()}",
        1.0,
    )
    check_rules_loaded(server)  # still healthy with P's old series beside the new ones
    assert stack.drive.poll() is None, stack.drive_log()

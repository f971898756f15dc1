"""A real Prometheus server for the tests: Debian's ``prometheus`` binary, started on a free
loopback port with a temporary configuration and TSDB directory, read through its HTTP API
(``/api/v1/query``, ``/api/v1/rules``, ``/api/v1/alerts``, ``/api/v1/label/.../values``).

``scripts/prometheus-setup.sh`` installs the package (``make test-prom`` runs it). The binaries
are found on PATH or in /usr/bin; ``binaries()`` says which is missing. The server is stopped
(SIGTERM, then SIGKILL) by ``stop``; its log is ``log_text()``. Runs on the test's thread.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.commands.common.ports import free_port
from tests.support.waits import wait_for


def binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    path = Path("/usr/bin") / name
    return str(path) if path.exists() else None


def binaries() -> tuple[str | None, str | None]:
    """``(prometheus, promtool)``, each None where missing."""
    return binary("prometheus"), binary("promtool")


def config_text(targets: list[str], rule_file: Path, cluster: str) -> str:
    """A configuration that scrapes ``targets`` every second, evaluates rules every second, and
    labels every target with ``cluster`` (what an operator's scrape job does)."""
    quoted = ", ".join(f'"{t}"' for t in targets)
    return (
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n"
        f'rule_files: ["{rule_file}"]\n'
        "scrape_configs:\n"
        "  - job_name: kvpush\n"
        "    static_configs:\n"
        f"      - targets: [{quoted}]\n"
        f'        labels: {{cluster: "{cluster}"}}\n'
    )


@dataclass
class PrometheusServer:
    exe: str
    config: Path
    data_dir: Path
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.exe,
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.data_dir}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=info",
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        wait_for(self._ready, timeout_s, f"prometheus ready at {self.url}\n{self.log_text()}", 0.2)

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def api(self, path: str, **params: str) -> Any:
        """``/api/v1/PATH`` with ``params``: its ``data`` (an error status fails the test)."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.loads(r.read().decode())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (a scalar answer as one sample without labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def finite(self, expr: str) -> list[dict[str, Any]]:
        """The samples of ``expr`` with a finite value (NaN is what Grafana shows as a gap)."""
        return [s for s in self.query(expr) if math.isfinite(float(s["value"][1]))]

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self.api("rules")["groups"] for r in g["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

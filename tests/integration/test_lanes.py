"""Which lane carries the KV, from UCX's own report, with real endpoints and real NIXL (issue 26).

Two Ds on this host: one started with ``UCX_TLS=tcp`` (UCX may use nothing but TCP), one with the
default transports (shared memory between two processes of one host). ``probe --lanes`` pushes
verified blocks into each from a tiny P of its own and names the lane UCX chose: ``tcp`` (flagged
``tcp_on_one_host``) for the first, a shared-memory transport for the second. A ``serve-prefill``
with lanes on (the default) and ``-o json`` keeps its stdout to JSON lines (UCX's tables go to a
file, never to stdout), and after pushes into both Ds its peer rows -- JSON lines, ``/metrics``,
the stats reply -- name both lanes. ``probe --lanes`` of that P reads P's own view of the lane into
a tiny D of the probe's. A vLLM peer (here a kvpush D on vLLM's wire) is refused before anything
but the safe probe is sent, and stays up.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.commands.common import launch as _launch
from kvpush.commands.common import ports
from tests.conftest import SMALL, run_cli
from tests.support.procs import Launcher, Proc, clean_env, serve_cmd, wait_ready
from tests.support.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

SHARED_MEMORY = {"cma", "posix", "sysv", "xpmem", "knem"}
COMPAT = "0123456789abcdef" * 4


class _Lines:
    """A child's stdout, read line by line on a thread (a full pipe would stop its writer)."""

    def __init__(self, proc: Proc) -> None:
        self.lines: list[str] = []
        assert proc.popen.stdout is not None
        self._out = proc.popen.stdout
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for raw in self._out:
            self.lines.append(raw.decode(errors="replace"))

    def last_json(self) -> dict[str, Any]:
        return json.loads(self.lines[-1]) if self.lines else {}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("lanes")
    f = Launcher(tmp)
    try:
        d_shm = f.serve("decode", *SMALL, wait=False)
        d_tcp = f.serve("decode", *SMALL, wait=False, env=clean_env(UCX_TLS="tcp"))
        metrics = ports.free_port()
        ready = tmp / "p.ready"
        cmd = serve_cmd("prefill", ready, *SMALL, "--metrics-port", str(metrics))
        popen = _launch.spawn(cmd, tmp / "p.log", clean_env(), piped=True)
        p = Proc(popen, "", "", "", tmp / "p.log", role="prefill", ready_file=ready)
        f.procs.append(p)
        lines = _Lines(p)
        for proc in (d_shm, d_tcp, p):
            wait_ready(proc)
        yield {"p": p, "d_shm": d_shm, "d_tcp": d_tcp, "lines": lines, "metrics": metrics}
    finally:
        f.close()


def _probe_lanes(address: str) -> dict[str, Any]:
    r = run_cli("probe", "--lanes", address, "--timeout", "10", "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    report: dict[str, Any] = json.loads(r.stdout)  # stdout is exactly one JSON object
    assert report["lanes"], report
    return report


def test_probe_names_tcp_for_a_tcp_only_d_and_flags_it(fleet: dict[str, Any]) -> None:
    report = _probe_lanes(fleet["d_tcp"].address)
    (row,) = report["lanes"]
    lane = row["lane"]
    assert lane["evidence"] == "ucx proto info", lane
    assert lane["write"] == ["tcp"], lane
    assert lane["locality"] == "intra-node"
    assert "tcp_on_one_host" in row["lane_flags"]
    assert lane["descs_per_push"] > 0 and lane["post_us_per_desc"] > 0


def test_probe_names_shared_memory_for_a_default_d(fleet: dict[str, Any]) -> None:
    report = _probe_lanes(fleet["d_shm"].address)
    (row,) = report["lanes"]
    lane = row["lane"]
    assert lane["evidence"] == "ucx proto info", lane
    assert set(lane["write"]) & SHARED_MEMORY, lane
    assert "tcp" not in lane["write"]
    assert "tcp_on_one_host" not in row["lane_flags"]


def test_probe_text_names_the_lane_and_the_flag(fleet: dict[str, Any]) -> None:
    r = run_cli("probe", "--lanes", fleet["d_tcp"].address, "--timeout", "10", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "write lane" in r.stdout and "tcp on lo" in r.stdout
    assert "tcp_on_one_host" in r.stdout


def test_probe_of_a_p_reads_ps_own_view_of_the_lane(serve: Launcher) -> None:
    # A P of its own: one that already knows a tcp and a shared-memory configuration on this
    # host cannot tell which of them a D that reuses one got ("ambiguous: cfg#1|cfg#2").
    p = serve.serve("prefill", *SMALL)
    report = _probe_lanes(p.address)
    (row,) = report["lanes"]
    assert row["writer"].startswith("the peer P")
    assert row["lane"]["evidence"] == "ucx proto info", row
    assert set(row["lane"]["write"]) & SHARED_MEMORY


def _drive(p: Proc, d: Proc) -> None:
    r = run_cli("drive", "-p", p.address, "-d", d.address, "-n", "4", "--blocks", "2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr


def _lane_rows(peers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(r["peer"]): r for r in peers if isinstance(r.get("lane"), dict)}


def test_serve_prefill_shows_both_lanes_and_stdout_stays_json(fleet: dict[str, Any]) -> None:
    p, d_shm, d_tcp, lines = fleet["p"], fleet["d_shm"], fleet["d_tcp"], fleet["lines"]
    _drive(p, d_shm)
    _drive(p, d_tcp)

    def both() -> dict[str, dict[str, Any]] | None:
        rows = _lane_rows(lines.last_json().get("peers", []))
        return rows if {d_shm.address, d_tcp.address} <= rows.keys() else None

    rows = wait_for(both, 30, "P's JSON line with both Ds' lanes")
    assert rows[d_tcp.address]["lane"]["write"] == ["tcp"]
    assert "tcp_on_one_host" in rows[d_tcp.address]["lane_flags"]
    assert set(rows[d_shm.address]["lane"]["write"]) & SHARED_MEMORY
    for line in list(lines.lines):  # every line of stdout is one JSON object: no UCX table
        json.loads(line)
    assert "cfg#" not in p.log_text()  # nor on stderr: the tables stay in UCX's file

    with urllib.request.urlopen(f"http://127.0.0.1:{fleet['metrics']}/metrics", timeout=10) as r:
        page = r.read().decode()
    info = [ln for ln in page.splitlines() if ln.startswith("kvpush_peer_lane_info{")]
    assert any(f'peer="{d_tcp.address}"' in ln and 'write="tcp"' in ln for ln in info), info
    assert any(f'peer="{d_shm.address}"' in ln and 'write="tcp"' not in ln for ln in info), info

    stats = run_cli("probe", p.address, "--stats", "--json")
    assert stats.returncode == 0, stats.stderr
    reply = _lane_rows(json.loads(stats.stdout)["stats"]["peers"])
    assert reply[d_tcp.address]["lane"]["write"] == ["tcp"]


def test_a_vllm_peer_is_refused_and_stays_up(tmp_path: Path, serve: Launcher) -> None:
    v = serve.serve("decode", *SMALL, "--wire", "vllm", "--compat-hash", COMPAT)
    r = run_cli("probe", "--lanes", v.address, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "kvpush cannot start a vLLM engine's push" in r.stderr
    again = run_cli("probe", v.address)  # its listener still answers
    assert again.returncode == 0, again.stdout + again.stderr
    assert v.popen.poll() is None

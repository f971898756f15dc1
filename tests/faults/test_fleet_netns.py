"""The fleet across "hosts": P and two Ds in three network namespaces, etcd on a fourth address,
and the link between P and one D cut while everyone still reaches etcd. ``netns``, ``slow``.

Topology (root only; everything here is removed in ``finally``)::

    host: bridge kvfb<tag> 10.203.x.1/24 -- etcd listens there, the fleet commands run there
      ns P  (10.203.x.2) --veth-- bridge          ns P  10.204.x.1/30 --veth-- 10.204.x.2/30 ns D1
      ns D1 (10.203.x.3) --veth-- bridge
      ns D2 (10.203.x.4) --veth-- bridge

Each endpoint binds its bridge address (``serve-* --host 10.203.x.N --registry http://10.203.x.1:
PORT``). P and D1 reach each other only over their own veth pair (a /32 route to the other's
bridge address through it), so setting that pair down cuts exactly the P <-> D1 path: P, D1 and
D2 still reach etcd (and the host reaches all three), P <-> D2 still works. The Ds run under
``unshare --pid --ipc`` so UCX cannot use shared memory or CMA with P: the KV crosses the network.

Checks: ``fleet ls`` shows the three with their real (namespace) addresses; ``fleet check``
passes both pairs with the link up; with it down it names P -> D1 as failed with a reason while
P -> D2 passes and all three are still registered (exit 3); with the link back up both pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMALL, run_cli
from tests.support.etcd import EtcdServer
from tests.support.marks import skip_unless_marker_selected
from tests.support.netns import netns_unavailable
from tests.support.procs import ROOT, clean_env

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.netns]

CLUSTER = "netns"


@pytest.fixture(autouse=True)
def _only_when_selected(request: pytest.FixtureRequest) -> None:
    skip_unless_marker_selected(request, "slow")
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"netns test not permitted here: {why}")


def sh(*args: str) -> None:
    r = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, (args, r.stderr)


class Topology:
    def __init__(self) -> None:
        self.tag = f"{os.getpid() % 1000}{secrets.token_hex(1)}"
        self.x = 10 + (os.getpid() + secrets.randbelow(200)) % 240  # third octet
        self.br = f"kvfb{self.tag}"
        self.ns = {n: f"kvf{n}{self.tag}" for n in ("p", "d1", "d2")}
        self.ip = {"host": f"10.203.{self.x}.1", "p": f"10.203.{self.x}.2",
                   "d1": f"10.203.{self.x}.3", "d2": f"10.203.{self.x}.4"}  # fmt: skip
        self.cut_dev = f"kvfc{self.tag}"  # P's end of the P <-> D1 pair

    def create(self) -> None:
        sh("ip", "link", "add", self.br, "type", "bridge")
        sh("ip", "addr", "add", f"{self.ip['host']}/24", "dev", self.br)
        sh("ip", "link", "set", self.br, "up")
        for i, (n, ns) in enumerate(self.ns.items()):
            sh("ip", "netns", "add", ns)
            host_end, ns_end = f"kvfh{self.tag}{i}", f"kvfn{self.tag}{i}"
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            sh("ip", "link", "set", host_end, "master", self.br, "up")
            sh("ip", "link", "set", ns_end, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{self.ip[n]}/24", "dev", ns_end)
            sh("ip", "-n", ns, "link", "set", ns_end, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        # The P <-> D1 pair: their only path to each other.
        d1_end = f"kvfd{self.tag}"
        sh("ip", "link", "add", self.cut_dev, "type", "veth", "peer", "name", d1_end)
        sh("ip", "link", "set", self.cut_dev, "netns", self.ns["p"])
        sh("ip", "link", "set", d1_end, "netns", self.ns["d1"])
        for ns, dev, me, other in (
            (self.ns["p"], self.cut_dev, "1", self.ip["d1"]),
            (self.ns["d1"], d1_end, "2", self.ip["p"]),
        ):
            sh("ip", "-n", ns, "addr", "add", f"10.204.{self.x}.{me}/30", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "route", "add", f"{other}/32", "dev", dev)

    def link(self, up: bool) -> None:
        sh("ip", "-n", self.ns["p"], "link", "set", self.cut_dev, "up" if up else "down")

    def destroy(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.br], capture_output=True, timeout=30)


class NsServe:
    """``kvpush serve-ROLE`` inside a namespace (a D under ``unshare --pid --ipc``)."""

    def __init__(self, topo: Topology, name: str, role: str, etcd: EtcdServer, tmp: Path) -> None:
        self.ready = tmp / f"{name}.ready.json"
        self.log = tmp / f"{name}.log"
        cmd = ["ip", "netns", "exec", topo.ns[name]]
        if role == "decode":
            cmd += ["unshare", "--pid", "--ipc", "--mount", "--fork", "--mount-proc"]
        cmd += [sys.executable, "-m", "kvpush", f"serve-{role}", "--host", topo.ip[name],
                "--port", "0", "--ready-file", str(self.ready), "-o", "json", "--interval", "5",
                *SMALL, "--registry", etcd.url, "--cluster", CLUSTER]  # fmt: skip
        with open(self.log, "ab") as f:
            self.popen = subprocess.Popen(
                cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=clean_env(),
                start_new_session=True,
            )  # fmt: skip
        self.info: dict[str, Any] = {}

    def wait(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            assert self.popen.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)
        self.info = json.loads(self.ready.read_text())
        return self.info

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


def check(etcd: EtcdServer) -> tuple[int, dict[str, Any], str]:
    args = ("--registry", etcd.url, "--cluster", CLUSTER, "--size", "64KiB", "--deadline", "8")
    r = run_cli("fleet", "check", "--json", *args, timeout=120)
    return r.returncode, json.loads(r.stdout), r.stderr


@pytest.mark.timeout(400)
def test_fleet_across_namespaces_names_the_cut_pair(tmp_path: Path) -> None:
    topo = Topology()
    procs: list[NsServe] = []
    etcd: EtcdServer | None = None
    try:
        topo.create()
        etcd = EtcdServer(tmp_path / "etcd", host=topo.ip["host"]).start()
        for name, role in (("p", "prefill"), ("d1", "decode"), ("d2", "decode")):
            procs.append(NsServe(topo, name, role, etcd, tmp_path))
        p, d1, d2 = (x.wait()["address"] for x in procs)
        assert p.startswith(topo.ip["p"] + ":") and d1.startswith(topo.ip["d1"] + ":")

        # fleet ls from the host: the three, at their namespace addresses.
        deadline = time.monotonic() + 30
        while True:
            r = run_cli("fleet", "ls", "--json", "--registry", etcd.url, "--cluster", CLUSTER)
            assert r.returncode == 0, r.stderr
            eps = {e["address"]: e for e in json.loads(r.stdout)["endpoints"]}
            if set(eps) == {p, d1, d2} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert set(eps) == {p, d1, d2}, eps
        assert (eps[p]["role"], eps[d1]["role"], eps[d2]["role"]) == ("prefill", "decode", "decode")

        rc, rep, err = check(etcd)
        assert rc == 0, (rep, err)
        assert [x["outcome"] for x in rep["pairs"]] == ["ok", "ok"], rep

        # Cut P <-> D1: both still reach etcd (and stay registered), P <-> D2 still works.
        topo.link(up=False)
        rc, rep, err = check(etcd)
        pairs = {x["decode"]: x for x in rep["pairs"]}
        assert rc == 3, (rep, err)
        assert pairs[d2]["outcome"] == "ok", pairs[d2]
        assert pairs[d1]["outcome"] == "failed" and pairs[d1]["reason"], pairs[d1]
        assert d1 in pairs[d1]["detail"] or p in pairs[d1]["detail"], pairs[d1]  # who said it
        assert pairs[d1]["prefill"] == p
        r = run_cli("fleet", "ls", "--json", "--registry", etcd.url, "--cluster", CLUSTER)
        assert {e["address"] for e in json.loads(r.stdout)["endpoints"]} == {p, d1, d2}
        r = run_cli("fleet", "check", "--registry", etcd.url, "--cluster", CLUSTER,
                    "--size", "64KiB", "--deadline", "8", timeout=120)  # fmt: skip
        assert f"FAILED {p} -> {d1}: {pairs[d1]['reason']}" in r.stdout, r.stdout

        # The link back: the whole matrix passes again (D1 may need a moment to let go).
        topo.link(up=True)
        deadline = time.monotonic() + 60
        while True:
            rc, rep, err = check(etcd)
            if rc == 0 or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert rc == 0, (rep, err)
    finally:
        for x in procs:
            x.kill()
        if etcd is not None:
            etcd.kill()
        topo.destroy()

"""The peer table tells the truth: a peer whose process is gone leaves it (or reads ``down``)
within seconds, not at ``--peer-idle-ttl``; a connection that serves no data path has no row.
Real P and D processes on 127.0.0.1, read through ``probe --stats``' request and Prometheus."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import SMALL, run_cli
from tests.support.procs import Launcher
from tests.support.side import snapshot
from tests.support.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _drive(p: str, *ds: str, n: int = 8) -> None:
    args = [a for d in ds for a in ("-d", d)]
    r = run_cli("drive", "-p", p, *args, "-n", str(n), "-c", "2", "--blocks", "2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr


def _rows(address: str) -> list[tuple[str, str]]:
    """(peer, state) of each row of ``address``'s peer table (every rank's)."""
    return sorted((str(r["peer"]), str(r["state"])) for r in snapshot(address)["peers"])


def test_a_d_rank_keeps_no_row_for_ps_rank_0_it_only_asked_for_ps_tp(serve: Launcher) -> None:
    p = serve.serve("prefill", *SMALL, "--tp", "2")
    d = serve.serve("decode", *SMALL, "--tp", "2")
    _drive(p.address, d.address)
    snap = snapshot(d.address)
    rows = sorted((r["rank"], r["peer"], r["state"]) for r in snap["peers"])
    # D rank 0 draws from P rank 0, D rank 1 from P rank 1: two rows, both connected.
    assert rows == [(0, p.address, "connected"), (1, f"{p.address} rank 1", "connected")], rows


@pytest.mark.slow
def test_dead_peers_leave_the_tables_at_once(serve: Launcher, free_port: int) -> None:
    p = serve.serve("prefill", *SMALL, "--metrics-port", str(free_port))
    d1 = serve.serve("decode", *SMALL)
    d2 = serve.serve("decode", *SMALL)
    _drive(p.address, d1.address, d2.address)
    assert _rows(p.address) == sorted([(d1.address, "connected"), (d2.address, "connected")])
    assert _rows(d1.address) == [(p.address, "connected")]

    t0 = time.monotonic()
    d2.kill()  # SIGKILL: no goodbye; P pushes nothing more to it
    wait_for(lambda: _rows(p.address) == [(d1.address, "connected")], 10, "D2's row gone from P")
    gone_after = time.monotonic() - t0
    assert gone_after < 8, gone_after  # --peer-idle-ttl is 600 s
    metrics = run_cli("probe", p.address, "--stats", "--json")
    assert metrics.returncode == 0
    assert d2.address not in json.dumps(json.loads(metrics.stdout)["stats"]["peers"])
    import urllib.request

    page = urllib.request.urlopen(str(p.info["metrics"]), timeout=5).read().decode()
    assert d2.address not in page and f'peer="{d1.address}",peer_rank="0"' in page

    # P dies while D1 waits for nothing (no heartbeat to fail): D1's row goes too.
    p.kill()
    wait_for(lambda: _rows(d1.address) == [], 10, "P's row gone from D1")

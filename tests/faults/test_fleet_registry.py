"""Endpoints in a fleet registry: real etcd (the ``etcd`` fixture), real ``serve-*`` processes.

Each test asserts an invariant of registration (issue 15): the key goes first at a graceful stop,
lapses after a SIGKILL or a freeze past the TTL and comes back after SIGCONT, is replaced by a
restart at the same address (new incarnation); etcd down at start or mid-run costs no request;
a registry delete of a live peer drops nothing (a hint), a restart makes a D drop the old agent once
the new incarnation answers at the address; ``/readyz``
follows the data path; credentials are checked and never logged. No timing is asserted: the
"eventually" loops have deadlines wide enough for a loaded machine.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from kvpush.commands.common import control
from kvpush.fleet.etcd import Etcd
from kvpush.fleet.record import EndpointRecord, member_key
from kvpush.fleet.store import Follow, list_endpoints
from kvpush.wire import protocol
from tests.conftest import unused_port
from tests.support.etcd import EtcdServer
from tests.support.legs import stats
from tests.support.procs import KVPUSH, Proc, clean_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SMALL = ["--num-blocks", "64", "--layers", "2", "--block-bytes", "4096"]


def reg(etcd: EtcdServer, ttl: int = 3, *extra: str) -> list[str]:
    return ["--registry", etcd.url, "--registry-ttl", str(ttl), *extra]


def until(what: str, cond: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def record_at(e: Etcd, address: str, cluster: str = "default") -> EndpointRecord | None:
    recs, _ = list_endpoints(e, cluster)  # membership joined with its load summary
    return next((r for r in recs if r.address == address), None)


def http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def json_lines(p: Proc) -> list[dict[str, Any]]:
    out = []
    for line in p.log_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def run_drive(p: Proc, d: Proc, n: int, *extra: str, timeout: float = 120) -> dict[str, Any]:
    r = subprocess.run(
        [*KVPUSH, "drive", "-p", p.address, "-d", d.address, "-n", str(n), "--json", *extra],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=timeout,
    )
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def reading(proc: Proc, kind: str, name: str) -> float:
    """A counter or gauge of ``proc``'s snapshot, over its side channel."""
    values = stats(proc.address)[kind]
    assert isinstance(values, dict)
    return float(values.get(name, 0))


def is_up(proc: Proc) -> bool:
    return reading(proc, "gauges", "registry_up") == 1


def peers_of(proc: Proc) -> list[dict[str, Any]]:
    rows = stats(proc.address)["peers"]
    assert isinstance(rows, list)
    return rows


class Pending:
    """A request sent to D alone (its prefill leg never comes): D registers with P and waits;
    ``result()`` is D's answer."""

    def __init__(self, d: Proc, p_addr: str, tid: str) -> None:
        host, port = p_addr.rsplit(":", 1)
        self.rep: protocol.SideReply | None = None
        req = protocol.DecodeReq(
            transfer_id=tid, prefill_host=host, prefill_port=int(port), num_blocks=2
        )

        def leg() -> None:
            with control.connect(d.address, timeout_s=60) as c:
                self.rep = c.request(req, timeout_s=60)

        self.thread = threading.Thread(target=leg, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 60) -> protocol.DecodeRep:
        self.thread.join(timeout)
        assert isinstance(self.rep, protocol.DecodeRep), self.rep
        return self.rep


# -- lifecycle ------------------------------------------------------------------------------


def test_graceful_stop_removes_the_key_first(etcd, serve) -> None:
    e = Etcd([etcd.url])
    # The registry from the environment (KVPUSH_REGISTRY), as a deployment would set it.
    p = serve.serve("prefill", *SMALL, env=clean_env(KVPUSH_REGISTRY=etcd.url))
    rec = until("P registered", lambda: record_at(e, p.address))
    assert (rec.role, rec.incarnation, rec.address) == ("prefill", p.incarnation, p.address)
    assert rec.pid == p.popen.pid and rec.agent_names and rec.geometry.num_blocks == 64
    assert rec.geometry.device == "cpu"  # the words fleet ls --peer uses too, not NIXL's DRAM
    assert p.stop() == 0
    assert record_at(e, p.address) is None  # gone when the process is, no waiting on a TTL
    log = p.log_text()
    assert log.index("registry: removed") < log.index("endpoint " + p.engine_id + " stopped")


def test_sigkill_key_lapses_within_the_ttl(etcd, serve, tmp_path) -> None:
    e = Etcd([etcd.url])
    conf = tmp_path / "kvpush.toml"  # the registry from a config file
    conf.write_text(f'registry = "{etcd.url}"\nregistry_ttl = 2\n[prefill]\ncluster = "c-2"\n')
    p = serve.serve("prefill", *SMALL, "--config", str(conf))
    rec = until("P registered", lambda: record_at(e, p.address, "c-2"))
    assert rec.role == "prefill"
    p.kill()
    # TTL 2 s plus one refresh period; the rest is slack for a loaded machine.
    until("the key lapsed", lambda: record_at(e, p.address, "c-2") is None, timeout=2 + 2 / 3 + 10)


def test_sigstop_past_the_ttl_then_sigcont(etcd, serve) -> None:
    e = Etcd([etcd.url])
    p = serve.serve("prefill", *SMALL, *reg(etcd, 2))
    until("P registered", lambda: record_at(e, p.address))
    os.kill(p.popen.pid, signal.SIGSTOP)
    try:
        until("the frozen P's key lapsed", lambda: record_at(e, p.address) is None, timeout=20)
    finally:
        os.kill(p.popen.pid, signal.SIGCONT)
    rec = until("P registered again", lambda: record_at(e, p.address), timeout=20)
    assert rec.incarnation == p.incarnation  # the same process, a new lease
    until(
        "the log says why",
        lambda: "lease of" in p.log_text() and "registering again" in p.log_text(),
    )


@pytest.mark.slow
def test_restart_at_the_same_port_is_a_new_incarnation_and_ds_drop_the_old_agent(
    etcd, serve
) -> None:
    e = Etcd([etcd.url])
    port = str(unused_port())
    # A TTL long enough that the killed P's key outlives the new P's start on a loaded host
    # (else the key lapses first: a leave and a join, not a restart).
    p = serve.serve("prefill", *SMALL, *reg(etcd, 60), "--port", port)
    d = serve.serve("decode", *SMALL, *reg(etcd, 10))
    until("both registered", lambda: record_at(e, p.address) and record_at(e, d.address))
    follow = Follow(Etcd([etcd.url]), "default", retry_s=0.2)
    events: list[Any] = []
    threading.Thread(target=lambda: events.extend(follow), daemon=True).start()
    until("the listing", lambda: len(events) >= 2)
    out = run_drive(p, d, 5)
    assert out["ok"] == 5, out
    assert any(r["engine_id"] == p.engine_id for r in peers_of(d))  # D holds P's agent
    p.kill()  # its key stays (TTL 60 s) until the new process replaces it
    p2 = serve.serve("prefill", *SMALL, *reg(etcd, 60), "--port", port)
    assert p2.address == p.address and p2.incarnation != p.incarnation
    until("a restart event", lambda: any(ev.kind == "restart" for ev in events))
    follow.cancel()
    ev = next(ev for ev in events if ev.kind == "restart")
    assert (ev.address, ev.previous.incarnation, ev.record.incarnation) == (
        p.address,
        p.incarnation,
        p2.incarnation,
    )
    now = record_at(e, p.address)
    assert now is not None and now.incarnation == p2.incarnation  # replaced, same key
    # D dropped the dead incarnation's agent at once (not at its next handshake).
    until(
        "D dropped the old P",
        lambda: not any(r["engine_id"] == p.engine_id for r in peers_of(d)),
        timeout=15,
    )
    # On the data path's evidence: the new incarnation answering at the address (the registry's
    # restart made D look), or the old process's side channel refusing before that (peers.watch).
    log = d.log_text()
    assert "confirms it" in log or "is down: connection" in log, log[-3000:]
    assert "removed the agent" in log
    out = run_drive(p2, d, 5)
    assert out["ok"] == 5, out  # traffic resumes through a fresh handshake


# -- etcd outages ---------------------------------------------------------------------------


def test_etcd_down_at_start_then_up(tmp_path, serve) -> None:
    server = EtcdServer(tmp_path / "etcd-late")  # ports chosen, not started yet
    mport = unused_port()
    p = serve.serve("prefill", *SMALL, *reg(server, 3), "--metrics-port", str(mport), timeout=90)
    base = f"http://127.0.0.1:{mport}"
    status, body = http(base + "/readyz")
    assert status == 503 and "not registered" in body, body
    assert http(base + "/healthz")[0] == 200
    until(
        "an error counted",
        lambda: json_lines(p) and json_lines(p)[-1]["counters"].get("registry_errors", 0) > 0,
    )
    last = json_lines(p)[-1]
    assert last["gauges"]["registry_up"] == 0 and last["gauges"]["registry_registered"] == 0
    server.start()
    try:
        e = Etcd([server.url])
        until("P registered once etcd is up", lambda: record_at(e, p.address), timeout=30)
        until("registry_up in -o json", lambda: json_lines(p)[-1]["gauges"]["registry_up"] == 1)
        assert json_lines(p)[-1]["gauges"]["registry_registered"] == 1
        assert http(base + "/readyz") == (200, "ok\n")
        metrics = http(base + "/metrics")[1]
        assert "kvpush_registry_up" in metrics and "kvpush_registry_errors_total" in metrics
        log = p.log_text()
        assert log.count("the endpoint serves on") == 1  # said once per change, not per retry
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_etcd_killed_20s_under_drive_loses_nothing(etcd, serve) -> None:
    e = Etcd([etcd.url])
    p = serve.serve("prefill", *SMALL, *reg(etcd, 10))
    d = serve.serve("decode", *SMALL, *reg(etcd, 10))
    until("both registered", lambda: len(list_endpoints(e, "default")[0]) == 2)
    drive = subprocess.Popen(
        [*KVPUSH, "drive", "-p", p.address, "-d", d.address, "-n", "600", "--rate", "15",
         "-c", "4", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip
    time.sleep(4)
    etcd.kill()
    time.sleep(20)
    etcd.start()
    out_s, err_s = drive.communicate(timeout=200)
    out = json.loads(out_s)
    assert (out["requests"], out["ok"], out["failed"]) == (600, 600, 0), (out, err_s)
    assert out["all_verified"] is True
    recs = until(
        "both listed again", lambda: (r := list_endpoints(e, "default")[0]) and len(r) == 2 and r
    )
    assert {r.address for r in recs} == {p.address, d.address}
    for proc in (p, d):
        assert reading(proc, "counters", "registry_errors") > 0
        until("registry_up again", functools.partial(is_up, proc))
        assert "etcd reachable again" in proc.log_text()


# -- stale identities -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_registry_delete_is_a_hint_the_work_waiting_on_a_live_p_goes_on(etcd, serve) -> None:
    """A deleted key is a hint, never proof (issue 24): D looks at P's side channel, finds the
    same incarnation and keeps P; the request waiting on P is neither failed nor freed, and
    completes when P's leg comes."""
    e = Etcd([etcd.url])
    p = serve.serve("prefill", *SMALL, *reg(etcd, 10))
    d = serve.serve("decode", *SMALL, *reg(etcd, 10))
    until("both registered", lambda: record_at(e, p.address) and record_at(e, d.address))
    assert run_drive(p, d, 3)["ok"] == 3
    assert any(r["engine_id"] == p.engine_id for r in peers_of(d))
    pending = Pending(d, p.address, "waits-for-p")
    until("D waits on P", lambda: reading(d, "gauges", "d_waiting") == 1)
    evicted = reading(d, "counters", "peers_evicted")
    assert e.delete(member_key("default", p.address))
    until("D took the hint", lambda: reading(d, "counters", "registry_hints") >= 1)
    until("P's key back (its registrar)", lambda: record_at(e, p.address), timeout=15)
    time.sleep(1.0)  # a check's worth of time: nothing may have been dropped meanwhile
    assert reading(d, "gauges", "d_waiting") == 1 and pending.rep is None
    assert reading(d, "counters", "peers_evicted") == evicted
    assert any(r["engine_id"] == p.engine_id for r in peers_of(d))
    assert "a hint, not proof" in d.log_text() and "dropping it" not in d.log_text()
    with control.connect(p.address, timeout_s=30) as c:
        rep = c.request(protocol.PrefillReq(transfer_id="waits-for-p", num_blocks=2), timeout_s=30)
    assert isinstance(rep, protocol.PrefillRep), rep
    assert (pending.result(30).outcome, reading(d, "failures", "unknown_completion")) == ("ok", 0)
    # The other way round: D's key deleted -> P keeps D, traffic goes on.
    assert e.delete(member_key("default", d.address))
    until("P took the hint", lambda: reading(p, "counters", "registry_hints") >= 1)
    assert any(r["engine_id"] == d.engine_id for r in peers_of(p))
    until("D's key back", lambda: record_at(e, d.address), timeout=15)
    assert run_drive(p, d, 3)["ok"] == 3


# -- readiness ------------------------------------------------------------------------------


@pytest.mark.slow
def test_readyz_follows_the_data_path(serve) -> None:
    port = str(unused_port())
    mport = unused_port()
    p = serve.serve("prefill", *SMALL, "--port", port)
    fast = ["--side-channel-timeout", "1", "--handshake-timeout", "2"]  # a dead P fails fast
    d = serve.serve("decode", *SMALL, *fast, "--metrics-port", str(mport))
    ready = f"http://127.0.0.1:{mport}/readyz"
    assert http(ready) == (200, "ok\n")  # idle: ready
    assert run_drive(p, d, 4)["ok"] == 4
    assert http(ready) == (200, "ok\n")
    p.kill()
    for i in range(3):  # D's requests all fail: its P is gone
        assert Pending(d, p.address, f"dead-{i}").result().outcome == "failed"
    # A dead P is not D's health (issue 24): D stays ready. Its own failures turn it unready:
    # tests/faults/test_readiness_fleet.py.
    assert http(ready) == (200, "ok\n")
    code, js = http(ready + "?format=json")
    assert code == 200 and json.loads(js) == {"ok": True, "reason": "ok"}
    assert http(f"http://127.0.0.1:{mport}/healthz") == (200, "ok\n")  # alive all along
    p2 = serve.serve("prefill", *SMALL, "--port", port)
    assert run_drive(p2, d, 4)["ok"] == 4
    assert http(ready) == (200, "ok\n")


# -- credentials ----------------------------------------------------------------------------


def test_password_file_readable_by_others_is_refused(etcd, tmp_path, kvpush_run) -> None:
    pw = tmp_path / "pw"
    pw.write_text("sekrit-password-123\n")
    pw.chmod(0o644)
    r = kvpush_run(
        "serve-prefill", *SMALL, "--port", "0", "--registry", etcd.url,
        "--registry-user", "root", "--registry-password-file", str(pw),
    )  # fmt: skip
    assert r.returncode == 2
    assert r.err_lines == [
        f"error: --registry-password-file {pw} is readable by other users (mode 644)",
        f"hint: restrict it to its owner: chmod 600 {pw}",
    ]
    assert "sekrit" not in r.stdout + r.stderr


def test_registry_option_errors(etcd, kvpush_run) -> None:
    r = kvpush_run("serve-decode", *SMALL, "--advertise", "10.0.0.7")
    assert r.returncode == 2 and r.err_lines[0] == "error: --advertise needs --registry"
    r = kvpush_run("serve-decode", *SMALL, "--registry", "ftp://x:1")
    assert r.returncode == 2 and r.err_lines[0] == "error: invalid etcd URL 'ftp://x:1'"
    r = kvpush_run("serve-decode", *SMALL, "--registry", etcd.url, "--host", "0.0.0.0", "--expose")
    assert r.returncode == 2
    assert r.err_lines[0] == "error: --registry with --host 0.0.0.0 needs --advertise HOST"
    r = kvpush_run("serve-decode", *SMALL, "--registry", etcd.url, "--registry-ttl", "1")
    assert r.returncode == 2 and r.err_lines[0].startswith("error: --registry-ttl must be")


def test_tls_registry_with_a_client_certificate(tls_etcd, serve) -> None:
    import certifi

    pki = tls_etcd.pki
    conf = pki.ca.parent / "kvpush.toml"  # TLS files relative to the config file
    conf.write_text(
        f'registry_ca = "{pki.ca.name}"\nregistry_cert = "{pki.client_cert.name}"\n'
        f'registry_key = "{pki.client_key.name}"\n'
    )
    # A CA bundle in the environment must not override --registry-ca (psf/requests #3829).
    env = clean_env(REQUESTS_CA_BUNDLE=certifi.where())
    p = serve.serve("prefill", *SMALL, *reg(tls_etcd), "--config", str(conf), env=env)
    e = Etcd(
        [tls_etcd.url], ca_cert=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key)
    )
    until("P registered over TLS", lambda: record_at(e, p.address))
    assert p.stop() == 0 and record_at(e, p.address) is None


@pytest.mark.slow
def test_etcd_auth_works_and_the_password_is_never_logged(etcd, tmp_path, serve) -> None:
    secret = "sekrit-Pw-4711"
    for path, body in (
        ("/v3/auth/user/add", {"name": "root", "password": secret}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/enable", {}),
    ):
        assert requests.post(etcd.url + path, json=body, timeout=5).status_code == 200
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text(secret + "\n")
    bad.write_text("wrong-" + secret + "\n")
    for f in (good, bad):
        f.chmod(0o600)
    auth = ["--registry-user", "root", "--log-level", "debug"]
    p = serve.serve("prefill", *SMALL, *reg(etcd), *auth, "--registry-password-file", str(good))
    e = Etcd([etcd.url], user="root", password=secret)
    until("P registered with credentials", lambda: record_at(e, p.address))
    # A wrong password: refused by etcd, the endpoint serves on and says why (once).
    q = serve.serve("prefill", *SMALL, *reg(etcd), *auth, "--registry-password-file", str(bad))
    until("the refusal logged", lambda: "refused user 'root'" in q.log_text())
    assert stats(q.address)["role"] == "prefill"  # serving
    assert record_at(e, q.address) is None
    for proc in (p, q):
        proc.stop()
        assert secret not in proc.log_text()


@pytest.mark.slow
def test_a_graceful_stop_lets_the_work_in_flight_drain(etcd, serve) -> None:
    """The key goes first, but marked ``leaving``: Ds let P's work drain (never peer_left)."""
    e = Etcd([etcd.url])
    p = serve.serve("prefill", *SMALL, *reg(etcd, 10))
    d = serve.serve("decode", *SMALL, *reg(etcd, 10))
    until("both registered", lambda: record_at(e, p.address) and record_at(e, d.address))
    drive = subprocess.Popen(
        [*KVPUSH, "drive", "-p", p.address, "-d", d.address, "-n", "400", "--rate", "40",
         "-c", "8", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip
    until("traffic", lambda: reading(d, "counters", "requests_ok") >= 20)
    waiting = Pending(d, p.address, "waits-for-p")  # P holds its registration: no blocks come
    until("D waits on P", lambda: reading(d, "gauges", "d_waiting") >= 1)
    assert p.stop() == 0
    # P said so itself at the end of its drain; D did not drop it first as gone.
    assert waiting.result(30).reason == "shutting_down"
    out_s, err_s = drive.communicate(timeout=200)
    out = json.loads(out_s)
    assert out["requests"] == out["ok"] + out["failed"] == 400, (out, err_s)
    assert "peer_left" not in out["failures_by_reason"], out
    assert "a graceful stop" in d.log_text()


# -- NIXL metadata through the same etcd (--nixl-metadata etcd) -------------------------------


def nixl_keys(e: Etcd, agent: str) -> list[str]:
    return [k for k, _ in e.get_prefix(f"/nixl/kvpush/default/{agent}/")[0]]


def test_nixl_metadata_through_etcd_and_cleanup_after_a_lapse(etcd, serve) -> None:
    e = Etcd([etcd.url])
    mode = ["--nixl-metadata", "etcd"]
    p = serve.serve("prefill", *SMALL, *reg(etcd, 2), *mode)
    d = serve.serve("decode", *SMALL, *reg(etcd, 2), *mode)
    rp = until("P registered", lambda: record_at(e, p.address))
    rd = until("D registered", lambda: record_at(e, d.address))
    assert (rp.nixl_metadata, rp.nixl_namespace) == ("etcd", "/nixl/kvpush/default")
    p_agent, d_agent = rp.agent_names[0], rd.agent_names[0]
    # NIXL's own keys, written by NIXL's etcd backend (no lease).
    assert f"/nixl/kvpush/default/{p_agent}/metadata" in nixl_keys(e, p_agent)
    assert f"/nixl/kvpush/default/{d_agent}/metadata" in nixl_keys(e, d_agent)
    out = run_drive(p, d, 5)
    assert out["ok"] == 5 and out["all_verified"], out
    # Both handshakes loaded the peer's agent from etcd, not from the side-channel reply.
    assert "etcd_load_s" in d.log_text() and "etcd_load_s" in p.log_text()
    # P dies: NIXL would keep its keys forever; kvpush deletes them once the lease lapsed.
    p.kill()
    until("P's registry key lapsed", lambda: record_at(e, p.address) is None, timeout=20)
    until("P's NIXL keys deleted", lambda: not nixl_keys(e, p_agent), timeout=20)
    assert f"deleted 2 NIXL metadata key(s) of {p_agent}" in d.log_text()
    # A graceful stop withdraws its own NIXL metadata.
    assert d.stop() == 0
    assert nixl_keys(e, d_agent) == []


def test_nixl_metadata_etcd_option_errors(etcd, kvpush_run) -> None:
    r = kvpush_run("serve-prefill", *SMALL, "--nixl-metadata", "etcd")
    assert r.returncode == 2 and r.err_lines[0] == "error: --nixl-metadata etcd needs --registry"
    r = kvpush_run(
        "serve-prefill", *SMALL, "--nixl-metadata", "etcd", "--registry", "https://127.0.0.1:1"
    )
    assert r.returncode == 2
    assert r.err_lines[0] == (
        "error: --nixl-metadata etcd: NIXL's etcd backend takes no credentials and no TLS"
    )


def test_nixl_etcd_backend_behaviour_this_version() -> None:
    """NIXL 1.5.1's etcd backend, as kvpush relies on it (docs/fleet.md): a publish while etcd
    is down returns without error and is never retried (kvpush publishes again at every
    (re-)registration); a delete of an agent's keys by someone else makes a peer's NIXL drop
    that agent (kvpush's cleanup after a lapse relies on it); an agent removed and loaded from
    etcd again is usable (kvpush's stale-agent guard forgets it)."""
    script = Path(__file__).parents[1] / "support" / "nixl_etcd_probe.py"
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        # kvpush silences NIXL's own log unless asked (NIXL_LOG_LEVEL): ask, to see its line.
        env=clean_env(NIXL_LOG_LEVEL="WARN"),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["publish_while_down_raised"] is False  # silent: only a log line on stderr
    assert "Failed to store agent probe-a" in r.stderr
    assert out["keys_after_etcd_came_up"] == []  # NIXL never publishes it by itself
    assert "/nixl/kvpush/probe/probe-a/metadata" in out["keys_after_publish_again"]
    assert out["b_loaded_a"] is True and out["deleted"] == 2
    assert out["b_reloaded_a_usable"] is True  # fetched again after an eviction: not stale
    assert out["b_dropped_a_after_delete"] is True

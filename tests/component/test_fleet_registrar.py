"""The registrar's loop against a real etcd (no endpoint: a record and a load function stand in
for one), the registry settings' checks, and the readiness judgement of ``/readyz``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpush.config import Role
from kvpush.errors import ConfigError
from kvpush.fleet.config import RegistryConfig, read_password_file
from kvpush.fleet.etcd import Etcd
from kvpush.fleet.member import advertised_address, reachable_url
from kvpush.fleet.record import (
    EndpointRecord,
    Geometry,
    Load,
    decode_load,
    decode_member,
    joined,
    load_key,
    member_key,
    members_prefix,
)
from kvpush.fleet.registrar import Registrar, same_load
from kvpush.telemetry.health import Health, Sample, data_path
from kvpush.telemetry.store import Telemetry
from tests.conftest import unused_port

pytestmark = pytest.mark.timeout(120)

ADDR = "127.0.0.1:5999"
KEY = member_key("t", ADDR)
LOAD_KEY = load_key("t", ADDR)


def rec() -> EndpointRecord:
    return EndpointRecord(
        role=Role.DECODE,
        engine_id="d1",
        incarnation="inc-1",
        address=ADDR,
        host="h",
        pid=1,
        tp_size=1,
        wire="kvpush",
        geometry=Geometry(
            num_blocks=8, layers=1, regions=2, block_bytes=64, dtype="uint8", kv_layout="NHD"
        ),
        compat_hash="c",
        kvpush_version="0",
    )


def until(what: str, cond: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


class Loads:
    """A load function whose free-block count the test sets."""

    def __init__(self) -> None:
        self.free = 8
        self.calls = 0

    def __call__(self) -> Load:
        self.calls += 1
        return Load(free_blocks=self.free, updated_at=time.time())


def registrar(url: str, ttl: int = 3, load: Loads | None = None, tm: Telemetry | None = None):
    cfg = RegistryConfig(urls=url, cluster="t", ttl_s=ttl, timeout_s=1.0, load_period_s=0.2)
    return Registrar(cfg, rec(), load or Loads(), tm)


def value(e: Etcd) -> EndpointRecord | None:
    """The endpoint as a reader joins it: its membership and its load summary."""
    raw = e.get(KEY)
    if raw is None:
        return None
    load = e.get(LOAD_KEY)
    return joined(decode_member(raw), decode_load(load) if load is not None else None)


# -- the registrar's loop -------------------------------------------------------------------


def test_registers_refreshes_and_leaves(etcd) -> None:
    e = Etcd([etcd.url])
    tm = Telemetry(Role.DECODE, "d1")
    r = registrar(etcd.url, tm=tm)
    r.start()
    until("registered", lambda: value(e))
    assert r.verdict().ok and r.up is True
    g = tm.snapshot().gauges
    assert (g["registry_up"], g["registry_registered"]) == (1.0, 1.0)
    time.sleep(4)  # past the TTL: the refreshes kept it
    assert value(e) is not None
    assert r.leave() is True
    assert value(e) is None  # at once
    assert tm.snapshot().gauges["registry_registered"] == 0.0


def test_the_load_summary_is_written_when_it_changes(etcd) -> None:
    e = Etcd([etcd.url])
    loads = Loads()
    r = registrar(etcd.url, ttl=10, load=loads)
    r.start()
    first = until("registered", lambda: value(e))
    assert first.load.free_blocks == 8
    loads.free = 5
    until("the new summary", lambda: (v := value(e)) is not None and v.load.free_blocks == 5)
    r.leave()


def test_the_membership_key_is_written_at_registration_and_on_leaving_only(etcd) -> None:
    """Layout v2: load summaries go to the load key; a watcher of membership receives nothing
    while the load changes, then the ``leaving`` write and the delete."""
    e = Etcd([etcd.url])
    loads = Loads()
    r = registrar(etcd.url, ttl=10, load=loads)
    r.start()
    until("registered", lambda: value(e))
    events, cancel = e.watch_prefix(members_prefix("t"))
    got: list[str] = []
    t = threading.Thread(target=lambda: got.extend(ev.kind for ev in events), daemon=True)
    t.start()

    def free_is(n: int) -> bool:
        v = value(e)
        return v is not None and v.load.free_blocks == n

    for free in (5, 3, 1):
        loads.free = free
        until(f"summary {free}", lambda: free_is(loads.free))
    assert got == []
    assert r.leave() is True
    until("leaving, then gone", lambda: got == ["PUT", "DELETE"])
    cancel()


def test_a_deleted_key_is_put_again(etcd) -> None:
    e = Etcd([etcd.url])
    r = registrar(etcd.url, ttl=10)
    r.start()
    until("registered", lambda: value(e))
    e.delete(KEY)
    r.put_again()
    until("put again", lambda: value(e))
    r.leave()


def test_a_lost_lease_is_granted_again(etcd, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvpush.fleet.registrar")
    e = Etcd([etcd.url])
    r = registrar(etcd.url, ttl=10)
    r.start()
    until("registered", lambda: value(e))
    first = r.lease
    assert first is not None
    e.revoke(first)  # as if it had lapsed while this process was frozen
    assert value(e) is None
    until("registered again", lambda: value(e) and r.lease not in (None, first))
    assert "lost" in caplog.text and "registered again" in caplog.text
    r.leave()


def test_etcd_down_at_start_then_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tests.support.etcd import EtcdServer

    caplog.set_level(logging.INFO, "kvpush.fleet.registrar")
    server = EtcdServer(tmp_path / "late")
    tm = Telemetry(Role.DECODE, "d1")
    r = registrar(server.url, tm=tm)
    r.start()
    until("errors counted", lambda: r.errors >= 3)
    v = r.verdict()
    assert not v.ok and v.reason.startswith("not registered in the registry yet: registry")
    assert tm.snapshot().counters["registry_errors"] == r.errors
    assert tm.snapshot().gauges["registry_up"] == 0.0
    server.start()
    try:
        until("registered", lambda: value(Etcd([server.url])))
        assert r.verdict().ok and r.up is True
        assert caplog.text.count("the endpoint serves on") == 1  # once per change
        server.kill()
        until("down again", lambda: r.up is False, timeout=30)
        assert r.verdict().ok  # registered once: an outage does not make it unready
        server.start()
        until("up again", lambda: r.up is True, timeout=30)
        assert caplog.text.count("the endpoint serves on") == 2
        assert "etcd reachable again" in caplog.text
        assert r.leave() is True
    finally:
        server.stop()


def test_leave_with_etcd_gone_is_bounded_and_says_so(etcd, caplog) -> None:
    e = Etcd([etcd.url])
    r = registrar(etcd.url, ttl=10)
    r.start()
    until("registered", lambda: value(e))
    etcd.kill()
    assert r.leave() is False
    assert "lapses within 10s" in caplog.text


# -- settings -------------------------------------------------------------------------------


def test_registry_config_checks() -> None:
    with pytest.raises(ConfigError, match="--cluster"):
        RegistryConfig(urls="http://e:2379", cluster="bad name")
    with pytest.raises(ConfigError, match="--registry-ttl"):
        RegistryConfig(urls="http://e:2379", ttl_s=1)
    with pytest.raises(ConfigError, match="invalid etcd URL"):
        RegistryConfig(urls="http://e:2379/x")
    cfg = RegistryConfig(urls="http://e:2379", user="u", password="pw-secret")
    assert "pw-secret" not in repr(cfg.access)
    with pytest.raises(ConfigError, match="user and a password"):
        RegistryConfig(urls="http://e:2379", password="pw-secret")
    assert "pw-secret" not in repr(cfg) and cfg.refresh_s == 10 / 3


def test_password_file_rules(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_text("s3cret\n")
    f.chmod(0o600)
    assert read_password_file(str(f)) == "s3cret"
    f.chmod(0o604)
    with pytest.raises(ConfigError) as ei:
        read_password_file(str(f))
    assert "readable by other users" in ei.value.message and "s3cret" not in ei.value.message
    f.chmod(0o600)
    f.write_text("two\nlines\n")
    with pytest.raises(ConfigError, match="exactly one line"):
        read_password_file(str(f))
    with pytest.raises(ConfigError, match="No such file"):
        read_password_file(str(tmp_path / "none"))


def test_advertised_address_and_metrics_url() -> None:
    assert advertised_address("127.0.0.1", 5600, None) == "127.0.0.1:5600"
    assert advertised_address("0.0.0.0", 5600, "10.0.0.7") == "10.0.0.7:5600"
    assert advertised_address("::", 5600, "[fd00::7]") == "[fd00::7]:5600"
    with pytest.raises(ConfigError, match="all-interfaces") as ei:
        advertised_address("0.0.0.0", 5600, None)
    assert "--advertise" in ei.value.hint
    url = f"http://0.0.0.0:{unused_port()}/metrics"
    assert reachable_url(url, "10.0.0.7:5600").startswith("http://10.0.0.7:")
    assert reachable_url("http://127.0.0.1:9/metrics", "10.0.0.7:5600") == (
        "http://127.0.0.1:9/metrics"
    )


def test_same_load_ignores_the_time_stamp() -> None:
    assert same_load(Load(free_blocks=1, updated_at=1.0), Load(free_blocks=1, updated_at=2.0))
    assert not same_load(Load(free_blocks=1), Load(free_blocks=2))


# -- readiness (pure) -----------------------------------------------------------------------


def s(t: float, ok: int, failed: int, **fails: int) -> Sample:
    return Sample(t, ok, failed, dict(fails))


def test_data_path_verdicts() -> None:
    assert data_path(s(0, 0, 0), s(10, 0, 0), Role.DECODE).ok  # idle: ready
    assert data_path(s(0, 0, 0), s(10, 5, 3), Role.DECODE).ok  # some succeed: ready
    # Only its own failures count (issue 24): a client naming a dead P, or a frozen P, does not.
    assert data_path(s(0, 0, 0), s(10, 0, 6, prefill_unreachable=4, deadline=2), Role.DECODE).ok
    v = data_path(
        s(0, 2, 1, write_error=1),
        s(10, 2, 7, write_error=5, deadline=2),
        Role.DECODE,
    )
    assert not v.ok
    assert v.reason == (
        "data path failing: 4 failures of its own and no request succeeded in the last 10s "
        "(write_error x4); not counted, peers' or clients': deadline x2"
    )
    assert (
        "no push succeeded" in data_path(s(0, 0, 0), s(3, 0, 1, write_error=1), Role.PREFILL).reason
    )


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_probes_closer_than_half_a_second_keep_the_successes_they_bracket() -> None:
    """Idle probe, four quick successes, probe 0.3 s later, then only failures: not ready
    (a sample that moved was dropped for coming too soon, and the old idle base then counted
    the four successes against the failures: /readyz stayed 200 in a CI run)."""
    clock = Clock()
    tm = Telemetry(Role.DECODE, "d", clock=clock)
    h = Health(tm.snapshot, lambda: None, lambda: False, window_s=10, clock=clock)
    assert h.ready().ok
    tm.inc("requests_ok", 4)
    clock.t += 0.3
    assert h.ready().ok
    tm.inc("requests_failed", 3)
    tm.fail("write_error", 3)
    clock.t += 2.0
    v = h.ready()
    assert not v.ok and "3 failures of its own and no request succeeded" in v.reason, v


def test_health_windows_and_order_of_checks() -> None:
    clock = Clock()
    tm = Telemetry(Role.DECODE, "d", clock=clock)
    failure: list[BaseException] = []
    stopping: list[bool] = []
    h = Health(
        tm.snapshot,
        lambda: failure[0] if failure else None,
        lambda: bool(stopping),
        window_s=10,
        clock=clock,
    )

    def failed(n: int) -> None:
        tm.inc("requests_failed", n)
        tm.fail("write_error", n)

    assert h.ready().ok and h.live().ok
    failed(4)
    clock.t = 105.0
    v = h.ready()
    assert not v.ok and "4 failures of its own" in v.reason and "write_error x4" in v.reason
    tm.inc("requests_ok")
    clock.t = 107.0  # one success: ready again
    assert h.ready().ok
    clock.t = 121.0
    h.tick()  # the exporter's server loop samples at least every TICK_S
    failed(5)
    clock.t = 130.0  # failures only, since the oldest sample inside the window
    assert not h.ready().ok
    clock.t = 145.0  # a window with nothing attempted: ready
    assert h.ready().ok
    tm.inc("requests_ok", 3)
    clock.t = 147.0
    assert h.ready().ok
    failed(2)  # failures right after successes, probes 1 s apart: the successes do not hide them
    clock.t = 148.0
    v = h.ready()
    assert not v.ok and "2 failures of its own" in v.reason, v
    h.registration = lambda: data_path(s(0, 0, 0), s(1, 0, 1, write_error=1), Role.DECODE)
    assert h.ready().reason.startswith("data path failing")
    stopping.append(True)
    assert h.ready().reason.startswith("stopping")
    failure.append(RuntimeError("boom"))
    assert not h.live().ok and "boom" in h.ready().reason

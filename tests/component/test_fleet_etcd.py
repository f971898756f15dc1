"""kvpush.fleet.etcd and kvpush.fleet.store against a real etcd server (the ``etcd`` fixture):
key/value calls, leases, watches, failover across URLs, authentication, and the typed fleet
events (join, leave, update, restart) out of a cluster's keys."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from kvpush.errors import (
    ConfigError,
    LeaseLost,
    RegistryError,
    RegistryUnavailable,
    WatchCompacted,
)
from kvpush.fleet.etcd import Etcd, WatchEvent, parse_urls, prefix_end
from kvpush.fleet.record import (
    EndpointRecord,
    Geometry,
    Load,
    encode_load,
    encode_member,
    load_key,
    load_writes,
    member_key,
    registration_writes,
)
from kvpush.fleet.store import (
    FleetEvent,
    Follow,
    apply,
    diff,
    list_endpoints,
    read_cluster,
    watch_endpoints,
)
from tests.conftest import unused_port

pytestmark = pytest.mark.timeout(90)


def dead_url() -> str:
    return f"http://127.0.0.1:{unused_port()}"


def record(address: str, incarnation: str = "i1", free: int = 64, **kw: Any) -> EndpointRecord:
    return EndpointRecord(
        role=kw.pop("role", "decode"),
        engine_id="e-" + address,
        incarnation=incarnation,
        address=address,
        host="h",
        pid=1,
        tp_size=1,
        wire="kvpush",
        geometry=Geometry(
            num_blocks=64, layers=2, regions=2, block_bytes=4096, dtype="uint8", kv_layout="NHD"
        ),
        compat_hash="c",
        kvpush_version="0",
        load=Load(free_blocks=free),
        **kw,
    )


class Collector:
    """Iterate an iterator in a thread, keeping what it yields and how it ended."""

    def __init__(self, it: Iterator[Any]) -> None:
        self.items: list[Any] = []
        self.error: BaseException | None = None
        self._it = it
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for x in self._it:
                self.items.append(x)
        except BaseException as e:  # kept for the test to assert on
            self.error = e

    def wait_for(self, pred: Any, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred(self.items):
                return
            time.sleep(0.05)
        raise AssertionError(f"not seen within {timeout}s: {self.items}")


# -- URLs (pure) --------------------------------------------------------------------------


def test_parse_urls_normalises_and_refuses() -> None:
    assert parse_urls("10.0.0.5, https://e:2400/,h") == [
        "http://10.0.0.5:2379",
        "https://e:2400",
        "http://h:2379",
    ]
    assert parse_urls(["http://a:1,http://b:2"]) == ["http://a:1", "http://b:2"]
    for bad in ("ftp://x:1", "http://x:1/path", "", " , ", "http://x:99999"):
        with pytest.raises(ConfigError):
            parse_urls(bad)


def test_prefix_end() -> None:
    assert prefix_end("/a/") == "/a0"
    assert prefix_end("ab") == "ac"


def test_half_given_credentials_are_refused() -> None:
    with pytest.raises(ConfigError, match="key"):
        Etcd("http://x:1", cert="/c")
    with pytest.raises(ConfigError, match="user and a password"):
        Etcd("http://x:1", user="u")


def test_repr_never_shows_the_password() -> None:
    e = Etcd("http://x:1", user="kv", password="s3cret-pw")
    assert "s3cret-pw" not in repr(e) and "kv" in repr(e)


# -- key/value and leases -----------------------------------------------------------------


def test_the_test_etcd_starts_on_fresh_ports_when_its_own_were_taken(tmp_path) -> None:
    """The fixture's etcd exited once on CI ("etcd exited with 1") -- a parallel test's process
    had bound a port it was given. It now starts on fresh ports when that happens, as long as no
    test has read its URL yet; once one has, the port is refused as before."""
    from tests.support.etcd import EtcdServer

    fresh, late = EtcdServer(tmp_path / "a"), EtcdServer(tmp_path / "b")
    with socket.socket() as thief:
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        thief.bind(("127.0.0.1", fresh.client_port))
        thief.listen()
        late.client_port = fresh.client_port
        taken = fresh.client_port
        try:
            fresh.start()
            assert fresh.client_port != taken and fresh.healthy()
            assert late.url.endswith(f":{taken}")
            with pytest.raises(RuntimeError, match="etcd exited"):
                late.start()
        finally:
            fresh.stop()
            late.stop()


def test_put_get_prefix_delete_and_revisions(etcd) -> None:
    e = Etcd([etcd.url])
    kvs, rev0 = e.get_prefix("/t/")
    assert kvs == []
    r1 = e.put("/t/b", b"2")
    r2 = e.put("/t/a", b"1")
    e.put("/u/x", b"outside")
    assert r2 == r1 + 1
    kvs, rev = e.get_prefix("/t/")
    assert kvs == [("/t/a", b"1"), ("/t/b", b"2")]
    assert rev >= r2 > rev0
    assert e.get("/t/a") == b"1" and e.get("/t/none") is None
    assert e.delete("/t/a") is True and e.delete("/t/a") is False
    assert e.delete_prefix("/t/") == 1
    assert e.get_prefix("/t/")[0] == [] and e.get("/u/x") == b"outside"


def test_lease_refresh_revoke_and_lost(etcd) -> None:
    e = Etcd([etcd.url])
    lease = e.grant(30)
    assert 0 < e.refresh(lease) <= 30
    e.put("/l/k", b"v", lease=lease)
    assert e.revoke(lease) is True
    assert e.get("/l/k") is None  # the lease's key went with it
    assert e.refresh(lease) == 0  # gone: 0, not an error
    assert e.revoke(lease) is False
    with pytest.raises(LeaseLost, match="lease not found"):
        e.put("/l/k", b"v", lease=lease)


def test_lease_expires_without_refresh(etcd) -> None:
    e = Etcd([etcd.url])
    lease = e.grant(1)
    e.put("/l/k", b"v", lease=lease)
    deadline = time.monotonic() + 15
    while e.get("/l/k") is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert e.get("/l/k") is None
    assert e.refresh(lease) == 0


# -- failover and outages -----------------------------------------------------------------


def test_failover_skips_a_dead_url(etcd) -> None:
    e = Etcd([dead_url(), etcd.url, dead_url()], timeout_s=1.0)
    e.put("/f/k", b"v")
    assert e.get("/f/k") == b"v"
    assert e.urls[e._current] == etcd.url  # the one that answered is tried first next time


def test_every_url_dead_raises_unavailable_with_a_hint(etcd) -> None:
    e = Etcd([dead_url(), dead_url()], timeout_s=0.5)
    with pytest.raises(RegistryUnavailable) as ei:
        e.get_prefix("/")
    assert "connection refused" in ei.value.message
    assert "--registry" in ei.value.hint


def test_a_frozen_etcd_is_bounded_by_the_timeout(etcd) -> None:
    e = Etcd([etcd.url], timeout_s=0.5)
    Etcd([etcd.url], timeout_s=10).put("/z/k", b"v")  # generous: the host may be loaded
    etcd.freeze()
    try:
        with pytest.raises(RegistryUnavailable, match="timed out"):
            e.get("/z/k")
    finally:
        etcd.thaw()
    e.timeout_s = 10.0
    for c in e._clients:
        c.timeout_s = 10.0
    assert e.get("/z/k") == b"v"  # the same client works again once etcd does


def test_calls_work_again_after_an_etcd_restart(etcd) -> None:
    e = Etcd([etcd.url], timeout_s=1.0)
    e.put("/r/k", b"v")
    etcd.kill()
    with pytest.raises(RegistryUnavailable):
        e.get("/r/k")
    etcd.start()
    assert e.get("/r/k") == b"v"


# -- watches ------------------------------------------------------------------------------


def test_watch_sees_puts_and_deletes_in_order_from_a_revision(etcd) -> None:
    e = Etcd([etcd.url])
    e.put("/w/before", b"0")
    _, rev = e.get_prefix("/w/")
    e.put("/w/a", b"1")  # after the listing, before the watch: still seen
    events, cancel = e.watch_prefix("/w/", rev + 1)
    c = Collector(events)
    e.put("/x/outside", b"no")
    e.delete("/w/a")
    e.put("/w/b", b"2")
    c.wait_for(lambda it: len(it) >= 3)
    cancel()
    c.thread.join(10)
    assert not c.thread.is_alive() and c.error is None
    assert [(ev.kind, ev.key, ev.value) for ev in c.items] == [
        ("PUT", "/w/a", b"1"),
        ("DELETE", "/w/a", b""),
        ("PUT", "/w/b", b"2"),
    ]
    assert all(isinstance(ev, WatchEvent) for ev in c.items)
    assert [ev.revision for ev in c.items] == sorted(ev.revision for ev in c.items)


def test_watch_breaks_with_unavailable_when_etcd_dies(etcd) -> None:
    e = Etcd([etcd.url])
    events, _cancel = e.watch_prefix("/w/")
    c = Collector(events)
    time.sleep(0.2)
    etcd.kill()
    c.thread.join(15)
    assert isinstance(c.error, RegistryUnavailable)


def test_watch_from_a_compacted_revision(etcd) -> None:
    e = Etcd([etcd.url])
    for i in range(5):
        e.put("/c/k", str(i).encode())
    _, rev = e.get_prefix("/c/")
    r = requests.post(etcd.url + "/v3/kv/compaction", json={"revision": str(rev)}, timeout=5)
    assert r.status_code == 200, r.text
    events, cancel = e.watch_prefix("/c/", 2)
    with pytest.raises(WatchCompacted):
        next(events)
    cancel()


def test_watch_open_fails_over_and_fails_typed(etcd) -> None:
    e = Etcd([dead_url(), etcd.url], timeout_s=1.0)
    events, cancel = e.watch_prefix("/o/")
    c = Collector(events)
    e.put("/o/k", b"v")
    c.wait_for(lambda it: len(it) == 1)
    cancel()
    with pytest.raises(RegistryUnavailable):
        Etcd([dead_url()], timeout_s=0.5).watch_prefix("/o/")


# -- authentication -----------------------------------------------------------------------


def enable_auth(url: str, password: str) -> None:
    for path, body in (
        ("/v3/auth/user/add", {"name": "root", "password": password}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/enable", {}),
    ):
        r = requests.post(url + path, json=body, timeout=5)
        assert r.status_code == 200, (path, r.text)


def test_user_and_password(etcd) -> None:
    enable_auth(etcd.url, "pw-123")
    e = Etcd([etcd.url], user="root", password="pw-123")
    e.put("/a/k", b"v")
    assert e.get("/a/k") == b"v"
    events, cancel = e.watch_prefix("/a/")  # the watch carries the token too
    c = Collector(events)
    e.delete("/a/k")
    c.wait_for(lambda it: len(it) == 1)
    cancel()
    with pytest.raises(RegistryError, match="refused user 'root'") as ei:
        Etcd([etcd.url], user="root", password="wrong").get("/a/k")
    assert "pw-123" not in str(ei.value) and "wrong" not in str(ei.value)
    assert "password" in ei.value.hint
    with pytest.raises(RegistryError):
        Etcd([etcd.url]).get("/a/k")  # no credentials on an etcd that wants them


def test_an_expired_token_is_renewed(etcd) -> None:
    enable_auth(etcd.url, "pw")
    e = Etcd([etcd.url], user="root", password="pw")
    e.put("/a/k", b"v")
    e._clients[0].session.headers["Authorization"] = "stale.token"
    assert e.get("/a/k") == b"v"


# -- fleet events (store) -----------------------------------------------------------------


def put(e: Etcd, cluster: str, rec: EndpointRecord) -> None:
    """Register ``rec`` as an endpoint's registrar does (membership and load, one transaction)."""
    e.put_many(registration_writes(cluster, rec))


def test_put_many_is_one_revision_and_count_prefix(etcd) -> None:
    e = Etcd([etcd.url])
    rev = e.put_many([("/m/a", b"1"), ("/m/b", b"2")])
    kvs, now = e.get_prefix("/m/")
    assert kvs == [("/m/a", b"1"), ("/m/b", b"2")] and now == rev
    assert e.count_prefix("/m/") == 2 and e.count_prefix("/none/") == 0


def test_diff_and_apply_are_the_fleet_events() -> None:
    a1, a2 = record("h:1"), record("h:1", incarnation="i2")
    b, b_load = record("h:2"), record("h:2", free=3)
    known = {"h:1": a1, "h:2": b}
    now = {"h:1": a2, "h:2": b_load, "h:3": record("h:3")}
    assert [(ev.kind, ev.address) for ev in diff(known, now)] == [
        ("restart", "h:1"),
        ("update", "h:2"),
        ("join", "h:3"),
    ]
    assert [(ev.kind, ev.address) for ev in diff(now, {"h:1": a2})] == [
        ("leave", "h:2"),
        ("leave", "h:3"),
    ]
    assert diff(known, dict(known)) == []
    c = "c"
    mk, lk = member_key(c, "h:1"), load_key(c, "h:1")
    k: dict[str, EndpointRecord] = {}
    loads: dict[str, Any] = {}
    # the load key first (a registration's transaction may be read in either order)
    assert apply(k, loads, c, WatchEvent("PUT", lk, encode_load(a1), 5)) is None
    ev = apply(k, loads, c, WatchEvent("PUT", mk, encode_member(a1), 5))
    assert ev == FleetEvent("join", "h:1", a1, None)  # joined with its load summary
    assert apply(k, loads, c, WatchEvent("PUT", mk, encode_member(a1), 6)) is None  # no change
    a1_busy = record("h:1", free=7)
    ev = apply(k, loads, c, WatchEvent("PUT", lk, encode_load(a1_busy), 7))
    assert ev == FleetEvent("update", "h:1", a1_busy, a1)  # a load summary: an update
    stale = record("h:1", incarnation="old", free=1)
    assert apply(k, loads, c, WatchEvent("PUT", lk, encode_load(stale), 8)) is None
    ev = apply(k, loads, c, WatchEvent("PUT", mk, encode_member(a2), 9))
    assert ev is not None and ev.kind == "restart" and ev.previous == a1_busy
    assert ev.record is not None and ev.record.load == Load()  # no summary of i2 yet
    assert apply(k, loads, c, WatchEvent("PUT", member_key(c, "h:9"), b"garbage", 10)) is None
    assert apply(k, loads, c, WatchEvent("DELETE", lk, b"", 11)) is None  # the member says
    ev = apply(k, loads, c, WatchEvent("DELETE", mk, b"", 12))
    assert ev is not None and (ev.kind, ev.record, k) == ("leave", None, {})
    assert ev.previous is not None and ev.previous.incarnation == "i2"
    assert apply(k, loads, c, WatchEvent("DELETE", mk, b"", 13)) is None


def test_list_and_watch_endpoints(etcd) -> None:
    e = Etcd([etcd.url])
    put(e, "c1", record("h:2"))
    put(e, "c1", record("h:1", free=5))
    e.put(member_key("c1", "h:bad"), b"{not json")
    put(e, "c2", record("h:9"))
    recs, _ = list_endpoints(e, "c1")
    assert [r.address for r in recs] == ["h:1", "h:2"]  # sorted, the bad one skipped
    assert recs[0].load.free_blocks == 5  # membership joined with its load summary
    assert list_endpoints(e, "c1", load=False)[0][0].load == Load()  # membership alone
    listing = read_cluster(e, "c1")
    received: list[int] = []
    events, cancel = watch_endpoints(e, "c1", listing, on_events=received.append)
    c = Collector(events)
    e.put_many(load_writes("c1", record("h:1", free=1)))
    put(e, "c1", record("h:2", incarnation="i9"))
    e.delete(member_key("c1", "h:1"))
    put(e, "c1", record("h:3"))
    put(e, "c2", record("h:8"))  # other cluster: not seen
    c.wait_for(lambda it: len(it) >= 4)
    cancel()
    assert [(ev.kind, ev.address) for ev in c.items] == [
        ("update", "h:1"),
        ("restart", "h:2"),
        ("leave", "h:1"),
        ("join", "h:3"),
    ]
    assert set(listing.records) == {"h:2", "h:3"}
    assert sum(received) >= 6  # every etcd event counted (a registration is two)


def test_a_membership_watch_receives_no_load_summary(etcd) -> None:
    """Layout v2's point: load writes never reach a watcher of membership (an endpoint's own
    peer watch), however often they come; membership changes still do."""
    e = Etcd([etcd.url])
    put(e, "m", record("h:1"))
    received: list[int] = []
    follow = Follow(Etcd([etcd.url]), "m", load=False, on_events=received.append)
    c = Collector(iter(follow))
    c.wait_for(lambda it: len(it) == 1)
    for i in range(50):
        e.put_many(load_writes("m", record("h:1", free=i)))
    put(e, "m", record("h:2"))
    c.wait_for(lambda it: len(it) == 2)
    follow.cancel()
    c.thread.join(10)
    assert [(ev.kind, ev.address) for ev in c.items] == [("join", "h:1"), ("join", "h:2")]
    assert sum(received) == 1  # h:2's membership key: none of the 50 load writes


def test_follow_survives_an_etcd_outage_and_reports_what_it_missed(etcd) -> None:
    e = Etcd([etcd.url], timeout_s=1.0)
    put(e, "f", record("h:1"))
    put(e, "f", record("h:2"))
    follow = Follow(Etcd([etcd.url], timeout_s=1.0), "f", retry_s=0.2)
    c = Collector(iter(follow))
    c.wait_for(lambda it: len(it) == 2)
    assert [(ev.kind, ev.address) for ev in c.items] == [("join", "h:1"), ("join", "h:2")]
    etcd.stop()
    c.wait_for(lambda it: it[-1].kind == "registry_down")
    etcd.start()
    e.delete(member_key("f", "h:1"))  # happens before the follower's next listing or after
    put(e, "f", record("h:3"))
    c.wait_for(lambda it: {"h:1", "h:3"} <= {ev.address for ev in it[3:]})
    follow.cancel()
    c.thread.join(10)
    assert not c.thread.is_alive() and c.error is None
    kinds = [(ev.kind, ev.address) for ev in c.items[2:]]
    assert kinds[0] == ("registry_down", "")
    assert ("registry_up", "") in kinds
    assert ("leave", "h:1") in kinds and ("join", "h:3") in kinds
    assert [ev.kind for ev in c.items].count("registry_down") == 1  # said once per change
    assert set(follow.known) == {"h:2", "h:3"}


def test_a_seeded_follow_reports_only_what_changed(etcd) -> None:
    e = Etcd([etcd.url])
    put(e, "s", record("h:1"))
    recs, _ = list_endpoints(e, "s")
    follow = Follow(Etcd([etcd.url]), "s", known={r.address: r for r in recs})
    c = Collector(iter(follow))
    put(e, "s", record("h:2"))
    c.wait_for(lambda it: len(it) >= 1)
    follow.cancel()
    assert [(ev.kind, ev.address) for ev in c.items] == [("join", "h:2")]


# -- TLS --------------------------------------------------------------------------------------


def test_tls_with_a_client_certificate(tls_etcd, monkeypatch) -> None:
    import certifi

    # requests lets this variable override a session's CA (psf/requests #3829): kvpush must not.
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", certifi.where())
    pki = tls_etcd.pki
    e = Etcd(
        [tls_etcd.url], ca_cert=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key)
    )
    e.put("/tls/k", b"v")
    assert e.get("/tls/k") == b"v"
    events, cancel = e.watch_prefix("/tls/")
    c = Collector(events)
    e.delete("/tls/k")
    c.wait_for(lambda it: len(it) == 1)
    cancel()
    with pytest.raises(RegistryUnavailable, match=r"refused this client \(check --registry-cert"):
        Etcd([tls_etcd.url], ca_cert=str(pki.ca), timeout_s=2).get("/tls/k")
    with pytest.raises(RegistryUnavailable, match=r"not trusted \(check --registry-ca\)"):
        Etcd([tls_etcd.url], timeout_s=2).get("/tls/k")


def test_endpoints_of_layout_v1_are_counted_and_named_not_read(etcd) -> None:
    """An older kvpush's keys (layout v1) are not read; the tools say how many there are."""
    from kvpush.commands.common.registry import RegistrySource

    e = Etcd([etcd.url])
    put(e, "mix", record("h:2"))
    e.put("/kvpush/v1/clusters/mix/endpoints/h:1", b"{}")
    src = RegistrySource(etcd.url, "mix")
    assert [r.address for r in src.list()] == ["h:2"]
    note = src.v1_note()
    assert note.startswith("1 endpoint(s) of cluster 'mix'") and "/kvpush/v1/" in note
    assert src.open() is src.open()  # one client per process
    assert RegistrySource(etcd.url, "other").v1_note() == ""

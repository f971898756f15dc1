"""etcd access for the fleet: failover across client URLs, bounded calls, typed errors.

Owns the HTTP(S) sessions to etcd's JSON gateway (``/v3/``, etcd >= 3.4), spoken through
``etcd3gw`` (no grpc, no protobuf: the ``etcd3`` 0.12 client fails to import with protobuf >= 4).
``Etcd`` is called by whichever thread owns it (the registrar's, the watcher's, a CLI command's);
unary calls are serialised by a lock, so sharing one between threads is safe but makes them wait
on each other. A watch runs on a session of its own and is cancelled from any thread; its
stream (opened, read, shut) is ``kvpush.fleet.watchstream``'s.

Failure model (every call is bounded):
- every request has a deadline (``timeout_s``); a URL that does not answer, refuses the
  connection or answers 503 (no leader) is skipped and the next URL is tried; when none answers
  the call raises ``RegistryUnavailable``. The URL that answered last is tried first next time.
- etcd answering with an error raises ``RegistryError`` (``LeaseLost`` for a lease that is gone,
  ``WatchCompacted`` for a watch from a compacted revision).
- with ``user``/``password`` the client authenticates (``/v3/auth/authenticate``) per URL and
  authenticates again once when etcd says the token is invalid (simple tokens expire). The
  password is kept in this object only: never logged, never in ``repr``.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TypedDict, TypeVar, cast
from urllib.parse import urlsplit

import requests
from etcd3gw import exceptions as etcd_exc
from etcd3gw.client import Etcd3Client

from kvpush.errors import (
    ConfigError,
    LeaseLost,
    RegistryError,
    RegistryUnavailable,
)
from kvpush.fleet.config import RegistryConfig, parse_urls
from kvpush.fleet.watchstream import WatchEvent, open_stream, read_events, shutdown

__all__ = ["Etcd", "WatchEvent", "make_etcd", "parse_urls", "prefix_end"]

log = logging.getLogger(__name__)

API_PATH = "/v3/"
T = TypeVar("T")


class _Header(TypedDict):
    revision: str  # etcd's gateway writes int64s as strings


class _KeyValue(TypedDict, total=False):
    key: str
    value: str  # absent for an empty value


class _Range(TypedDict, total=False):
    """The gateway's answer to ``/kv/range`` (what kvpush reads of it)."""

    header: _Header
    kvs: list[_KeyValue]


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix`` (last byte + 1)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return "\0"
    raw[-1] += 1
    return raw.decode("latin-1")


def _detail(e: etcd_exc.Etcd3Exception) -> str:
    """etcd's own message out of a gateway error body (JSON with 'error'/'message')."""
    text = e.detail_text or ""
    try:
        body = json.loads(text)
        if isinstance(body, dict):
            return str(body.get("message") or body.get("error") or text)
    except ValueError:
        pass
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


_UNAVAILABLE = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    requests.exceptions.RequestException,
    OSError,
)

# etcd errors that mean "this member cannot serve now" (no leader, raft timeout): try the next URL
_TRANSIENT = (
    "no leader",
    "request timed out",
    "leader changed",
    "too many requests",
    "not capable",
)


class Etcd:
    """An etcd client over one or more client URLs (see the module docstring)."""

    def __init__(
        self,
        urls: list[str] | str,
        *,
        user: str | None = None,
        password: str | None = None,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        if (cert is None) != (key is None):
            raise ConfigError(
                "a TLS client certificate needs its key (and the key its certificate)",
                "give both --registry-cert and --registry-key",
            )
        if (user is None) != (password is None):
            raise ConfigError(
                "etcd authentication needs a user and a password",
                "give both --registry-user and --registry-password-file",
            )
        self.urls = parse_urls(urls)
        self.user = user
        self._password = password
        self._ca_cert = ca_cert
        self._cert = cert
        self._key = key
        self.timeout_s = timeout_s
        self._clients = [self._client(u) for u in self.urls]
        self._authed = [False] * len(self._clients)
        self._current = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        who = f" user={self.user!r}" if self.user else ""
        return f"Etcd({','.join(self.urls)}{who})"

    # -- plumbing ------------------------------------------------------------------------

    def _client(self, url: str) -> Etcd3Client:
        u = urlsplit(url)
        assert u.hostname is not None and u.port is not None
        return _Client(
            host=u.hostname,
            port=u.port,
            protocol=u.scheme,
            ca_cert=self._ca_cert,
            cert_cert=self._cert,
            cert_key=self._key,
            timeout=self.timeout_s,
            api_path=API_PATH,
        )

    def _authenticate(self, i: int) -> None:
        c = self._clients[i]
        c.session.headers.pop("Authorization", None)
        try:
            body = c.post(
                c.get_url("/auth/authenticate"),
                json={"name": self.user, "password": self._password},
            )
        except etcd_exc.Etcd3Exception as e:
            if isinstance(e, _UNAVAILABLE):
                raise
            raise RegistryError(
                f"etcd at {self.urls[i]} refused user {self.user!r}: {_detail(e)}",
                "check --registry-user and the password in --registry-password-file",
            ) from None
        c.session.headers["Authorization"] = str(body["token"])
        self._authed[i] = True

    def _on(self, i: int, fn: Callable[[Etcd3Client], T]) -> T:
        if self._password is not None and not self._authed[i]:
            self._authenticate(i)
        try:
            return fn(self._clients[i])
        except etcd_exc.Etcd3Exception as e:
            if isinstance(e, _UNAVAILABLE) or self._password is None:
                raise
            if "token" not in _detail(e) and "user name is empty" not in _detail(e):
                raise
            self._authenticate(i)  # token expired: once more with a fresh one
            return fn(self._clients[i])

    def _call(self, what: str, fn: Callable[[Etcd3Client], T]) -> T:
        """``fn`` on the first URL that answers, starting with the one that answered last."""
        last = ""
        with self._lock:
            n = len(self._clients)
            for step in range(n):
                i = (self._current + step) % n
                try:
                    out = self._on(i, fn)
                except _UNAVAILABLE as e:
                    last = f"{self.urls[i]}: {_reason(e)}"
                    continue
                except etcd_exc.Etcd3Exception as e:
                    detail = _detail(e)
                    if any(k in detail for k in _TRANSIENT):
                        last = f"{self.urls[i]}: {detail}"
                        continue
                    if "lease not found" in detail:
                        raise LeaseLost(f"etcd {what}: {detail}") from None
                    raise RegistryError(f"etcd {what} failed at {self.urls[i]}: {detail}") from None
                self._current = i
                return out
        raise RegistryUnavailable(
            f"registry unavailable: no etcd URL answered {what} "
            f"({self.timeout_s:g}s per URL; last: {last})"
        )

    # -- key/value -----------------------------------------------------------------------

    def get_prefix(self, prefix: str) -> tuple[list[tuple[str, bytes]], int]:
        """Every (key, value) under ``prefix`` sorted by key, and the store's revision then."""

        def rng(c: Etcd3Client) -> _Range:
            return cast(
                _Range,
                c.post(
                    c.get_url("/kv/range"),
                    json={"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))},
                ),
            )

        body = self._call("range", rng)
        kvs = [
            (_unb64(kv["key"]).decode(errors="replace"), _unb64(kv.get("value", "")))
            for kv in body.get("kvs", [])
        ]
        kvs.sort()
        return kvs, int(body["header"]["revision"])

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, None when absent."""

        def rng(c: Etcd3Client) -> _Range:
            return cast(_Range, c.post(c.get_url("/kv/range"), json={"key": _b64(key)}))

        kvs = self._call("get", rng).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Write ``key``; with ``lease`` the key goes when the lease does. The new revision."""
        payload: dict[str, str] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            payload["lease"] = str(lease)
        body = self._call("put", lambda c: c.post(c.get_url("/kv/put"), json=payload))
        return int(body["header"]["revision"])

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        body = self._call(
            "delete", lambda c: c.post(c.get_url("/kv/deleterange"), json={"key": _b64(key)})
        )
        return int(body.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key under ``prefix``; how many there were."""
        payload = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        body = self._call("delete", lambda c: c.post(c.get_url("/kv/deleterange"), json=payload))
        return int(body.get("deleted", 0))

    # -- leases --------------------------------------------------------------------------

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        body = self._call(
            "lease grant",
            lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": int(ttl), "ID": 0}),
        )
        return int(body["ID"])

    def refresh(self, lease: int) -> int:
        """Keep ``lease`` alive; the TTL it has now, 0 when it is gone (expired or revoked)."""
        body = self._call(
            "lease keepalive",
            lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": str(lease)}),
        )
        return max(0, int(body.get("result", {}).get("TTL", 0)))

    def revoke(self, lease: int) -> bool:
        """Revoke ``lease`` (its keys go at once); False when it was already gone."""
        try:
            self._call(
                "lease revoke",
                lambda c: c.post(c.get_url("/lease/revoke"), json={"ID": str(lease)}),
            )
        except LeaseLost:
            return False
        return True

    def health(self) -> bool:
        """Whether some URL answers (a range of one absent key); never raises."""
        try:
            self.get("/kvpush/health-probe")
        except (RegistryUnavailable, RegistryError):
            return False
        return True

    # -- watch ---------------------------------------------------------------------------

    def watch_prefix(
        self, prefix: str, start_revision: int | None = None
    ) -> tuple[Iterator[WatchEvent], Callable[[], None]]:
        """Changes under ``prefix`` from ``start_revision`` on (the revision after a listing's,
        so nothing is missed between the two), and a ``cancel`` callable for any thread.

        The iterator blocks for the next change; it ends after ``cancel()`` and raises
        ``RegistryUnavailable`` when the stream breaks (etcd gone: list again and watch anew),
        ``WatchCompacted`` when ``start_revision`` is history etcd no longer keeps. Opening the
        watch is bounded by ``timeout_s`` per URL and fails over like every other call.
        """
        create: dict[str, str] = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        if start_revision is not None:
            create["start_revision"] = str(start_revision)
        state: dict[str, bool] = {"cancelled": False}

        resp = self._call(
            "watch", lambda c: open_stream(c, create, self.timeout_s, _verify(c).get("verify"))
        )

        def cancel() -> None:
            state["cancelled"] = True
            shutdown(resp)

        def events() -> Iterator[WatchEvent]:
            try:
                yield from read_events(resp, prefix)
            except Exception as e:
                if state["cancelled"]:
                    # cancel() shut the stream under the reader: whatever urllib3 raises then
                    # (an OSError, or an AttributeError once its file object is gone) is the end.
                    return
                if not isinstance(e, (requests.exceptions.RequestException, OSError, ValueError)):
                    raise
                raise RegistryUnavailable(
                    f"registry watch of {prefix} broke: {_reason(e)}",
                    "the watcher lists the prefix again and watches anew",
                ) from None
            finally:
                resp.close()
            if not state["cancelled"]:
                raise RegistryUnavailable(
                    f"registry watch of {prefix} ended (etcd closed the stream)",
                    "the watcher lists the prefix again and watches anew",
                )

        return events(), cancel


class _Client(Etcd3Client):
    """etcd3gw's client, with ``--registry-ca`` given to every request: requests lets
    ``REQUESTS_CA_BUNDLE`` / ``CURL_CA_BUNDLE`` override a session's ``verify`` (psf/requests
    #3829), so a CA set on the session alone is ignored wherever those variables are set."""

    def post(self, url: str, *args: object, json: object = None, **kwargs: object) -> object:
        return super().post(url, *args, json=json, **_verify(self), **kwargs)


class _Verify(TypedDict, total=False):
    verify: str  # the CA bundle's path


def _verify(c: Etcd3Client) -> _Verify:
    v = c.session.verify
    return _Verify(verify=v) if isinstance(v, str) else _Verify()


_TLS_REASONS = (
    ("CERTIFICATE_VERIFY_FAILED", "TLS: etcd's certificate is not trusted (check --registry-ca)"),
    ("BAD_CERTIFICATE", "TLS: etcd refused this client (check --registry-cert, --registry-key)"),
    ("CERTIFICATE_REQUIRED", "TLS: etcd wants a client certificate (--registry-cert/-key)"),
    ("WRONG_VERSION_NUMBER", "TLS to an etcd that speaks plain HTTP (use http://)"),
)


def _reason(e: BaseException) -> str:
    """A short reason for an unreachable URL (requests' messages run to several lines)."""
    text = (e.detail_text or "") if isinstance(e, etcd_exc.Etcd3Exception) else ""
    text = text or str(e)
    for key, why in _TLS_REASONS:
        if key in text:
            return why
    for key in ("Connection refused", "timed out", "Name or service not known", "No route to host"):
        if key in text:
            return key.lower()
    return (text.strip().splitlines()[0] if text.strip() else type(e).__name__)[:200]


def make_etcd(cfg: RegistryConfig) -> Etcd:
    """A client of the registry ``cfg`` names, with its credentials and call timeout."""
    return Etcd(
        cfg.urls,
        user=cfg.user,
        password=cfg.password,
        ca_cert=cfg.ca_cert,
        cert=cfg.cert,
        key=cfg.key,
        timeout_s=cfg.timeout_s,
    )

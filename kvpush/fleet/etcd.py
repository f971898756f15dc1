"""etcd access for the fleet: failover across client URLs, bounded calls, typed errors.

Owns the HTTP(S) sessions to etcd's JSON gateway (``/v3/``, etcd >= 3.4): kvpush's own small
client of it, on ``requests`` (no grpc, no protobuf; docs/fleet.md, "Why an own client"). One
``Etcd`` per process (built from one ``kvpush.fleet.config.Access``): an endpoint's registrar,
its peer watch and its NIXL-key cleaner share it; a fleet tool opens one. Unary calls are
serialised by a lock, so sharing one between threads is safe (each call is bounded, so a thread
waits at most a few seconds for another's). A watch runs on a session of its own and is
cancelled from any thread; its stream (opened, read, shut) is ``kvpush.fleet.watchstream``'s.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypedDict, TypeVar, Unpack, cast

import requests

from kvpush.errors import (
    LeaseLost,
    RegistryError,
    RegistryUnavailable,
)
from kvpush.fleet.config import Access, CredentialArgs, parse_urls
from kvpush.fleet.watchstream import (
    EtcdRefused,
    Unreachable,
    WatchEvent,
    open_stream,
    read_events,
    shutdown,
)

__all__ = ["Etcd", "WatchEvent", "parse_urls", "prefix_end"]

log = logging.getLogger(__name__)

API_PATH = "/v3"
T = TypeVar("T")
Body = dict[str, Any]


class _Header(TypedDict):
    revision: str  # etcd's gateway writes int64s as strings


class _KeyValue(TypedDict, total=False):
    key: str
    value: str  # absent for an empty value


class _Range(TypedDict, total=False):
    """The gateway's answer to ``/kv/range`` (what kvpush reads of it)."""

    header: _Header
    kvs: list[_KeyValue]
    count: str


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


def _detail(e: EtcdRefused) -> str:
    """etcd's own message out of a gateway error body (JSON with 'error'/'message')."""
    text = e.body or ""
    try:
        body = json.loads(text)
        if isinstance(body, dict):
            return str(body.get("message") or body.get("error") or text)
    except ValueError:
        pass
    return text.strip().splitlines()[0] if text.strip() else f"HTTP {e.status}"


_UNAVAILABLE = (Unreachable, requests.exceptions.RequestException, OSError)

# etcd errors that mean "this member cannot serve now" (no leader, raft timeout): try the next URL
_TRANSIENT = (
    "no leader",
    "request timed out",
    "leader changed",
    "too many requests",
    "not capable",
)


class Url:
    """One etcd client URL: its HTTP session (TLS material and token on it) and ``post``."""

    def __init__(self, url: str, access: Access) -> None:
        self.url = url
        self.base = url + API_PATH
        self.timeout_s = access.timeout_s
        self.session = requests.Session()
        # Given to every request, not only set on the session: requests lets
        # REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE override a session's ``verify`` (psf/requests
        # #3829), so a CA set on the session alone is ignored wherever those are set.
        self.verify: str | bool = access.ca_cert or True
        self.session.verify = self.verify
        if access.cert is not None and access.key is not None:
            self.session.cert = (access.cert, access.key)
        self.authed = False

    def post(self, path: str, body: Body, timeout_s: float | None = None) -> Body:
        """One call; ``Unreachable`` (no answer, 503/408/504) or ``EtcdRefused`` (etcd said
        no: its HTTP status and body)."""
        try:
            r = self.session.post(
                self.base + path,
                json=body,
                timeout=timeout_s or self.timeout_s,
                verify=self.verify,
            )
        except (requests.exceptions.RequestException, OSError) as e:
            raise Unreachable(str(e)) from None
        if r.status_code in (503, 408, 504):
            raise Unreachable(r.text or f"HTTP {r.status_code}")
        if r.status_code != 200:
            raise EtcdRefused(r.status_code, r.text)
        try:
            out = r.json()
        except ValueError:
            raise Unreachable(f"not etcd's JSON gateway: {r.text[:100]!r}") from None
        return cast(Body, out) if isinstance(out, dict) else {}


class Etcd:
    """An etcd client over one or more client URLs (see the module docstring)."""

    def __init__(
        self, access: Access | str | Sequence[str], **creds: Unpack[CredentialArgs]
    ) -> None:
        if not isinstance(access, Access):
            access = Access.of(access, **creds)
        self.access = access
        self.urls = list(access.urls)
        self.user = access.user
        self.timeout_s = access.timeout_s
        self._clients = [Url(u, access) for u in self.urls]
        self._current = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        who = f" user={self.user!r}" if self.user else ""
        return f"Etcd({','.join(self.urls)}{who})"

    # -- plumbing ------------------------------------------------------------------------

    def _authenticate(self, c: Url) -> None:
        c.session.headers.pop("Authorization", None)
        try:
            body = c.post(
                "/auth/authenticate", {"name": self.user, "password": self.access.password}
            )
        except EtcdRefused as e:
            raise RegistryError(
                f"etcd at {c.url} refused user {self.user!r}: {_detail(e)}",
                "check --registry-user and the password in --registry-password-file",
            ) from None
        c.session.headers["Authorization"] = str(body["token"])
        c.authed = True

    def _on(self, c: Url, fn: Callable[[Url], T]) -> T:
        if self.access.password is not None and not c.authed:
            self._authenticate(c)
        try:
            return fn(c)
        except EtcdRefused as e:
            if self.access.password is None:
                raise
            if "token" not in _detail(e) and "user name is empty" not in _detail(e):
                raise
            self._authenticate(c)  # token expired: once more with a fresh one
            return fn(c)

    def _call(self, what: str, fn: Callable[[Url], T]) -> T:
        """``fn`` on the first URL that answers, starting with the one that answered last."""
        last = ""
        with self._lock:
            n = len(self._clients)
            for step in range(n):
                i = (self._current + step) % n
                try:
                    out = self._on(self._clients[i], fn)
                except _UNAVAILABLE as e:
                    last = f"{self.urls[i]}: {_reason(e)}"
                    continue
                except EtcdRefused as e:
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

        def rng(c: Url) -> _Range:
            return cast(
                _Range,
                c.post("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}),
            )

        body = self._call("range", rng)
        kvs = [
            (_unb64(kv["key"]).decode(errors="replace"), _unb64(kv.get("value", "")))
            for kv in body.get("kvs", [])
        ]
        kvs.sort()
        return kvs, int(body["header"]["revision"])

    def count_prefix(self, prefix: str) -> int:
        """How many keys there are under ``prefix`` (none of them is read)."""
        body = self._call(
            "count",
            lambda c: cast(
                _Range,
                c.post(
                    "/kv/range",
                    {
                        "key": _b64(prefix),
                        "range_end": _b64(prefix_end(prefix)),
                        "count_only": True,
                    },
                ),
            ),
        )
        return int(body.get("count", 0))

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, None when absent."""

        def rng(c: Url) -> _Range:
            return cast(_Range, c.post("/kv/range", {"key": _b64(key)}))

        kvs = self._call("get", rng).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Write ``key``; with ``lease`` the key goes when the lease does. The new revision."""
        payload: dict[str, str] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            payload["lease"] = str(lease)
        body = self._call("put", lambda c: c.post("/kv/put", payload))
        return int(body["header"]["revision"])

    def put_many(self, items: Sequence[tuple[str, bytes]], lease: int | None = None) -> int:
        """Write every (key, value) of ``items`` in one transaction: one request and one
        revision (a watcher still gets one event per key); with ``lease`` the keys go when the
        lease does. At most 128 items (etcd's ``--max-txn-ops``). The new revision."""
        ops = []
        for key, value in items:
            put: dict[str, str] = {"key": _b64(key), "value": _b64(value)}
            if lease is not None:
                put["lease"] = str(lease)
            ops.append({"request_put": put})
        body = self._call("txn", lambda c: c.post("/kv/txn", {"success": ops}))
        return int(body["header"]["revision"])

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        body = self._call("delete", lambda c: c.post("/kv/deleterange", {"key": _b64(key)}))
        return int(body.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key under ``prefix``; how many there were."""
        payload = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        body = self._call("delete", lambda c: c.post("/kv/deleterange", payload))
        return int(body.get("deleted", 0))

    # -- leases --------------------------------------------------------------------------

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        body = self._call(
            "lease grant",
            lambda c: c.post("/lease/grant", {"TTL": int(ttl), "ID": 0}),
        )
        return int(body["ID"])

    def refresh(self, lease: int) -> int:
        """Keep ``lease`` alive; the TTL it has now, 0 when it is gone (expired or revoked)."""
        body = self._call(
            "lease keepalive",
            lambda c: c.post("/lease/keepalive", {"ID": str(lease)}),
        )
        return max(0, int(body.get("result", {}).get("TTL", 0)))

    def revoke(self, lease: int) -> bool:
        """Revoke ``lease`` (its keys go at once); False when it was already gone."""
        try:
            self._call(
                "lease revoke",
                lambda c: c.post("/lease/revoke", {"ID": str(lease)}),
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

        resp = self._call("watch", lambda c: open_stream(c, create, self.timeout_s))

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


_TLS_REASONS = (
    ("CERTIFICATE_VERIFY_FAILED", "TLS: etcd's certificate is not trusted (check --registry-ca)"),
    ("BAD_CERTIFICATE", "TLS: etcd refused this client (check --registry-cert, --registry-key)"),
    ("CERTIFICATE_REQUIRED", "TLS: etcd wants a client certificate (--registry-cert/-key)"),
    ("WRONG_VERSION_NUMBER", "TLS to an etcd that speaks plain HTTP (use http://)"),
)


def _reason(e: BaseException) -> str:
    """A short reason for an unreachable URL (requests' messages run to several lines)."""
    text = str(e)
    for key, why in _TLS_REASONS:
        if key in text:
            return why
    for key in ("Connection refused", "timed out", "Name or service not known", "No route to host"):
        if key in text:
            return key.lower()
    return (text.strip().splitlines()[0] if text.strip() else type(e).__name__)[:200]

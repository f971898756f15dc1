"""``Registrar``: keeps one endpoint's leased keys in etcd, on a thread of its own.

The registry is never on the data path: nothing the writer or receiver does waits for this
thread, and etcd being down at start or later changes nothing but this thread's state. The
thread's loop:

- no lease: grant one (``ttl_s``) and put the membership record and the first load summary
  under it, in one transaction (``kvpush.fleet.record.registration_writes``) -> *registered*;
- every ``ttl_s / 3``: refresh the lease; a lease that is gone (TTL 0, ``LeaseLost``: this
  process was frozen past the TTL, or etcd lost it) is granted again and the keys re-put at once;
- every ``load_period_s``: read the load summary; put the *load key* alone when the summary
  changed (or every ``LOAD_REFRESH_PERIODS`` periods). The membership key is written at
  registration and on change only (``leaving``): no watcher of membership hears of load;
- ``put_again`` (the endpoint's own watch saw its membership key deleted) writes both again;
- an etcd call that fails (``RegistryUnavailable``, ``RegistryError``) counts
  ``registry_errors``, and the thread retries with a short backoff (capped at the refresh
  period). ``registry_up`` changes -- and a log line says so -- once per change, not per error.

``leave()`` (graceful stop, called *before* the drain so routers stop sending first) stops the
thread, writes the membership record once more with ``leaving`` set (watchers then let the
endpoint's work in flight drain rather than drop it as gone) and revokes the lease, which
deletes both keys at once; when etcd cannot be reached they lapse within the TTL. A restart at
the same address simply replaces the keys (the address is the key; the new ``incarnation`` tells
watchers it restarted); revoking the old incarnation's lease cannot delete them, as they are no
longer attached to that lease. The etcd client is the process's one (``Membership`` shares it
with the peer watch), or one of its own when none is given.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import msgspec

from kvpush.errors import LeaseLost, RegistryError, RegistryUnavailable
from kvpush.fleet.config import LOAD_REFRESH_PERIODS, RegistryConfig
from kvpush.fleet.etcd import Etcd
from kvpush.fleet.record import (
    EndpointRecord,
    Load,
    encode_member,
    load_key,
    load_writes,
    member_key,
    registration_writes,
)
from kvpush.telemetry.health import Verdict
from kvpush.telemetry.names import Counter, Gauge
from kvpush.telemetry.store import Telemetry

log = logging.getLogger(__name__)

RETRY_MIN_S = 0.25


def same_load(a: Load, b: Load) -> bool:
    """Whether two summaries say the same (their time stamps aside)."""
    return msgspec.structs.replace(a, updated_at=0.0) == msgspec.structs.replace(b, updated_at=0.0)


class Registrar:
    def __init__(
        self,
        cfg: RegistryConfig,
        record: EndpointRecord,
        load: Callable[[], Load],
        telemetry: Telemetry | None = None,
        on_register: Callable[[], None] | None = None,
        etcd: Etcd | None = None,
    ) -> None:
        self.cfg = cfg
        self.key = member_key(cfg.cluster, record.address)  # what it registers: ``record``
        self.load_key = load_key(cfg.cluster, record.address)
        self._etcd = etcd if etcd is not None else Etcd(cfg.access)
        self._record = record
        self._load = load
        self._tm = telemetry
        self._on_register = on_register
        self._stop = threading.Event()
        self._poke = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self.lease: int | None = None
        self.up: bool | None = None  # None: not tried yet
        self.registered = False
        self.registered_once = False
        self.last_error = ""
        self.errors = 0
        self._last_put_load: Load | None = None
        self._periods = 0
        if telemetry is not None:
            telemetry.declare(counters=[Counter.REGISTRY_ERRORS])
            telemetry.gauge_fn(Gauge.REGISTRY_UP, lambda: 1.0 if self.up else 0.0)
            telemetry.gauge_fn(Gauge.REGISTRY_REGISTERED, lambda: 1.0 if self.registered else 0.0)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def put_again(self) -> None:
        """Write the key again at the next pass (e.g. a watcher saw it deleted)."""
        self._poke.set()

    def verdict(self) -> Verdict:
        """For ``/readyz``: ready once registered (an etcd outage after that does not make the
        endpoint unready: the registry is not on the data path; ``registry_up`` shows it)."""
        if self.registered_once:
            return Verdict(True, "ok")
        why = self.last_error or "registering"
        return Verdict(False, f"not registered in the registry yet: {why}")

    def leave(self) -> bool:
        """Stop the thread and delete the key now (revoke the lease); whether it was deleted."""
        self._stop.set()
        self._poke.set()
        self._thread.join(self.cfg.timeout_s * len(self._etcd.urls) + 1.0)
        with self._lock:
            lease, self.lease = self.lease, None
            self.registered = False
        if lease is None:
            return False
        try:
            leaving = msgspec.structs.replace(self._record, leaving=True)
            self._etcd.put(self.key, encode_member(leaving), lease=lease)
            self._etcd.revoke(lease)
        except (RegistryUnavailable, RegistryError) as e:
            log.warning(
                "registry: could not remove %s (%s); it lapses within %ds",
                self.key,
                e,
                self.cfg.ttl_s,
            )
            return False
        log.info("registry: removed %s", self.key)
        return True

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        backoff = RETRY_MIN_S
        next_refresh = next_load = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if self.lease is None:
                    self._register()
                    next_refresh = now + self.cfg.refresh_s
                    next_load = now + self.cfg.load_period_s
                else:
                    if now >= next_refresh:
                        if self._etcd.refresh(self.lease) <= 0:
                            raise LeaseLost("lease expired")
                        next_refresh = now + self.cfg.refresh_s
                    if now >= next_load or self._poke.is_set():
                        force = self._poke.is_set()
                        self._poke.clear()
                        next_load = now + self.cfg.load_period_s
                        self._maybe_put(force)
                self._went_up()
                backoff = RETRY_MIN_S
            except LeaseLost:
                with self._lock:
                    self.lease = None
                    self.registered = False
                log.warning(
                    "registry: lease of %s lost (this process was frozen past the %ds TTL, or "
                    "etcd lost it): registering again",
                    self.key,
                    self.cfg.ttl_s,
                )
                continue
            except (RegistryUnavailable, RegistryError) as e:
                self._went_down(e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.cfg.refresh_s)
                continue
            except Exception as e:  # a bug here must not end registration: say so, go on
                log.exception("registry: unexpected error (retrying)")
                self._went_down(RegistryError(f"unexpected {type(e).__name__}: {e}"))
                self._stop.wait(self.cfg.refresh_s)
                continue
            wait = max(0.0, min(next_refresh, next_load) - time.monotonic())
            self._poke.wait(wait)

    def _register(self) -> None:
        lease = self._etcd.grant(self.cfg.ttl_s)
        load = self._load()
        try:
            self._etcd.put_many(registration_writes(self.cfg.cluster, self._with(load)), lease)
        except BaseException:
            self._revoke_quietly(lease)
            raise
        with self._lock:
            if self._stop.is_set():  # leave() came while we granted: it finds no lease
                self._revoke_quietly(lease)
                return
            self.lease = lease
            self.registered = True
        self._last_put_load, self._periods = load, 0
        if self._on_register is not None:
            self._on_register()
        if self.registered_once:
            log.info("registry: registered again as %s", self.key)
        else:
            log.info("registry: registered as %s (lease TTL %ds)", self.key, self.cfg.ttl_s)
        self.registered_once = True

    def _maybe_put(self, force: bool) -> None:
        load = self._load()
        self._periods += 1
        last = self._last_put_load
        fresh = self._periods < LOAD_REFRESH_PERIODS
        if not force and last is not None and same_load(last, load) and fresh:
            return
        assert self.lease is not None
        rec = self._with(load)
        if force:  # the membership key may be gone: both again
            self._etcd.put_many(registration_writes(self.cfg.cluster, rec), self.lease)
        else:
            ((key, value),) = load_writes(self.cfg.cluster, rec)
            self._etcd.put(key, value, lease=self.lease)
        self._last_put_load, self._periods = load, 0

    def _with(self, load: Load) -> EndpointRecord:
        return msgspec.structs.replace(self._record, load=load)

    def _revoke_quietly(self, lease: int) -> None:
        with contextlib.suppress(RegistryUnavailable, RegistryError):
            self._etcd.revoke(lease)  # else it lapses by itself

    def _went_up(self) -> None:
        if self.up is not True:
            if self.up is False:
                log.info("registry: etcd reachable again (%s)", ",".join(self._etcd.urls))
            self.up = True
            self.last_error = ""

    def _went_down(self, e: RegistryUnavailable | RegistryError) -> None:
        self.errors += 1
        if self._tm is not None:
            self._tm.inc(Counter.REGISTRY_ERRORS)
        self.last_error = e.message
        if self.up is not False:
            self.up = False
            log.warning(
                "registry: %s; the endpoint serves on and registers when etcd answers (hint: %s)",
                e.message,
                e.hint,
            )

"""``drive --registry``: drive's Ps and Ds taken from the registry, and followed while it runs.

Owns ``FleetTargets``. ``initial`` lists the cluster: the Ps and Ds a drive starts with, leaving
out (with a note) an endpoint whose record is incompatible with the first P's
(``kvpush.fleet.pairs.pair_differences``) or of another wire, so that one stray registration does
not stop the run at the preflight. ``follow(driver)`` starts the *follower* thread, which iterates
``kvpush.fleet.store.Follow`` and changes the driver's rotation as the registry changes: a D (or
P) that joins -- or comes back with a new incarnation -- is added at once (the watch delivers the
PUT as etcd commits it, so it gets traffic from its worker's next request on); one whose key goes
is taken out (``Driver.remove_peer``: no new request goes there; its requests in flight finish,
or fail at once when it is dead, as drive's health monitor finds). etcd going away changes
nothing: the drive goes on with the peers it has and says so once. ``stop`` cancels the watch and
joins the thread. The driver still accounts for every request (``kvpush.ops.driver``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kvpush.config import Role
from kvpush.errors import ConfigError, PeerUnreachableError
from kvpush.fleet.pairs import format_differences, pair_differences
from kvpush.fleet.record import EndpointRecord
from kvpush.ops.fleet_source import RegistrySource
from kvpush.ops.results import DriveConfig

if TYPE_CHECKING:
    from kvpush.fleet.store import FleetEvent, Follow
    from kvpush.ops.driver import Driver

log = logging.getLogger(__name__)


class FleetTargets:
    def __init__(self, source: RegistrySource, on_event: Callable[[str], None]) -> None:
        self.source = source
        self._on_event = on_event
        self.notes: list[str] = []
        self.reference: EndpointRecord | None = None  # the first P: joiners must match it
        self._follow: Follow | None = None
        self._thread: threading.Thread | None = None
        self._driver: Driver | None = None
        self._rotation: set[str] = set()  # addresses in the driver's rotation (follower thread)

    # ------------------------------------------------------------------ start (caller's thread)
    def initial(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The Ps and Ds registered now that can work with the first P."""
        records = self.source.list()
        ps = [r for r in records if r.role == Role.PREFILL and r.wire == "kvpush"]
        if not ps:
            raise ConfigError(
                f"no kvpush prefill endpoint registered in cluster {self.source.cluster!r}",
                "start one with 'serve-prefill --registry URL', or check --cluster "
                "('kvpush fleet ls' lists the cluster)",
            )
        self.reference = ps[0]
        keep = [r for r in records if self._fits(r, at_start=True)]
        pre = tuple(r.address for r in keep if r.role == Role.PREFILL)
        dec = tuple(r.address for r in keep if r.role == Role.DECODE)
        self._rotation = {*pre, *dec}
        if not dec:
            raise ConfigError(
                f"no decode endpoint that fits {self.reference.address} is registered in "
                f"cluster {self.source.cluster!r}",
                "start one with 'serve-decode --registry URL' and the P's geometry "
                "('kvpush fleet check' names what differs)",
            )
        return pre, dec

    def preflight(self, cfg: DriveConfig, attempts: int = 3) -> DriveConfig:
        """``cfg`` with drive's preflight done (and off for the run): an endpoint that cannot be
        reached is looked up again, and one that left the registry meanwhile is dropped (a D
        stopped while the drive starts is no error); one still registered is (exit 69)."""
        from kvpush.ops.preflight import check_peers

        for attempt in range(attempts):
            try:
                check_peers(cfg)
                return replace(cfg, preflight=False)
            except PeerUnreachableError:
                if attempt == attempts - 1:
                    raise
                pre, dec = self.initial()
                if (pre, dec) == (cfg.prefill, cfg.decode):
                    raise
                self.notes.append("the registry changed while drive started: listed it again")
                cfg = replace(cfg, prefill=pre, decode=dec)
        return cfg

    def _fits(self, rec: EndpointRecord, at_start: bool) -> bool:
        ref = self.reference
        assert ref is not None
        why = ""
        if rec.wire != "kvpush":
            why = f"wire {rec.wire}"
        elif rec.address != ref.address:
            # A P is compared with the reference P as a D would be: the same geometry.
            diffs = pair_differences(ref, rec)
            why = format_differences(diffs)
        if why:
            text = f"{rec.role} {rec.address} left out: it does not fit {ref.address} ({why})"
            if at_start:
                self.notes.append(text)
            else:
                self._on_event("registry: " + text)
        return not why

    # ------------------------------------------------------------------ follower thread
    def follow(self, driver: Driver) -> None:
        from kvpush.fleet.store import Follow

        self._driver = driver
        self._follow = Follow(self.source.open(), self.source.cluster)
        self._thread = threading.Thread(target=self._run, name="drive-registry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._follow is not None
        try:
            for ev in self._follow:
                try:
                    self._apply(ev)
                except Exception:  # a bad record must not end the following
                    log.exception("drive: registry event %s of %s failed", ev.kind, ev.address)
        except Exception:
            log.exception("drive: the registry follower failed")
            self._on_event("registry follower failed: the rotation no longer follows the registry")

    def _apply(self, ev: FleetEvent) -> None:
        d = self._driver
        assert d is not None
        if ev.kind == "registry_down":
            self._on_event(f"registry unreachable ({ev.detail}): driving on with the peers known")
        elif ev.kind == "registry_up":
            self._on_event("registry reachable again: following it")
        elif ev.kind == "leave":
            self._rotation.discard(ev.address)
            if d.remove_peer(ev.address):
                role = ev.previous.role if ev.previous is not None else "endpoint"
                self._on_event(f"registry: {role} {ev.address} left: no new request goes there")
        elif ev.kind in ("join", "restart") and ev.record is not None:
            rec = ev.record
            if not self._fits(rec, at_start=False):
                return
            if rec.role == Role.DECODE:
                d.add_decode(rec.address)
            else:
                d.add_prefill(rec.address)
            if ev.kind == "restart":
                self._on_event(f"registry: {rec.role} {rec.address} restarted (new incarnation)")
            elif rec.address not in self._rotation:
                self._on_event(f"registry: {rec.role} {rec.address} joined: it takes requests")
            self._rotation.add(rec.address)

    def stop(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
        if self._thread is not None:
            self._thread.join(5.0)

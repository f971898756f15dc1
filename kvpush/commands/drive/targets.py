"""``drive --registry``: drive's Ps and Ds taken from the registry, checked, and followed.

A registry record is a hint, never proof: drive admits what it checked. Owns ``FleetTargets``:

* ``initial`` lists the cluster and keeps the records drive could drive (kvpush wire, a role,
  an address that parses); ``preflight`` contacts all of them at once (``contact_all``:
  ``CHECK_THREADS`` at a time, all within ``PREFLIGHT_BOUND_S``) and ``admission.choose``
  (pure) decides: an endpoint that answers as another role, with a pool smaller than
  ``--blocks``, another geometry than the run's reference P or a TP size that does not divide
  is *left out*; one that does not answer (a closed port, a frozen process, one still
  starting) is *pending*. Each is named once in the run's notes. Only with no P or no D
  admitted does the run stop (after listing and checking again twice).
* ``follow(driver)`` starts the *follower* thread, which iterates ``kvpush.fleet.store.Follow``
  over the cluster's membership alone (drive reads no load summary, so load writes never reach
  it; the process's one etcd client, ``RegistrySource.open``) and never blocks on an endpoint: a
  record that joins, restarts (new incarnation), comes back after its key went, or is pending
  goes to the *checker* (``due_checks.DueChecks``: ``CHECK_THREADS`` daemon threads, one check
  per address at a time), which contacts it and judges it with the driver's ``Readmission`` (the
  checks of ``-p``/``-d``'s preflight) before ``Driver.admit`` puts it into the rotation; a
  pending one is checked again after ``RETRY_FIRST_S``, doubling up to ``RETRY_MAX_S``. A peer
  drive already has that answers as a new incarnation is marked restarted (the data path's
  evidence): drive's monitor takes it out and re-checks it.
* A key that goes -- or a record that says it is ``leaving`` -- takes its endpoint out of the
  rotation (``Driver.remove_peer``): no new request goes there; requests in flight there are
  never failed on the registry's word (they finish, or fail when the data path says so). A
  peer that left and registers again is re-admitted after its check. etcd going away changes
  nothing: the drive goes on with the peers it has and says so once.

Every text made of a record or a peer's answer is shown with ``logsafe.shown`` (one printable
line). ``stop`` cancels the watch and ends the checker. Threads: ``initial``/``preflight`` on
the caller's; ``_apply`` on the follower; ``_check`` on the checker's (one lock for the
registry's view: ``_records``, ``_state``, ``_told``, ``_tries``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kvpush.commands.common.registry import RegistrySource
from kvpush.commands.common.results import DriveConfig
from kvpush.commands.drive.admission import (
    Start,
    choose,
    contact_why,
    norm,
    normalized,
    said,
    start_notes,
    unusable,
    unusable_address,
)
from kvpush.commands.drive.due_checks import DueChecks
from kvpush.commands.drive.preflight import (
    CHECK_THREADS,
    Found,
    contact_all,
    contact_wait,
    peer_metadata,
)
from kvpush.commands.drive.readmit import Checked
from kvpush.config import Role
from kvpush.errors import ConfigError, KvpushError
from kvpush.fleet.record import EndpointRecord
from kvpush.logsafe import shown

if TYPE_CHECKING:
    from kvpush.commands.drive.driver import Driver
    from kvpush.fleet.store import FleetEvent, Follow

log = logging.getLogger(__name__)

#: A pending record (no answer) is checked again after this, then twice as long each time...
RETRY_FIRST_S = 1.0
#: ... up to this.
RETRY_MAX_S = 10.0
#: At start, how often drive lists and checks again when no P or no D answers and fits.
START_ATTEMPTS = 3


# ------------------------------------------------------------------------ FleetTargets


class FleetTargets:
    def __init__(self, source: RegistrySource, on_event: Callable[[str], None]) -> None:
        self.source = source
        self._on_event = on_event
        self.notes: list[str] = []
        self.checked: Checked | None = None  # what the preflight admitted (for the driver)
        self.reference = ""  # the run's reference P: every other endpoint has its geometry
        self._cfg: DriveConfig | None = None
        self._listed: dict[str, EndpointRecord] = {}  # what initial() kept
        self._lock = threading.Lock()
        self._records: dict[str, EndpointRecord] = {}  # registered now, as last seen
        self._state: dict[str, str] = {}  # address -> in | out | pending | leaving
        self._told: dict[str, str] = {}  # address -> what was last said of it (said once)
        self._tries: dict[str, int] = {}  # address -> checks that found it not answering
        self._checks: DueChecks | None = None
        self._pending: list[EndpointRecord] = []  # not answering at start: checked again
        self._follow: Follow | None = None
        self._thread: threading.Thread | None = None
        self._driver: Driver | None = None

    # ------------------------------------------------------------------ start (caller's thread)
    def initial(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The Ps and Ds registered now that drive could drive (kvpush wire, an address that
        parses); the others are left out with a note. Nothing is contacted yet."""
        records = self.source.list(load=False)  # drive reads no load summary: membership only
        self._listed = {}
        for rec in records:
            why = unusable(rec)
            if why:
                self._leave_out_at_start(rec, why)
                continue
            rec = normalized(rec)
            self._listed[rec.address] = rec
        listed = list(self._listed.values())
        pre = tuple(r.address for r in listed if r.role == Role.PREFILL)
        dec = tuple(r.address for r in listed if r.role == Role.DECODE)
        if not pre:
            raise ConfigError(
                f"no kvpush prefill endpoint registered in cluster {self.source.cluster!r}",
                "start one with 'serve-prefill --registry URL', or check --cluster "
                "('kvpush fleet ls' lists the cluster)",
            )
        if not dec:
            raise ConfigError(
                f"no kvpush decode endpoint registered in cluster {self.source.cluster!r}",
                "start one with 'serve-decode --registry URL' and the P's geometry "
                "('kvpush fleet check' names what differs)",
            )
        return pre, dec

    def _leave_out_at_start(self, rec: EndpointRecord, why: str) -> None:
        text = shown(said("out", rec, why))
        self.notes.append(text)
        with self._lock:
            self._records[rec.address] = rec
            self._state[rec.address] = "out"
            self._told[rec.address] = text

    def preflight(self, cfg: DriveConfig, attempts: int = START_ATTEMPTS) -> DriveConfig:
        """``cfg`` with the Ps and Ds that answered and fit (and the preflight off for the run:
        it is done here, and ``checked`` holds what it found for the driver's re-checks).
        Without a P or a D that fits, the cluster is listed and checked again (one may be
        still starting); then the error of what was found (exit 69 when none answered)."""
        for attempt in range(attempts):
            records = list(self._listed.values())
            found = contact_all((r.address for r in records), cfg.auth_token, contact_wait(cfg))
            st = choose(records, found, cfg.blocks, cfg.shape)
            if st.prefill and st.decode:
                break
            if attempt == attempts - 1:
                raise self._none_fit(st, found)
            time.sleep(1.0)
            self.initial()
        self._cfg = cfg
        self.reference = st.reference
        self.checked = Checked(st.meta, st.reference)
        self.notes.extend(start_notes(st.out, st.pending))
        with self._lock:
            for a, rec in self._listed.items():
                self._records[a] = rec
                self._state[a] = "in" if a in st.meta else "out" if a in st.out else "pending"
            for kind, recs in (("out", st.out), ("pending", st.pending)):
                for a, (rec, why) in recs.items():
                    self._told[a] = shown(said(kind, rec, why))
        self._pending = [rec for rec, _ in st.pending.values()]
        return replace(cfg, prefill=tuple(st.prefill), decode=tuple(st.decode), preflight=False)

    def _none_fit(self, st: Start, found: dict[str, Found]) -> KvpushError:
        """The error of a start with no P (or no D) that answers and fits: the first one's
        own error when none of that role answered (exit 69), else what did not fit."""
        role = Role.PREFILL if not st.prefill else Role.DECODE
        recs = [r for r in self._listed.values() if r.role == role]
        if all(r.address in st.pending for r in recs):
            err = found[recs[0].address]
            assert isinstance(err, KvpushError)
            return err
        whys = [f"{a} ({why})" for a, (r, why) in (st.out | st.pending).items() if r.role == role]
        more = f"; and {len(whys) - 5} more" if len(whys) > 5 else ""
        what = f" fits {st.reference}" if role == Role.DECODE and st.reference else " fits"
        return ConfigError(
            shown(
                f"no {role} endpoint registered in cluster {self.source.cluster!r} answers "
                f"and{what}: {'; '.join(whys[:5])}{more}"
            ),
            "'kvpush fleet check' names what differs; start endpoints of one geometry, with "
            "pools of --blocks or more",
        )

    # ------------------------------------------------------------------ follower thread
    def follow(self, driver: Driver) -> None:
        from kvpush.fleet.store import Follow

        self._driver = driver
        self._checks = DueChecks(CHECK_THREADS, self._check)
        for rec in self._pending:
            self._checks.want(rec, RETRY_FIRST_S)
        self._follow = Follow(self.source.open(), self.source.cluster, load=False)
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
        """One registry event: never blocks on an endpoint (checks go to the checker)."""
        if ev.kind == "registry_down":
            self._on_event(
                shown(f"registry unreachable ({ev.detail}): driving on with the peers known")
            )
        elif ev.kind == "registry_up":
            self._on_event("registry reachable again: following it")
        elif ev.kind == "leave":
            self._gone(norm(ev.address), ev.previous, "left")
        elif ev.kind in ("join", "update", "restart") and ev.record is not None:
            self._seen(ev.address, ev.record)

    def _gone(self, address: str, previous: EndpointRecord | None, how: str) -> None:
        """``address``'s key went (``left``) or its record says it is stopping (``leaving``):
        no new request goes there, no more checks; requests in flight there go on."""
        d = self._driver
        assert d is not None and self._checks is not None
        self._checks.drop(address)
        with self._lock:
            if how == "left":
                self._records.pop(address, None)
                self._state.pop(address, None)
                self._told.pop(address, None)
            else:
                self._state[address] = "leaving"
            self._tries.pop(address, None)
            removed = not unusable_address(address) and d.remove_peer(address)
        if removed:
            role = previous.role if previous is not None else "endpoint"
            what = "left" if how == "left" else "left (its record says it is stopping)"
            self._on_event(shown(f"registry: {role} {address} {what}: no new request goes there"))

    def _seen(self, key: str, rec: EndpointRecord) -> None:
        """A record put at ``key`` (its address): checked unless drive has judged this
        incarnation of it already (a load summary's refresh; the watch's first listing of what
        the preflight saw)."""
        assert self._checks is not None
        why = unusable(rec)
        if not why:
            rec = normalized(rec)
            if norm(key) != rec.address:
                why = f"its key names {key}"
        address = rec.address
        with self._lock:
            prev = self._records.get(address)
            self._records[address] = rec
            state = self._state.get(address)
            same = prev is not None and (prev.incarnation, prev.role) == (rec.incarnation, rec.role)
        if why:
            if state != "out" or not same:
                self._settle(rec, "out", said("out", rec, why))
            return
        if rec.leaving:
            if state != "leaving":
                self._gone(address, rec, "leaving")
            return
        if same and state in ("in", "out", "pending"):
            return
        self._checks.want(rec)

    # ------------------------------------------------------------------ checker threads
    def _check(self, rec: EndpointRecord) -> float | None:
        """Contact one record's endpoint and judge it as the preflight would; admit it when it
        fits. When to check it again (None: not)."""
        d, cfg = self._driver, self._cfg
        assert d is not None and cfg is not None
        addr = rec.address
        if not self._current(rec):
            return None  # gone, or another incarnation (checked next)
        try:
            md = peer_metadata(addr, cfg.auth_token, contact_wait(cfg))
        except KvpushError as e:
            why, again = contact_why(addr, e)
            if not again:
                self._settle(rec, "out", said("out", rec, why))
                return None
            self._settle(rec, "pending", said("pending", rec, why))
            with self._lock:
                tries = self._tries[addr] = self._tries.get(addr, 0) + 1
            return min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** (tries - 1))
        with self._lock:
            self._tries.pop(addr, None)
        if md.get("role") != rec.role:
            why = f"registered as {rec.role}, it is a {md.get('role')}"
            self._settle(rec, "out", said("out", rec, why))
            return None
        ra = d.readmission
        assert ra is not None  # drive --registry always hands its preflight to the driver
        inc = str(md.get("incarnation", ""))
        known = d.health.status(addr)
        restarted = known is not None and (ra.is_new(addr, inc) or known[1] != rec.role)
        if restarted:
            # A new process behind an address drive has: what was in flight went to the old one
            # (the monitor fails it and re-checks the new one before it gets requests).
            d.health.restarted(addr)
        if known is not None and known[0] != "left":  # in the rotation: its monitor has it
            text = ""
            if restarted:
                why = ra.judge(addr, rec.role, md)
                fate = f"it does not fit {self.reference}: {why}" if why else "re-checked"
                text = f"registry: {rec.role} {addr} restarted (new incarnation): {fate}"
            self._settle(rec, "in", text)
            return None
        why = ra.fit(addr, rec.role, md)
        if why:
            self._settle(rec, "out", said("out", rec, f"it does not fit {self.reference}: {why}"))
            return None
        d.trace_join(addr)  # its clock offset, before it takes requests (drive --trace)
        with self._lock:
            if not self._current(rec, locked=True):
                return None  # its key went while it was checked
            d.admit(addr, rec.role)
            self._state[addr] = "in"
            self._told.pop(addr, None)
        how = "is registered again" if known is not None else "joined"
        self._on_event(shown(f"registry: {rec.role} {addr} {how}: it takes requests"))
        return None

    def _current(self, rec: EndpointRecord, locked: bool = False) -> bool:
        """``rec`` is what the registry holds at its address now (not gone, not replaced)."""
        if not locked:
            with self._lock:
                return self._current(rec, locked=True)
        now = self._records.get(rec.address)
        return now is not None and now.incarnation == rec.incarnation and not now.leaving

    def _settle(self, rec: EndpointRecord, state: str, text: str) -> None:
        """What drive made of ``rec``; ``text`` said once (not again while it stays the same)."""
        text = shown(text)
        with self._lock:
            if not self._current(rec, locked=True):
                return
            self._state[rec.address] = state
            say = bool(text) and self._told.get(rec.address) != text
            if say:
                self._told[rec.address] = text
        if say:
            self._on_event(text)

    def stop(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
        if self._checks is not None:
            self._checks.stop()
        if self._thread is not None:
            self._thread.join(5.0)

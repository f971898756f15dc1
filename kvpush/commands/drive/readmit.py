"""Drive's re-check of a peer that was down, before it gets traffic again; its grace window.

Owns ``Readmission``: the preflight of one peer (``kvpush.commands.drive.preflight``'s checks, for
one address): it answers a handshake request (an endpoint still *starting* answers ``not_ready`` and
stays down), has the role it was given as, a pool that holds ``--blocks``, the geometry of the
run's reference P (dtype, layout, block size, layers) and a TP size that divides or is divided by
every peer of the other role (``preflight.misfit``). What a peer that comes back must satisfy is
what the run started with, so a D restarted with other ``--layers`` mid-run never gets a request.
``fit`` is the same check of metadata fetched elsewhere (``drive --registry``'s checker, which
contacts many peers at once). It also remembers each peer's pool (``pools``) and incarnation
(``observe``, ``is_new``, ``replaced``): an answer from a new incarnation at a known address
means the peer restarted since drive last looked, and it must be re-checked before more
traffic.

Owns ``PeerGrace``: how long drive holds intake while no peer of a role is up (``--peer-grace``),
so a quick restart reads as a dip in the progress line, not the end of the run.

Threads: ``check`` and ``replaced`` run on the monitor thread of
``kvpush.commands.drive.health``; ``fit``, ``is_new`` on ``drive --registry``'s checker threads;
``observe`` and ``PeerGrace`` on any thread (one lock each).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.commands.common.reasons import Leg, starting
from kvpush.commands.common.results import DriveConfig
from kvpush.commands.drive.preflight import PREFLIGHT_TIMEOUT_S, misfit, peer_metadata
from kvpush.commands.drive.schedule import Pools
from kvpush.config import Role
from kvpush.errors import KvpushError


@dataclass(frozen=True)
class Checked:
    """What a preflight done outside the driver found (``drive --registry``): the metadata of
    every peer it admitted and the run's reference P (whose geometry joiners must have)."""

    meta: dict[str, dict[str, object]]
    reference: str


class Readmission:
    def __init__(
        self, cfg: DriveConfig, meta: dict[str, dict[str, object]], reference: str | None = None
    ) -> None:
        self._cfg = cfg
        self._lock = threading.Lock()
        self._meta = dict(meta)  # address -> the metadata it last passed the checks with
        # The run's reference geometry: the preflight's (the first P that answered), never a P
        # that was down at start and so never checked.
        if reference is None:
            reference = next((a for a in cfg.prefill if a in meta), "")
        self.reference = reference
        self._ref = dict(meta.get(reference, {}))
        self._inc: dict[str, str] = {
            a: str(m.get("incarnation", "")) for a, m in meta.items() if m.get("incarnation")
        }

    def observe(self, address: str, incarnation: str) -> bool:
        """``address`` answered as ``incarnation``: False when that is a new one (it restarted
        since it last passed the checks; it must be re-checked before more traffic)."""
        if not incarnation:
            return True
        with self._lock:
            known = self._inc.get(address)
            if known is None:
                self._inc[address] = incarnation
                return True
            return known == incarnation

    def is_new(self, address: str, incarnation: str) -> bool:
        """Whether ``incarnation`` differs from the one ``address`` last passed the checks as
        (nothing is recorded: unlike ``observe``)."""
        with self._lock:
            known = self._inc.get(address)
        return bool(incarnation) and known is not None and known != incarnation

    def replaced(self, address: str, incarnation: str, starting: bool) -> bool:
        """Whether the process answering at ``address`` is not the one that last passed the
        checks there: another incarnation, or one still starting (an endpoint that served
        never goes back to starting). Nothing is recorded."""
        if not starting:
            return self.is_new(address, incarnation)
        with self._lock:
            return address in self._inc

    def pools(self) -> Pools:
        """Each peer's pool (blocks per rank), as it last passed the checks, by role."""
        with self._lock:
            meta = dict(self._meta)
        by: dict[str, dict[str, int]] = {str(Role.PREFILL): {}, str(Role.DECODE): {}}
        for a, m in meta.items():
            n = m.get("num_blocks")
            if str(m.get("role")) in by and isinstance(n, int):
                by[str(m.get("role"))][a] = n
        return Pools(by[str(Role.PREFILL)], by[str(Role.DECODE)])

    def check(self, address: str, role: Leg) -> str:
        """The preflight of one peer: "" when it may take requests again, else why not."""
        cfg = self._cfg
        wait = min(PREFLIGHT_TIMEOUT_S, cfg.timeout_s)
        try:
            md = peer_metadata(address, cfg.auth_token, wait)
        except KvpushError as e:
            return "still starting" if starting(e) else e.message
        return self.fit(address, role, md)

    def judge(self, address: str, role: Leg, md: dict[str, object]) -> str:
        """Why ``address``, which answered with ``md``, may not take ``role``'s legs ("" when
        it may); nothing is remembered."""
        with self._lock:
            ref = dict(self._ref) or None
            others = [
                m
                for a, m in self._meta.items()
                if a != address and m.get("role") not in (role, None)
            ]
        return misfit(md, role, self._cfg.blocks, ref, others)

    def fit(self, address: str, role: Leg, md: dict[str, object]) -> str:
        """``check`` of metadata ``address`` answered with: "" (and ``md`` remembered as what it
        passed with) when it may take ``role``'s legs, else why not."""
        why = self.judge(address, role, md)
        if why:
            return why
        with self._lock:
            self._meta[address] = md
            if md.get("incarnation"):
                self._inc[address] = str(md["incarnation"])
        return ""


class PeerGrace:
    """While no peer of a role is up, requests wait up to ``grace_s`` (from when the last one
    went down) for one to come back; after that they fail with the role's reason."""

    def __init__(self, grace_s: float, any_up: Callable[[Leg], bool]) -> None:
        self.grace_s = grace_s
        self._any_up = any_up
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}

    def none_up_since(self, role: Leg) -> float | None:
        """When the role last had no peer up (None: some peer is up now)."""
        if self._any_up(role):
            with self._lock:
                self._since.pop(role, None)
            return None
        with self._lock:
            return self._since.setdefault(role, time.monotonic())

    def expired(self, role: Leg) -> bool:
        since = self.none_up_since(role)
        return since is not None and time.monotonic() - since >= self.grace_s

    def wait(self, role: Leg, stop: Callable[[], bool], tick_s: float = 0.05) -> bool:
        """Block until a peer of ``role`` is up (True), or the grace is over or ``stop()``."""
        while True:
            since = self.none_up_since(role)
            if since is None:
                return True
            if stop() or time.monotonic() - since >= self.grace_s:
                return False
            time.sleep(tick_s)

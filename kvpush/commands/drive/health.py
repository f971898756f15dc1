"""Which of drive's peers are up: the peer table, round robin over the healthy ones, liveness.

Owns ``Health``: one row per P and D endpoint (up or down, why, the requests in flight there,
when it last answered) and the *monitor* thread that keeps it true. The monitor

* connects (plain TCP) every ``TCP_EVERY_S`` to each peer that has requests in flight, and at
  once to a peer a worker reported trouble with: a refused connection marks the peer down as
  *dead* -- nothing in flight there can still succeed, so ``on_down`` fails those requests now;
* sends a peer whose requests have had no reply for ``stall_s`` a ``get_meta_msg`` that must be
  answered within ``liveness_s``, else marks it down as *silent* (frozen, partitioned): no new
  request goes there, and the ones already sent wait for their own deadline (they may still
  finish when it thaws);
* re-checks a down peer every ``recheck_s`` (TCP, then ``get_meta_msg``, then ``readmit``:
  drive's preflight of that one peer) and brings it back only when all of them pass; an endpoint
  that answers "starting" is not ready; one whose connection is refused is dead now, and what
  was still in flight there (it went down silent or shutting down) fails;
* marks down a peer that says it is shutting down (its side channel refused a request so, or
  its answer to ``get_meta_msg`` says ``stopping``): not dead -- its requests in flight end with
  its drain's answers -- and it stays down while it says so;
* marks down at once a peer a worker found answering as a new incarnation (``restarted``), or
  whose answer to the monitor's own liveness check comes from one (``replaced``: another
  incarnation, or "starting" from a peer that had passed its checks -- a serving endpoint never
  goes back to starting): its requests in flight went to the old process and fail now; it comes
  back through ``readmit``. A peer restarted at its port within one TCP look is only found so.

Only a peer with requests in flight keeps a socket of the monitor's (at most
``MONITOR_CLIENTS`` of them): an idle peer's client is closed after each look, so a thousand
registered peers cost the socket budget nothing while they are idle.

Threads: workers call ``pick``/``sent``/``replied``/``finished``/``suspect`` (under the lock);
the monitor thread owns its side-channel clients and is the only one that changes a peer's up
state (``add``/``remove``, from the registry's follower or checker threads, move a peer in or
out of the rotation). ``on_down``/``on_event`` are called on the monitor thread, outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpush.commands.common import control
from kvpush.commands.common.reasons import Leg
from kvpush.commands.common.results import DriveConfig
from kvpush.config import Role
from kvpush.errors import KvpushError
from kvpush.transport.contact import tcp_contact

if TYPE_CHECKING:
    from kvpush.transport.client import SideChannelClient

log = logging.getLogger(__name__)

TCP_EVERY_S = 0.5
TICK_S = 0.1
#: Side-channel clients the monitor keeps open (those of peers with requests in flight).
MONITOR_CLIENTS = 32
#: Why a peer found answering as another process is down (its requests in flight fail).
RESTARTED = "restarted as a new incarnation"
#: Why a peer that said it is shutting down is down (its requests in flight get their answers).
STOPPING = "shutting down"


@dataclass
class Peer:
    address: str
    role: Leg
    up: bool = True
    why: str = ""
    inflight: set[int] = field(default_factory=set)
    last_reply: float = 0.0
    last_tcp: float = 0.0
    last_liveness: float = 0.0
    last_recheck: float = 0.0
    suspect: bool = False
    left: bool = False  # out of the rotation (its registry key went): never picked, not rechecked
    restarted: bool = False  # a worker saw a new incarnation answer at this address
    stopping: bool = False  # a worker heard it say it is shutting down


OnDown = Callable[[Peer, bool, list[int]], None]


class Health:
    def __init__(
        self,
        cfg: DriveConfig,
        *,
        on_down: OnDown,
        on_event: Callable[[str], None],
        readmit: Callable[[str, Leg], str] | None = None,
        replaced: Callable[[str, str, bool], bool] | None = None,
    ) -> None:
        self.cfg = cfg  # its auth token and liveness_s, stall_s, recheck_s
        self._on_down = on_down
        self._on_event = on_event
        self._readmit = readmit
        # (address, incarnation it answered as, answered "starting"): another process than the
        # one that passed the checks (``Readmission.replaced``)
        self._replaced = replaced
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._order: dict[Leg, list[str]] = {Role.PREFILL: [], Role.DECODE: []}
        self._rr: dict[Leg, int] = {Role.PREFILL: 0, Role.DECODE: 0}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._clients: dict[str, SideChannelClient] = {}  # monitor thread only
        self._thread = threading.Thread(target=self._run, name="drive-monitor", daemon=True)

    # ------------------------------------------------------------------ workers (any thread)
    def add(self, address: str, role: Leg) -> None:
        with self._lock:
            if address not in self._peers:
                self._peers[address] = Peer(address, role, last_reply=time.monotonic())
                self._order[role].append(address)
            elif self._peers[address].left:  # back in the registry: back in the rotation
                p = self._peers[address]
                p.left, p.up, p.why, p.last_reply = False, True, "", time.monotonic()
                self._order[role].append(address)

    def remove(self, address: str) -> bool:
        """Take ``address`` out of the rotation: no new request goes there; requests in flight
        there are still watched (a dead peer's fail at once). False when it was not in it."""
        with self._lock:
            p = self._peers.get(address)
            if p is None or p.left:
                return False
            p.left = True
            self._order[p.role].remove(address)
            return True

    def pick(self, role: Leg, home: int | None = None, exclude: Collection[str] = ()) -> str | None:
        """An up peer of ``role`` not in ``exclude``: the ``home``-th one when given and up
        (a worker's own peer, so that a frozen peer holds only its own workers), else the next
        in round-robin order; None when none is left."""
        with self._lock:
            order = self._order[role]
            if not order:
                return None
            if home is not None:
                addr = order[home % len(order)]
                if self._usable(addr) and addr not in exclude:
                    return addr
            for _ in range(len(order)):
                addr = order[self._rr[role] % len(order)]
                self._rr[role] += 1
                if self._usable(addr) and addr not in exclude:
                    return addr
            return None

    def _usable(self, address: str) -> bool:
        """Up, and not found restarted or shutting down (under the lock)."""
        p = self._peers[address]
        return p.up and not p.restarted and not p.stopping

    def count(self, role: Leg) -> int:
        with self._lock:
            return len(self._order[role])

    def any_up(self, role: Leg) -> bool:
        """Whether some peer of ``role`` is up (does not move the round robin)."""
        with self._lock:
            return any(self._usable(a) for a in self._order[role])

    def down_reason(self, role: Leg) -> str:
        with self._lock:
            whys = [f"{a}: {self._peers[a].why}" for a in self._order[role]]
        return f"no {role} endpoint is up ({'; '.join(whys)})"

    def sent(self, address: str, index: int) -> bool:
        """Count ``index`` in flight at ``address``; False if the peer went down meanwhile."""
        with self._lock:
            p = self._peers[address]
            if not p.up or p.left:
                return False
            if not p.inflight:
                p.last_reply = time.monotonic()  # the stall clock starts with the first request
            p.inflight.add(index)
            return True

    def replied(self, address: str) -> None:
        with self._lock:
            self._peers[address].last_reply = time.monotonic()

    def finished(self, address: str, index: int) -> None:
        with self._lock:
            self._peers[address].inflight.discard(index)

    def suspect(self, address: str) -> None:
        """A worker could not reach ``address``: check it now."""
        with self._lock:
            self._peers[address].suspect = True
        self._wake.set()

    def down_at_start(self, address: str, why: str) -> None:
        """``address`` did not answer before the run: down from the start (nothing goes
        there), re-checked every ``recheck_s`` like a peer that died, and back when it
        answers."""
        with self._lock:
            p = self._peers[address]
            p.up, p.why, p.last_recheck = False, why, time.monotonic()

    def restarted(self, address: str) -> None:
        """A worker found a new incarnation answering at ``address``: mark it down now."""
        with self._lock:
            p = self._peers[address]
            p.restarted = p.suspect = True
        self._wake.set()

    def stopping(self, address: str) -> None:
        """A worker heard ``address`` say it is shutting down: mark it down now (not dead)."""
        with self._lock:
            p = self._peers[address]
            p.stopping = p.suspect = True
        self._wake.set()

    def status(self, address: str) -> tuple[str, Leg] | None:
        """(``up`` | ``down`` | ``left``, role) of ``address``; None when it is not known."""
        with self._lock:
            p = self._peers.get(address)
            if p is None:
                return None
            return ("left" if p.left else "up" if p.up else "down"), p.role

    def rows(self) -> list[tuple[str, Leg, bool, str, int]]:
        """(address, role, up, why, in flight) of every peer."""
        with self._lock:
            return [(p.address, p.role, p.up, p.why, len(p.inflight)) for p in self._peers.values()]

    # ------------------------------------------------------------------ monitor thread
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(self.cfg.liveness_s + 2.0)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(TICK_S)
                self._wake.clear()
                with self._lock:
                    peers = list(self._peers.values())
                for p in peers:
                    if self._stop.is_set():
                        break
                    self._check(p, time.monotonic())
        except BaseException:  # the monitor must not die silently: peers would never go down
            log.exception("drive monitor failed")
            self._on_event("peer monitor failed: peers are no longer checked (see the log)")
        finally:
            for c in self._clients.values():
                c.close()

    def _check(self, p: Peer, now: float) -> None:
        with self._lock:
            up, suspect, busy = p.up, p.suspect, bool(p.inflight)
            stalled = busy and now - p.last_reply >= self.cfg.stall_s
            p.suspect = False
        if up and p.restarted:
            self._mark_down(p, RESTARTED, dead=True)
            return
        if up and p.stopping:
            self._mark_down(p, STOPPING, dead=False)
            return
        if up:
            self._check_up(p, now, suspect=suspect, busy=busy, stalled=stalled)
            return
        if not p.left and now - p.last_recheck >= self.cfg.recheck_s:
            self._recheck_down(p, now)

    def _check_up(self, p: Peer, now: float, *, suspect: bool, busy: bool, stalled: bool) -> None:
        """A peer that is up: a TCP look when suspect or busy, a liveness check when suspect or
        stalled; down when either fails."""
        if (suspect or busy) and (suspect or now - p.last_tcp >= TCP_EVERY_S):
            p.last_tcp = now
            c = tcp_contact(p.address, self.cfg.liveness_s, look=False)
            if not c.is_zmq:
                self._mark_down(p, f"{c.detail}", dead=c.kind == "refused")
                return
        if (suspect or stalled) and now - p.last_liveness >= self.cfg.stall_s:
            p.last_liveness = now
            why = self._answers(p, up=True)
            if why == RESTARTED:
                with self._lock:
                    p.restarted = True
                self._mark_down(p, why, dead=True)
                return
            if why:
                if why == "no answer":
                    why = f"no answer to a liveness check within {self.cfg.liveness_s:g}s"
                self._mark_down(p, why, dead=False)
                return
            self.replied(p.address)

    def _recheck_down(self, p: Peer, now: float) -> None:
        """A peer that is down, due a recheck: back up when it answers as a ready endpoint (and
        is readmitted)."""
        p.last_recheck = now
        c = tcp_contact(p.address, self.cfg.liveness_s, look=False)
        if not c.is_zmq:
            if c.kind == "refused":
                self._gone(p, c.detail)
            return
        why = self._answers(p)
        if why == "no answer":
            return
        if not why and self._readmit is not None:
            why = self._readmit(p.address, p.role)
        if why:
            if why != p.why:
                self._on_event(f"{p.role} {p.address} answers but stays down: {why}")
            p.why = why
            return
        with self._lock:
            p.up, p.why, p.last_reply = True, "", time.monotonic()
            p.restarted = p.stopping = False
        self._on_event(f"{p.role} {p.address} is back up: it takes requests again")

    def _gone(self, p: Peer, why: str) -> None:
        """A peer down but not dead (silent, shutting down) now refuses connections: what is
        still in flight there can no longer be answered, and fails now."""
        with self._lock:
            inflight = sorted(p.inflight)
            p.inflight.clear()
            if inflight:
                p.why = why
        if inflight:
            self._on_event(
                f"{p.role} {p.address} is gone ({why}): "
                f"{len(inflight)} requests in flight there failed"
            )
            self._on_down(p, True, inflight)

    def _answers(self, p: Peer, up: bool = False) -> str:
        """ "" when ``p`` answers a ``get_meta_msg`` as a ready endpoint, else "no answer" or
        "still starting" (an endpoint still starting answers, but is not ready) -- or, for a
        peer that is ``up``, ``RESTARTED`` when another process answers (``replaced``). The
        client is kept for the next look only while ``p`` has requests in flight."""
        c = self._clients.pop(p.address, None)
        if c is None:
            c = control.connect(p.address, self.cfg.auth_token, self.cfg.liveness_s)
        try:
            ident = c.identify(timeout_s=self.cfg.liveness_s)
        except KvpushError:
            why = "no answer"
        else:
            kv = ident.payload.kvpush
            starting = kv is not None and kv.error == "starting"
            why = "still starting" if starting else ""
            if kv is not None and kv.stopping:
                why = STOPPING
            replaced = self._replaced
            if up and kv is not None and replaced and replaced(p.address, kv.incarnation, starting):
                why = RESTARTED
        with self._lock:
            busy = bool(p.inflight)
        if busy and len(self._clients) < MONITOR_CLIENTS:
            self._clients[p.address] = c
        else:
            c.close()
        return why

    def _mark_down(self, p: Peer, why: str, dead: bool) -> None:
        with self._lock:
            if not p.up:
                return
            p.up, p.why = False, why
            p.last_recheck = time.monotonic()
            held = len(p.inflight)
            inflight = sorted(p.inflight) if dead else []
            if dead:
                p.inflight.clear()
        if dead:
            fate = f"{held} requests in flight there failed"
        elif why == STOPPING:
            fate = f"{held} requests already sent there end with its drain"
        else:
            fate = f"{held} requests already sent there wait for their deadline"
        self._on_event(f"{p.role} {p.address} is down ({why}): {fate}; new requests avoid it")
        self._on_down(p, dead, inflight)

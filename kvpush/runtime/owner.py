"""``OwnerThread``: the one loop that both P's writer and D's receiver run on.

An owner thread owns its role's side of a NIXL agent (posting WRITEs, sending and polling
notifications, polling transfers) and the role's per-transfer state; no other thread touches
either. Other threads hand it work through bounded *inboxes* (``inbox()``), all sharing one
wake event, so a put wakes the owner at once.

One pass (``run_once``): drain every inbox in registration order (each item through its handler;
an unexpected error is handed to that inbox's ``on_error``, which fails the item, never the
thread), run the hand-offs that could not be queued (``hand_off``'s last resort: a request is
never lost because an inbox was full or closed), let the role ``poll`` (notifications, in-flight
WRITEs), and every ``housekeeping_s`` run the role's housekeeping. The role's gauges are
published after a busy pass or a housekeeping one. Then ``IdleWaiter`` decides how long to
sleep: none after a busy pass, one yield of the CPU while only work in flight is pending (a
WRITE), a brief spin after activity, then back off when idle.

Gauges are published by the owner into an immutable mapping (``published``) that telemetry
reads from any thread: readers never iterate the owner's live containers.

Lifecycle: ``start()`` runs the role's ``on_start`` on the new thread and returns once the loop
runs, or re-raises its start-up error. ``stop(drain_s)`` stops intake and lets the role ``drain``
(finish or fail in-flight work) until the deadline; the first failure of the loop is kept in
``failure`` for the endpoint to surface, after the role's ``abort`` failed everything it held
(its requests answered at once, with the reason) -- a dead loop never leaves a request waiting.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, Protocol, TypeVar

from kvpush.config import AgentConfig
from kvpush.errors import AuthError, KvpushError, ProtocolError
from kvpush.ratelog import RateLimitedLog
from kvpush.runtime.inbox import Inbox
from kvpush.telemetry.heartbeat import Heartbeat
from kvpush.telemetry.names import Counter, Failure
from kvpush.telemetry.store import Telemetry
from kvpush.transport.agent import Agent, TransferError
from kvpush.wire import protocol
from kvpush.wire.notifs import Codec

log = logging.getLogger(__name__)

T = TypeVar("T")

HOUSEKEEPING_S = 0.02


class RankCrash(BaseException):
    """Raised by the fault hook ``Instruments.crash_rank_after`` (tests only). Not an
    ``Exception``: the per-item handlers that keep the loop alive must not catch it."""


class OwnerLoop(Protocol):
    """What a role gives the owner thread."""

    def on_start(self) -> None:
        """On the owner thread, before the first pass (e.g. prepare local descriptors)."""

    def poll(self) -> int:
        """Notifications and in-flight transfers; how many events were handled."""

    def pending(self) -> bool:
        """Whether work is in flight (the owner keeps spinning)."""

    def housekeeping(self, now: float) -> None:
        """Deadlines, leases, heartbeats, idle peers (every ``housekeeping_s``)."""

    def gauges(self) -> dict[str, float]:
        """Queue depths for telemetry, computed on the owner thread."""

    def drain(self, deadline: float) -> None:
        """After stop: finish or fail in-flight work until ``deadline`` (monotonic)."""

    def abort(self, error: BaseException) -> None:
        """The loop died of ``error`` (on the owner thread, which ends after this): fail
        everything the role holds, at once, with a reason that names the failure."""


class _Drained(Protocol):
    """One inbox with its handlers, whatever its item type (``_Route[T]``)."""

    def drain(self) -> int: ...

    def close(self) -> list[object]: ...


@dataclass(frozen=True)
class _Route(Generic[T]):
    inbox: Inbox[T]
    handle: Callable[[T], None]
    on_error: Callable[[T, Exception], None]

    def drain(self) -> int:
        n = 0
        for item in self.inbox.drain():
            n += 1
            try:
                self.handle(item)
            except Exception as e:
                self.on_error(item, e)
        return n

    def close(self) -> list[object]:
        return list(self.inbox.close())


class OwnerThread:
    def __init__(
        self,
        name: str,
        agent_cfg: AgentConfig,
        *,
        housekeeping_s: float = HOUSEKEEPING_S,
    ) -> None:
        self.name = name
        self.wake = threading.Event()
        self._routes: list[_Drained] = []
        self._last_resort: deque[Callable[[], None]] = deque()
        self._loop: OwnerLoop | None = None
        self._waiter = IdleWaiter(self.wake, agent_cfg)
        self._hk_s = housekeeping_s
        self._next_hk = 0.0
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._drain_deadline = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.failure: BaseException | None = None
        # Why the loop is being stopped, when not a plain shutdown (the role's drain fails its
        # work with this reason): e.g. another rank of the endpoint failed.
        self.stop_reason: tuple[Failure, str] | None = None
        self.gauge_names: tuple[str, ...] = ()
        self.published: Mapping[str, float] = MappingProxyType({})
        # Progress for the freeze watchdog (kvpush.runtime.watchdog): bumped on every pass.
        self.heartbeat = Heartbeat(name)

    # ------------------------------------------------------------------ set-up (caller thread)
    def attach(self, loop: OwnerLoop) -> None:
        self._loop = loop
        first = loop.gauges()
        self.gauge_names = tuple(first)
        self.published = MappingProxyType(first)

    def inbox(
        self,
        name: str,
        maxlen: int,
        handle: Callable[[T], None],
        on_error: Callable[[T, Exception], None],
    ) -> Inbox[T]:
        """A bounded inbox drained on every pass, in the order inboxes were made."""
        box: Inbox[T] = Inbox(name, maxlen, self.wake)
        self._routes.append(_Route(box, handle, on_error))
        return box

    def export_gauges(self, telemetry: Telemetry) -> None:
        """Let ``telemetry`` read the loop's gauges from what the owner last published."""
        for name in self.gauge_names:
            telemetry.gauge_fn(name, functools.partial(_published, self, name))

    # ------------------------------------------------------------------ any thread
    def hand_off(self, inbox: Inbox[T], item: T, fallback: Callable[[BaseException], None]) -> None:
        """Queue ``item``; if even that fails (full, closed, a bug), the owner runs
        ``fallback(error)`` on its next pass instead: nothing handed off is lost silently."""
        try:
            inbox.put(item)
        except BaseException as e:
            self._last_resort.append(functools.partial(fallback, e))
            self.wake.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 10.0) -> None:
        """Return once the loop runs; re-raise the role's start-up error."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise KvpushError(f"{self.name} did not start within {timeout_s:g}s")
        if self._start_error is not None:
            raise self._start_error

    def stop(self, drain_s: float) -> None:
        """Stop intake, let the role drain until ``drain_s`` from now, join the thread."""
        self._drain_deadline = time.monotonic() + drain_s
        self._stopping.set()
        self.wake.set()
        if self._thread.is_alive():
            self._thread.join(drain_s + 5)

    def close_inboxes(self) -> list[object]:
        """Close every inbox; return what was still queued (for the role to fail)."""
        rest: list[object] = []
        for r in self._routes:
            rest.extend(r.close())
        return rest

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        loop = self._loop
        assert loop is not None, "attach() a loop before start()"
        try:
            loop.on_start()
        except BaseException as e:
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        self.heartbeat.start()
        try:
            while not self._stopping.is_set():
                busy = self.run_once()
                self._waiter.wait(busy, not busy and loop.pending())
            # The drain may wait for in-flight work until its deadline: not a stall until then.
            self.heartbeat.allow_until(self._drain_deadline)
            loop.drain(self._drain_deadline)
        except BaseException as e:  # surfaced through Endpoint.failure()
            self.failure = e
            log.exception("%s failed", self.name)
            self._stopping.set()
            try:
                loop.abort(e)  # nothing it held may wait for a thread that is gone
            except BaseException:
                log.exception("%s: failing its work after the failure failed too", self.name)
        finally:
            self.heartbeat.park()

    def run_once(self) -> bool:
        """One pass; True when anything was handled. Tests step the loop with it."""
        loop = self._loop
        assert loop is not None
        self.heartbeat.beat()
        n = 0
        for r in self._routes:
            n += r.drain()
        while self._last_resort:
            self._last_resort.popleft()()
            n += 1
        n += loop.poll()
        now = time.monotonic()
        hk = now >= self._next_hk
        if hk:
            self._next_hk = now + self._hk_s
            loop.housekeeping(now)
        if hk or n:
            self.published = MappingProxyType(loop.gauges())
        return n > 0

    def force_housekeeping(self) -> None:
        """Let the next pass run housekeeping whatever the time (tests)."""
        self._next_hk = 0.0


def _published(owner: OwnerThread, name: str) -> float:
    return owner.published.get(name, 0.0)


#: An owner idle this long (no item, notification or completion) polls ``DEEP_IDLE_FACTOR``
#: times less often: an endpoint nobody uses costs 0.5 % of a core instead of 5 % (measured:
#: README "What an idle endpoint costs"), and the first notification after a quiet second
#: waits at most ``DEEP_IDLE_FACTOR`` x ``--idle-poll-max-us`` (10 ms by default) longer.
#: Inbox items (requests, finished blocks) wake the owner at once whatever the tier.
DEEP_IDLE_S = 1.0
DEEP_IDLE_FACTOR = 10


class IdleWaiter:
    """Adaptive wait for a polling owner thread: spin briefly after activity, then sleep
    doubling up to ``--idle-poll-max-us``, and after ``DEEP_IDLE_S`` of nothing up to
    ``DEEP_IDLE_FACTOR`` times that."""

    def __init__(self, wake: threading.Event, cfg: AgentConfig) -> None:
        self.wake = wake
        self.spin_s = cfg.busy_spin_us / 1e6
        self.max_s = cfg.idle_poll_max_us / 1e6
        self.deep_max_s = self.max_s * DEEP_IDLE_FACTOR
        self.min_s = min(50e-6, self.max_s)
        self._sleep = self.min_s
        self._last_busy = time.monotonic()

    def wait(self, busy: bool, pending: bool = False) -> None:
        """After a pass: ``busy`` (it handled something): go again at once; ``pending`` (only
        work in flight, e.g. WRITEs): go again after yielding the CPU once (``sleep(0)``), so
        that polling a WRITE never starves the peer process or this one's other threads on a
        small host (P's writer CPU per push -18 % at 64 in flight on 2 cores, same rate)."""
        now = time.monotonic()
        if busy or pending:
            self._last_busy = now
            self._sleep = self.min_s
            if pending:
                time.sleep(0)
            return
        quiet = now - self._last_busy
        if quiet < self.spin_s:
            time.sleep(0)  # yield the GIL to handshake / side-channel threads
            return
        if self.wake.wait(self._sleep):
            self._sleep = self.min_s
        else:
            cap = self.deep_max_s if quiet >= DEEP_IDLE_S else self.max_s
            self._sleep = min(self._sleep * 2, cap)
        self.wake.clear()


def drain_notifications(
    agent: Agent,
    codec: Codec,
    telemetry: Telemetry,
    rl: RateLimitedLog,
    handle: Callable[[str, protocol.Notif], None],
) -> int:
    """Fetch every pending notification, decode each and hand it to ``handle`` (owner thread).

    One place counts and logs each rejection kind: unauthenticated (``auth_rejected``),
    malformed or oversized (``malformed_notif``), a handler bug (``internal_error``). No input
    can raise out of here. Returns how many notifications were seen.
    """
    try:
        notifs = agent.get_notifs()
    except TransferError as e:
        rl.warning("notifs", "get_new_notifs failed: %s", e)
        return 0
    n = 0
    for sender, msgs in notifs.items():
        for data in msgs:
            n += 1
            telemetry.inc(Counter.NOTIFS_RECEIVED)
            try:
                msg = codec.decode(data)
            except AuthError as e:
                telemetry.fail(Failure.AUTH_REJECTED)
                rl.warning("auth", "rejected notification from %s: %s", sender, e)
                continue
            except ProtocolError as e:
                telemetry.fail(Failure.MALFORMED_NOTIF)
                rl.warning("malformed", "bad notification from %s: %s", sender, e)
                continue
            try:
                handle(sender, msg)
            except Exception:
                telemetry.fail(Failure.INTERNAL_ERROR)
                log.exception("handling a notification from %s failed", sender)
    return n

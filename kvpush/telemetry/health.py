"""Liveness and readiness of an endpoint, as ``/healthz`` and ``/readyz`` answer them.

``/healthz`` (live): the process and its owner threads are alive (``failure()`` is None).
``/readyz`` (ready): live, serving (not stopping), registered when a registry is given, and its
own data path healthy: it is *not* the case that failures of its own were counted and no push
(P) or request (D) succeeded -- counted since the last success seen, over at most the last
``window_s`` seconds. A pod whose every transfer fails stops showing Ready (smg-project/smg
#2382: 100 % of transfers failing while every pod showed Ready); an idle endpoint stays ready,
and one that no traffic reaches is ready again a window later (no readiness deadlock).

Only the endpoint's own health moves readiness: a failure counts when its kind is
``names.OWN_FAILURES`` (``names.FAILURE_BLAME`` classifies every kind): a WRITE that failed,
bytes that landed wrong, kvpush's own errors. Failures a client or a peer caused never count:
a request naming an unreachable, wrong or refusing P, bad or hostile input, load beyond a cap,
a peer that is frozen or gone. Whoever can send requests (no token is needed by default) could
otherwise keep a healthy endpoint out of its Service, where no good request reaches it.

A frozen P does not make its Ds unready: their requests to it end ``deadline`` (and its WRITEs
``write_timeout``), which say that P is slow or frozen -- P's fault, not D's; taking every D
out of its Service would stop the requests that name healthy Ps too and cure nothing. The same
holds the other way for a frozen D and its Ps. A P that answers but whose pushes fail
(``write_error``, ``write_post_failed``, bytes that fail verification) does count on D: the
transfer into D failed on a working connection. Without ``--auth-token-file`` any peer that
completes a handshake can report such a failure; with it only the fleet's peers can.

The window: ``Health`` keeps a ring of counter samples, one at least every ``TICK_S`` while the
Prometheus exporter's server loop calls ``tick`` (it does, ``kvpush.telemetry.prom``), and one
at every probe that sees the counts moved. The verdict's base is the oldest sample inside the
window (moved past the last success), so it covers at most ``window_s`` seconds and its reason
says the span it really covers. With no sample inside the window (nothing ticked: a ``Health``
without an exporter, probed more rarely than ``window_s``), nothing is judged until the next.

Probes and ticks run on the metrics server's threads; the ring is guarded by a lock. The
judgement is the pure ``data_path``. No imports beyond the snapshot and the names.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from kvpush.config import Role
from kvpush.telemetry.names import OWN_FAILURES
from kvpush.telemetry.snapshot import Snapshot

WINDOW_S = 10.0
#: Seconds between the samples ``tick`` takes (the window's start is this close to a sample).
TICK_S = 1.0
#: Counter samples kept (probes faster than 0.5 s apart with traffic between them add one each).
MAX_SAMPLES = 256

#: The counters of a push / request that succeeded and of one that failed, by role.
OUTCOME_COUNTERS = {
    Role.PREFILL: ("pushes_ok", "pushes_failed"),
    Role.DECODE: ("requests_ok", "requests_failed"),
}


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # one line; "ok" when ok


@dataclass(frozen=True)
class Sample:
    t: float
    ok: int
    failed: int
    failures: dict[str, int]


def sample_of(snap: Snapshot, t: float) -> Sample:
    ok_name, failed_name = OUTCOME_COUNTERS.get(snap.role, ("", ""))
    return Sample(
        t, int(snap.counters.get(ok_name, 0)), int(snap.counters.get(failed_name, 0)),
        dict(snap.failures),
    )  # fmt: skip


def _top(kinds: dict[str, int]) -> str:
    top = sorted(((n, k) for k, n in kinds.items() if n > 0), reverse=True)[:3]
    return ", ".join(f"{k} x{n}" for n, k in top)


def data_path(base: Sample, now: Sample, role: Role) -> Verdict:
    """Pure: not healthy when, between ``base`` and ``now``, failures of the endpoint's own
    (``OWN_FAILURES``) were counted and nothing succeeded. The reason names the most frequent
    own kinds, and the others (not counted) beside them."""
    if now.ok - base.ok > 0:
        return Verdict(True, "ok")
    kinds = {k: v - base.failures.get(k, 0) for k, v in now.failures.items()}
    own = {k: n for k, n in kinds.items() if k in OWN_FAILURES and n > 0}
    if not own:
        return Verdict(True, "ok")
    others = {k: n for k, n in kinds.items() if k not in OWN_FAILURES and n > 0}
    what = "push" if role == Role.PREFILL else "request"
    n = sum(own.values())
    text = (
        f"data path failing: {n} failure{'s' if n != 1 else ''} of its own and no {what} "
        f"succeeded in the last {now.t - base.t:.0f}s ({_top(own)})"
    )
    if others:
        text += f"; not counted, peers' or clients': {_top(others)}"
    return Verdict(False, text)


@dataclass(eq=False)
class Health:
    """The probes of one endpoint. ``registration`` (set when a registry is given) answers
    whether the endpoint is registered, and why not."""

    snapshot: Callable[[], Snapshot]
    failure: Callable[[], BaseException | None]
    stopping: Callable[[], bool]
    _: KW_ONLY
    window_s: float = WINDOW_S
    clock: Callable[[], float] = time.monotonic
    registration: Callable[[], Verdict] | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _samples: deque[Sample] = field(default_factory=deque, init=False)
    _last_tick: float = field(default=float("-inf"), init=False)

    def live(self) -> Verdict:
        f = self.failure()
        if f is not None:
            return Verdict(False, f"a thread of the endpoint failed: {type(f).__name__}: {f}")
        return Verdict(True, "ok")

    def tick(self) -> None:
        """Take a sample when the last tick is ``TICK_S`` old (the exporter's server loop calls
        this often): the window's start always lies close to a sample."""
        t = self.clock()
        if t - self._last_tick >= TICK_S:
            self._last_tick = t
            self.sample()

    def sample(self) -> Verdict:
        """Take a counter sample now; the data path's verdict over the window."""
        snap = self.snapshot()
        now = sample_of(snap, self.clock())
        with self._lock:
            samples = self._samples
            # Only samples inside the window judge: the verdict never reaches further back.
            while samples and samples[0].t < now.t - self.window_s:
                samples.popleft()
            # The base: the oldest sample of the window (none: nothing to judge yet) ...
            base = samples[0] if samples else now
            # ... or the first one after the last success seen: successes before a run of
            # failures do not hide it.
            seq = list(samples)
            for prev, cur in zip(reversed(seq[:-1]), reversed(seq), strict=False):
                if cur.ok > prev.ok:
                    base = cur
                    break
            # One sample per 0.5 s, but never drop one after a success: probes closer than that
            # (a quick run between two) must still see the successes they bracket.
            last = samples[-1] if samples else None
            if last is None or now.t - last.t >= 0.5 or now.ok != last.ok:
                samples.append(now)
                if len(samples) > MAX_SAMPLES:
                    samples.popleft()
        return data_path(base, now, snap.role)

    def ready(self) -> Verdict:
        live = self.live()
        if not live.ok:
            return live
        if self.stopping():
            return Verdict(False, "stopping: draining in-flight work")
        if self.registration is not None:
            reg = self.registration()
            if not reg.ok:
                return reg
        return self.sample()

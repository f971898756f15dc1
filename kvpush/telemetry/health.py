"""Liveness and readiness of an endpoint, as ``/healthz`` and ``/readyz`` answer them.

``/healthz`` (live): the process and its owner threads are alive (``failure()`` is None).
``/readyz`` (ready): live, serving (not stopping), registered when a registry is given, and the
data path healthy: it is *not* the case that pushes (P) or requests (D) failed and none
succeeded -- counted since the last success a probe saw, over at most the last ``window_s``
seconds (a success long ago does not hide a run of failures, and an endpoint that no traffic
reaches becomes ready again: no readiness deadlock). A pod whose every transfer fails stops
showing Ready (smg-project/smg #2382: 100 % of transfers failing while every pod showed
Ready); an idle endpoint (no attempts) stays ready.

``Health`` keeps a short ring of counter samples, taken when a probe asks (and whenever the
owner calls ``sample()``); the judgement is the pure ``data_path``. Probes run on the metrics
server's threads; the ring is guarded by a lock. No imports beyond the snapshot.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from kvpush.config import Role
from kvpush.telemetry.snapshot import Snapshot

WINDOW_S = 10.0
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


def data_path(base: Sample, now: Sample, role: Role) -> Verdict:
    """Pure: not healthy when, between ``base`` and ``now``, some attempts failed and none
    succeeded; the reason names the most frequent failure kinds."""
    ok, failed = now.ok - base.ok, now.failed - base.failed
    if failed <= 0 or ok > 0:
        return Verdict(True, "ok")
    kinds = {k: v - base.failures.get(k, 0) for k, v in now.failures.items()}
    top = sorted(((n, k) for k, n in kinds.items() if n > 0), reverse=True)[:3]
    what = "pushes" if role == Role.PREFILL else "requests"
    why = ", ".join(f"{k} x{n}" for n, k in top) or "no reason counted"
    return Verdict(
        False,
        f"data path failing: {failed} {what} failed and none succeeded in the last "
        f"{now.t - base.t:.0f}s ({why})",
    )


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

    def live(self) -> Verdict:
        f = self.failure()
        if f is not None:
            return Verdict(False, f"a thread of the endpoint failed: {type(f).__name__}: {f}")
        return Verdict(True, "ok")

    def sample(self) -> Verdict:
        """Take a counter sample now; the data path's verdict over the window."""
        snap = self.snapshot()
        now = sample_of(snap, self.clock())
        with self._lock:
            samples = self._samples
            # The window's base: the newest sample at least a window old, else the oldest.
            while len(samples) > 1 and samples[1].t <= now.t - self.window_s:
                samples.popleft()
            # No sample yet: every count since the endpoint started.
            base = samples[0] if samples else Sample(now.t - snap.uptime_s, 0, 0, {})
            # Only what happened after the last success seen counts: successes before a run of
            # failures do not hide it (probes may be seconds apart).
            seq = list(samples)
            for prev, cur in zip(reversed(seq[:-1]), reversed(seq), strict=False):
                if cur.ok > prev.ok:
                    base = cur
                    break
            # One sample per 0.5 s, but never drop one whose counts moved: probes closer than
            # that (a quick run between two) must still see the successes they bracket.
            last = samples[-1] if samples else None
            if (
                last is None
                or now.t - last.t >= 0.5
                or (now.ok, now.failed) != (last.ok, last.failed)
            ):
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

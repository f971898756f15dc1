"""Readiness moved only by the endpoint's own health (issue 24, item 4): the classification of
every failure kind (``names.FAILURE_BLAME``), the pure verdict (``health.data_path``) and the
window of ``Health`` on a stepped clock (at most ``window_s`` back, the reason's span the real
one). No threads, no sockets."""

from __future__ import annotations

import re

from kvpush.config import Role
from kvpush.telemetry.health import TICK_S, Health, Sample, data_path
from kvpush.telemetry.names import FAILURE_BLAME, OWN_FAILURES, Blame, Failure
from kvpush.telemetry.store import Telemetry

# What a client can make any endpoint count by naming a wrong, unreachable or frozen peer, or by
# sending junk: none of it may move readiness.
CLIENT_CAUSED = (
    "prefill_unreachable", "decode_unreachable", "handshake_failed", "incompatible",
    "bad_request", "duplicate_request", "cancelled", "bad_value", "auth_rejected",
    "malformed_frame", "oversized_frame", "deadline", "peer_left", "peer_restarted",
    "prefill_dead", "shutting_down", "write_timeout", "no_free_blocks", "overloaded",
)  # fmt: skip
# What says the endpoint's own data path or code failed.
ITS_OWN = ("write_error", "write_post_failed", "verify_failed", "internal_error", "callback_error")


def test_every_failure_kind_is_classified_once() -> None:
    """A new ``Failure`` member must be given a ``Blame`` (this fails until it is)."""
    missing = set(Failure) - set(FAILURE_BLAME)
    assert not missing, f"classify these in names.FAILURE_BLAME: {sorted(missing)}"
    assert all(isinstance(b, Blame) for b in FAILURE_BLAME.values())
    assert {str(k) for k, b in FAILURE_BLAME.items() if b is Blame.OWN} == OWN_FAILURES
    assert set(ITS_OWN) == OWN_FAILURES
    assert not set(CLIENT_CAUSED) & OWN_FAILURES


def s(t: float, ok: int = 0, failed: int = 0, **fails: int) -> Sample:
    return Sample(t, ok, failed, dict(fails))


def test_client_caused_failures_never_make_it_unready() -> None:
    for kind in CLIENT_CAUSED:
        v = data_path(s(0), s(10, 0, 500, **{kind: 500}), Role.DECODE)
        assert v.ok and v.reason == "ok", (kind, v)
        assert data_path(s(0), s(10, 0, 9, **{kind: 9}), Role.PREFILL).ok, kind


def test_its_own_failures_do_and_the_reason_names_both_sorts() -> None:
    for kind in ITS_OWN:
        assert not data_path(s(0), s(10, 0, 1, **{kind: 1}), Role.DECODE).ok, kind
    v = data_path(
        s(0, 2, 1, prefill_unreachable=1),
        s(10, 2, 45, prefill_unreachable=41, write_error=3, verify_failed=1, deadline=2),
        Role.DECODE,
    )
    assert not v.ok
    assert v.reason == (
        "data path failing: 4 failures of its own and no request succeeded in the last 10s "
        "(write_error x3, verify_failed x1); not counted, peers' or clients': "
        "prefill_unreachable x40, deadline x2"
    )
    v = data_path(s(0), s(3, 0, 1, write_post_failed=1), Role.PREFILL)
    assert v.reason == (
        "data path failing: 1 failure of its own and no push succeeded in the last 3s "
        "(write_post_failed x1)"
    )
    # One success in the window: the data path works.
    assert data_path(s(0), s(10, 1, 7, write_error=7), Role.DECODE).ok
    assert data_path(s(0), s(10), Role.DECODE).ok  # idle


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def rig(window_s: float = 10.0) -> tuple[Clock, Telemetry, Health]:
    clock = Clock()
    tm = Telemetry(Role.DECODE, "d", clock=clock)
    h = Health(tm.snapshot, lambda: None, lambda: False, window_s=window_s, clock=clock)
    return clock, tm, h


def fail(tm: Telemetry, kind: str, n: int = 1) -> None:
    tm.inc("requests_failed", n)
    tm.fail(kind, n)


def run(clock: Clock, h: Health, seconds: float, each: float = 0.25) -> None:
    """Let ``seconds`` pass, the exporter's server loop calling ``tick`` every ``each``."""
    end = clock.t + seconds
    while clock.t < end:
        clock.t = min(end, clock.t + each)
        h.tick()


def test_a_flood_naming_closed_ports_leaves_an_idle_d_ready() -> None:
    """The issue's measurement: one request every 8 s naming a closed P port kept an idle D at
    503 for 41 of 42 s. Now no probe in 42 s says anything but ok."""
    clock, tm, h = rig()
    verdicts = []
    for i in range(42 * 4):
        if i % 32 == 0:
            fail(tm, "prefill_unreachable")
        run(clock, h, 0.25)
        verdicts.append(h.ready())
    assert all(v.ok for v in verdicts), {v.reason for v in verdicts}
    # A frozen P: every request to it ends ``deadline``; D stays ready.
    fail(tm, "deadline", 50)
    run(clock, h, 3)
    assert h.ready().ok


def test_its_own_failures_make_it_unready_for_at_most_a_window() -> None:
    clock, tm, h = rig()
    run(clock, h, 5)
    fail(tm, "write_error", 3)
    run(clock, h, 1)
    v = h.ready()
    assert not v.ok and "3 failures of its own" in v.reason and "(write_error x3)" in v.reason
    run(clock, h, 8)
    assert not h.ready().ok  # still inside the window
    run(clock, h, 2 + TICK_S)
    assert h.ready().ok  # a window later, nothing attempted: ready (no readiness deadlock)
    fail(tm, "verify_failed")
    run(clock, h, 1)
    assert not h.ready().ok
    tm.inc("requests_ok")
    run(clock, h, 0.5)
    assert h.ready().ok  # one success: ready again


def test_the_window_is_what_the_reason_says() -> None:
    """Main judged from a sample taken when a probe last came -- 822 s back -- and said so. The
    span now never exceeds the window, and failures older than it are not judged at all."""
    clock, tm, h = rig()
    assert h.ready().ok
    clock.t += 812  # nothing sampled for a long time (no probe, no tick) ...
    fail(tm, "write_error")  # ... then an own failure, and a probe 10 s later
    clock.t += 10
    assert h.ready().ok  # no sample inside the window: nothing judged yet
    fail(tm, "write_error")
    clock.t += 4
    v = h.ready()
    assert not v.ok, v
    span = int(re.search(r"in the last (\d+)s", v.reason)[1])  # type: ignore[index]
    assert span == 4 and "write_error x1" in v.reason, v
    # With the ticks, the base is the oldest sample inside the window: the reason's span is at
    # most window_s (to the tick) and failures that are older fall out of it.
    run(clock, h, 30)
    fail(tm, "write_error", 2)
    run(clock, h, 25)
    fail(tm, "internal_error")
    run(clock, h, 3)
    v = h.ready()
    span = int(re.search(r"in the last (\d+)s", v.reason)[1])  # type: ignore[index]
    assert not v.ok and 9 <= span <= 10, v
    assert "internal_error x1" in v.reason and "write_error" not in v.reason, v


def test_successes_a_probe_brackets_are_seen_and_do_not_hide_later_failures() -> None:
    """Probes 0.3 s apart around a quick run of successes, then only own failures: unready
    (the sample after the successes is kept even inside the 0.5 s spacing)."""
    clock, tm, h = rig()
    assert h.ready().ok
    tm.inc("requests_ok", 4)
    clock.t += 0.3
    assert h.ready().ok
    fail(tm, "write_error", 3)
    clock.t += 2.0
    v = h.ready()
    assert not v.ok and "3 failures of its own" in v.reason, v


def test_tick_keeps_its_own_pace() -> None:
    clock, tm, h = rig()
    calls: list[float] = []
    snapshot = tm.snapshot

    def counted() -> object:
        calls.append(clock.t)
        return snapshot()

    h.snapshot = counted  # type: ignore[assignment]
    for _ in range(40):  # the server loop may call it after every connection
        clock.t += 0.05
        h.tick()
    assert len(calls) == 2 and calls[1] - calls[0] >= TICK_S, calls  # 2 s, 1 s apart

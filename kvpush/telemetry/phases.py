"""Where a request's time went: the phases of a push, stamped by P and D, read by ``drive``.

Owns the vocabulary (``Phase``, in the order a request passes them), the steps between phases
that each role times into its ``phase_*`` histograms (``D_STEPS``, ``P_STEPS``) and the pure
helpers around them. A stamp is ``time.time()`` (wall clock, so that ``drive`` can put both
legs on its own clock with the side channel's clock offset); a role keeps its stamps in a plain
dict per request and sends them in its answer (``DecodeRep.phases``, ``PushWaitRep.phases``).

P's completion notification rides with its WRITE (NIXL sends it once the data landed): P has
no separate "completion sent" moment; ``write_done`` is when P's poll saw the WRITE (and so
the notification) done, which may come after D's ``completion_received``. Every other phase
follows the one before it causally. Pure; called from the role threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from kvpush.telemetry.names import Hist, StrEnum


class Phase(StrEnum):
    D_ALLOCATED = "d_allocated"  # D: blocks allocated for the request
    PUSH_REG_SENT = "push_reg_sent"  # D: sending PUSH_REG to its P rank(s) (after handshakes)
    REGISTRATION_MATCHED = "registration_matched"  # P: blocks and PUSH_REG(s) met
    HANDSHAKE_DONE = "handshake_done"  # P: the P->D handshake waited for (if any) is done
    WRITE_POSTED = "write_posted"  # P: the last WRITE (with its completion) posted
    WRITE_DONE = "write_done"  # P: the last WRITE seen done (its completion delivered)
    COMPLETION_RECEIVED = "completion_received"  # D: the last completion received
    VERIFIED = "verified"  # D: every byte checked (absent with --no-verify)
    ANSWERED = "answered"  # D: the answer sent


# The values as plain strings, for the per-request paths (see ``_step``).
D_ALLOCATED = Phase.D_ALLOCATED.value
PUSH_REG_SENT = Phase.PUSH_REG_SENT.value
REGISTRATION_MATCHED = Phase.REGISTRATION_MATCHED.value
HANDSHAKE_DONE = Phase.HANDSHAKE_DONE.value
WRITE_POSTED = Phase.WRITE_POSTED.value
WRITE_DONE = Phase.WRITE_DONE.value
COMPLETION_RECEIVED = Phase.COMPLETION_RECEIVED.value
VERIFIED = Phase.VERIFIED.value
ANSWERED = Phase.ANSWERED.value

ORDER: tuple[Phase, ...] = tuple(Phase)
#: Phases that follow each other causally (``write_done`` is P's late view: see the module).
CAUSAL: tuple[Phase, ...] = tuple(p for p in Phase if p is not Phase.WRITE_DONE)
P_PHASES: frozenset[str] = frozenset(
    {Phase.REGISTRATION_MATCHED, Phase.HANDSHAKE_DONE, Phase.WRITE_POSTED, Phase.WRITE_DONE}
)

Step = tuple[str, tuple[str, ...], str]


def _step(hist: Hist, froms: tuple[Phase, ...], to: Phase) -> Step:
    # Plain strings: an enum member's ``.value`` costs ~0.2 us, this runs per request.
    return (hist.value, tuple(f.value for f in froms), to.value)


#: (histogram, from phase, to phase): what each role times. D's verify step starts at the
#: completion; its answer step at the verification, or at the completion without one.
D_STEPS: tuple[Step, ...] = (
    _step(Hist.PHASE_REGISTER, (Phase.D_ALLOCATED,), Phase.PUSH_REG_SENT),
    _step(Hist.PHASE_PUSH_WAIT, (Phase.PUSH_REG_SENT,), Phase.COMPLETION_RECEIVED),
    _step(Hist.PHASE_VERIFY, (Phase.COMPLETION_RECEIVED,), Phase.VERIFIED),
    _step(Hist.PHASE_ANSWER, (Phase.VERIFIED, Phase.COMPLETION_RECEIVED), Phase.ANSWERED),
)
P_STEPS: tuple[Step, ...] = (
    _step(Hist.PHASE_HANDSHAKE_WAIT, (Phase.REGISTRATION_MATCHED,), Phase.HANDSHAKE_DONE),
    _step(Hist.PHASE_POST, (Phase.HANDSHAKE_DONE,), Phase.WRITE_POSTED),
    _step(Hist.PHASE_WRITE, (Phase.WRITE_POSTED,), Phase.WRITE_DONE),
)


def wall_shift(
    wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic
) -> float:
    """What to add to a ``time.monotonic()`` stamp to put it on the wall clock that phase stamps
    use: both clocks read back to back, now. (Not ``time.time() - t`` with a ``t`` read earlier:
    whatever ran in between -- or a preemption -- would move every converted stamp that much
    later: P's ``write_posted`` came out after D's ``completion_received`` in a trace.)"""
    return wall() - mono()


def stamp(phases: dict[str, float] | None, phase: str) -> None:
    """Record ``phase`` (a ``Phase`` or its value) now; no-op when stamps are off (``phases``
    is None). Callers on a per-request path pass the plain-string constants below."""
    if phases is not None:
        phases[phase] = time.time()


def steps(phases: Mapping[str, float], table: tuple[Step, ...]) -> list[tuple[str, float]]:
    """(histogram, seconds) of every step of ``table`` whose two ends are stamped."""
    out = []
    get = phases.get
    for hist, froms, to in table:
        t1 = get(to)
        if t1 is None:
            continue
        for f in froms:
            t0 = get(f)
            if t0 is not None:
                out.append((hist, t1 - t0 if t1 > t0 else 0.0))
                break
    return out


def merge(many: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The stamps of a request over several ranks: each phase when its last rank reached it."""
    out: dict[str, float] = {}
    for m in many:
        for k, v in m.items():
            if v > out.get(k, -1.0):
                out[k] = v
    return out


def ordered(phases: Mapping[str, float]) -> dict[str, float]:
    """``phases`` in ``ORDER`` (unknown names last, as given)."""
    out = {p.value: phases[p] for p in ORDER if p in phases}
    out.update({k: v for k, v in phases.items() if k not in out})
    return out


def last_reached(phases: Mapping[str, float]) -> str:
    """The last phase of ``ORDER`` before the answer that a request reached (``"sent"``: none;
    a failed request's answer is no progress: it ended where its last phase says)."""
    reached = [p for p in ORDER if p in phases and p is not Phase.ANSWERED]
    return reached[-1].value if reached else "sent"

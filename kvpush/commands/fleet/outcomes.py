"""What ``fleet check`` reports: its options (``CheckConfig``), one pair's outcome
(``PairResult``) and the matrix (``CheckReport``, with its exit status).

Outcomes: ``ok`` (every push verified), ``failed`` (with drive's reason), ``incompatible`` (the
differing fields named), ``compatible`` (checked by metadata only: a pair on vLLM's wire, whose
push only the vLLM engine's router can start), ``skipped`` (e.g. a pool too small) and ``left``
(an endpoint proven gone). Frozen data; no I/O, no threads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, NotRequired, TypedDict

from kvpush.config import require_counts, require_positive
from kvpush.errors import ExitStatus
from kvpush.fleet.pairs import Difference

Outcome = Literal["ok", "failed", "incompatible", "compatible", "skipped", "left"]

OUTCOMES: tuple[Outcome, ...] = ("ok", "failed", "incompatible", "compatible", "skipped", "left")


@dataclass(frozen=True)
class CheckConfig:
    pushes: int = 3
    size_bytes: int = 1 << 20
    concurrency: int = 8
    deadline_s: float = 10.0
    strict: bool = False
    auth_token: bytes | None = None

    def __post_init__(self) -> None:
        require_counts(
            ("--pushes", self.pushes),
            ("--size", self.size_bytes),
            ("--concurrency", self.concurrency),
        )
        require_positive("--deadline", self.deadline_s)


@dataclass(frozen=True)
class PairResult:
    prefill: str
    decode: str
    outcome: Outcome
    # a Failure value for "failed"; "incompatible", "wire", "pool_too_small", "left" otherwise
    reason: str = ""
    detail: str = ""
    differences: list[Difference] = field(default_factory=list)
    blocks: int = 0
    pushes: int = 0
    pushes_ok: int = 0
    first_ms: float | None = None
    handshake_ms: float | None = None
    p50_ms: float | None = None
    gb_per_s: float | None = None
    elapsed_s: float = 0.0
    lane: str = ""  # the WRITE's transport as P reports it (``kvpush.commands.fleet.lanes``)
    lane_flags: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["differences"] = [{"field": f, "prefill": p, "decode": q} for f, p, q in self.differences]
        return d


class CheckJSON(TypedDict):
    """``fleet check --json``: the report (``CheckReport.to_dict``); the command adds the
    listing's ``problems`` and ``unseen``, and ``warm`` under ``--warm``."""

    cluster: str
    prefills: list[str]
    decodes: list[str]
    pairs: list[dict[str, object]]
    counts: dict[str, int]
    elapsed_s: float
    concurrency: int
    strict: bool
    exit_status: int
    notes: list[str]
    warm: NotRequired[dict[str, object]]
    problems: NotRequired[list[str]]
    unseen: NotRequired[int]


@dataclass(frozen=True)
class CheckReport:
    cluster: str
    prefills: list[str]
    decodes: list[str]
    pairs: list[PairResult]
    elapsed_s: float
    concurrency: int
    strict: bool = False
    notes: list[str] = field(default_factory=list)

    def count(self, outcome: Outcome) -> int:
        return sum(1 for p in self.pairs if p.outcome == outcome)

    @property
    def failed(self) -> list[PairResult]:
        return [p for p in self.pairs if p.outcome == "failed"]

    @property
    def exit_status(self) -> ExitStatus:
        bad = self.count("failed")
        if self.strict:
            bad += self.count("incompatible") + self.count("skipped")
        return ExitStatus.NOT_READY if bad else ExitStatus.OK

    def pair(self, prefill: str, decode: str) -> PairResult:
        return next(r for r in self.pairs if r.prefill == prefill and r.decode == decode)

    def to_dict(self) -> CheckJSON:
        return {
            "cluster": self.cluster,
            "prefills": self.prefills,
            "decodes": self.decodes,
            "pairs": [p.to_dict() for p in self.pairs],
            "counts": {o: self.count(o) for o in OUTCOMES},
            "elapsed_s": self.elapsed_s,
            "concurrency": self.concurrency,
            "strict": self.strict,
            "exit_status": int(self.exit_status),
            "notes": self.notes,
        }

"""The data of a drive: its configuration, one result per request, and the summary.

Owns ``DriveConfig`` (validated on construction), ``RequestResult`` (how one request ended:
ok, or failed with one ``Failure`` reason and free-text detail) and ``DriveReport`` /
``summarize`` (counts, failures grouped by reason only, nearest-rank latency percentiles from
``kvpush.commands.common.stats``, throughput). A report always holds exactly one result per
requested request: those never sent (Ctrl-C) are ``cancelled`` results, not missing ones. Pure data
and functions; any thread.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field, fields

from kvpush.address import format_address, parse_address
from kvpush.commands.common.stats import percentile
from kvpush.config import require_counts, require_positive
from kvpush.errors import ConfigError


@dataclass(frozen=True)
class DriveConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    requests: int = 100
    concurrency: int = 8
    rate: float | None = None  # requests started per second; None: as fast as concurrency allows
    blocks: int = 4
    timeout_s: float = 30.0
    auth_token: bytes | None = None
    run_id: str = ""
    preflight: bool = True
    # Liveness: a peer with requests in flight and no reply for stall_s gets a get_meta_msg
    # that must be answered within liveness_s, else it is marked down; a down peer is
    # re-checked every recheck_s. Refused connections mark a peer down at once.
    liveness_s: float = 2.0
    stall_s: float = 3.0
    recheck_s: float = 1.0
    grace_s: float = 3.0  # after Ctrl-C: how long in-flight requests may still finish
    # A named model shape (``kvpush.memory.shapes``): the preflight checks that P's geometry
    # is that shape (one rank of it), and ``--tokens`` sizes requests in its blocks.
    shape: str = ""
    # While no peer of a role is up, hold requests this long for one to come back (a restart is
    # a dip in the progress line); past it, what is left fails with the role's reason.
    peer_grace_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ConfigError("no prefill endpoint given", "pass --prefill HOST:PORT")
        if not self.decode:
            raise ConfigError("no decode endpoint given", "pass --decode HOST:PORT")
        if self.shape:
            from kvpush.memory.shapes import get_shape

            get_shape(self.shape)  # an unknown name: refused before anything is sent
        for name in ("prefill", "decode"):
            norm = tuple(
                dict.fromkeys(format_address(*parse_address(a)) for a in getattr(self, name))
            )
            object.__setattr__(self, name, norm)
        self._check_numbers()
        if not self.run_id:
            object.__setattr__(self, "run_id", uuid.uuid4().hex[:8])

    def _check_numbers(self) -> None:
        """Counts, sizes, the rate and the time limits: each in its range."""
        require_counts(
            ("--requests", self.requests),
            ("--concurrency", self.concurrency),
            ("--blocks", self.blocks),
        )
        if self.blocks > 1 << 16:
            raise ConfigError(f"--blocks {self.blocks} is too large", "use at most 65536")
        if not self.peer_grace_s >= 0:
            raise ConfigError(
                f"--peer-grace must be 0 or more, got {self.peer_grace_s:g}",
                "pass --peer-grace 0 to fail at once when no peer of a role is up",
            )
        if self.rate is not None:
            require_positive("--rate", self.rate, "omit --rate for no limit")
        require_positive("--timeout", self.timeout_s)


@dataclass(frozen=True)
class RequestResult:
    index: int
    transfer_id: str
    prefill: str  # "" when it was never sent
    decode: str
    ok: bool
    reason: str  # a Failure value; "" when ok
    detail: str
    latency_s: float  # driver-measured: decode leg sent -> decode reply received
    nbytes: int
    verified: bool | None


@dataclass(frozen=True)
class DriveReport:
    requests: int
    ok: int
    failed: int
    verified: int
    failures_by_reason: dict[str, int]
    latency_s: dict[str, float]
    elapsed_s: float
    requests_per_s: float
    bytes_total: int
    gb_per_s: float
    by_decode: dict[str, int]
    by_prefill: dict[str, int]
    first_failures: list[str] = field(default_factory=list)
    interrupted: bool = False
    concurrency: int = 0  # requests in flight at most (may be below --concurrency: see note)
    notes: list[str] = field(default_factory=list)
    peer_events: list[str] = field(default_factory=list)
    # drive --trace: per phase, seconds since sent (count, p50, p99, max) over the ok requests
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def all_verified(self) -> bool:
        return (
            self.requests > 0
            and not self.interrupted
            and self.ok == self.requests
            and self.verified == self.requests
        )

    def to_dict(self) -> dict[str, object]:
        """Every field, then ``all_verified``; ``phases`` only where drive --trace measured some."""
        d: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["all_verified"] = self.all_verified
        if not self.phases:
            del d["phases"]
        return d


def summarize(
    results: list[RequestResult],
    elapsed_s: float,
    *,
    interrupted: bool = False,
    concurrency: int = 0,
    notes: list[str] | None = None,
    peer_events: list[str] | None = None,
) -> DriveReport:
    ok = [r for r in results if r.ok]
    lat = [r.latency_s for r in ok]
    nbytes = sum(r.nbytes for r in ok)
    failures = [r for r in results if not r.ok]
    sent = sum(1 for r in results if r.decode)  # not those that never left (no peer, Ctrl-C)
    return DriveReport(
        requests=len(results),
        ok=len(ok),
        failed=len(failures),
        verified=sum(1 for r in ok if r.verified is True),
        failures_by_reason=dict(Counter(str(r.reason) for r in failures).most_common()),
        latency_s={
            "p50": percentile(lat, 50),
            "p90": percentile(lat, 90),
            "p99": percentile(lat, 99),
            "max": max(lat, default=0.0),
        },
        elapsed_s=elapsed_s,
        requests_per_s=sent / elapsed_s if elapsed_s > 0 else 0.0,
        bytes_total=nbytes,
        gb_per_s=nbytes / elapsed_s / 1e9 if elapsed_s > 0 else 0.0,
        by_decode=dict(Counter(r.decode for r in results if r.decode)),
        by_prefill=dict(Counter(r.prefill for r in results if r.prefill)),
        first_failures=_examples(failures),
        interrupted=interrupted,
        concurrency=concurrency,
        notes=list(notes or []),
        peer_events=list(peer_events or []),
    )


def _examples(failures: list[RequestResult], limit: int = 5) -> list[str]:
    """The first failure of each reason (at most ``limit``), with its detail."""
    seen: dict[str, RequestResult] = {}
    for r in failures:
        seen.setdefault(str(r.reason), r)
    return [
        f"{r.transfer_id} via {r.decode or '-'}: {r.reason}{': ' + r.detail if r.detail else ''}"
        for r in list(seen.values())[:limit]
    ]

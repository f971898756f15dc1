"""What ``kvpush probe`` finds out about a peer: the ``ProbeReport`` and its round-trip figures.

Owns the report's data model and its JSON form (``ProbeReport.to_dict``, what ``probe --json``
prints), the round-trip statistics (``rtt_stats``: RTTs and the clock offset of the best
sample), the report both probes make of a peer's answers (``answered``), the compatibility
fields a local geometry announces (``local_compat_fields``) and how a peer's ranks read for a
person (``served_ranks``). The probes that fill it are ``kvpush.commands.probe.kvpush_peer`` and
``kvpush.commands.probe.vllm_peer``; the human form is drawn by ``kvpush.commands.probe.view``.
Pure: no I/O, no threads, no sockets (safe for the CLI to import).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal, TypedDict

from kvpush import PROTOCOL_VERSION
from kvpush.commands.common.stats import median
from kvpush.config import PoolConfig
from kvpush.errors import ExitStatus


@dataclass(frozen=True)
class RttStats:
    """Side-channel round trips; the clock offset comes from the lowest-RTT sample."""

    samples_s: tuple[float, ...]
    clock_offset_s: float
    min_s: float
    median_s: float

    def to_dict(self) -> dict[str, object]:
        return {
            "samples": len(self.samples_s),
            "min_s": self.min_s,
            "median_s": self.median_s,
            "clock_offset_s": self.clock_offset_s,
        }


def rtt_stats(samples: list[tuple[float, float, float]]) -> RttStats:
    """From ``(t_send, t_recv, remote_clock)`` samples: RTTs and the offset of the best one.

    offset = remote_clock - (t_send + t_recv) / 2, keeping the lowest-RTT sample (its midpoint
    is the tightest bound on when the peer read its clock).
    """
    if not samples:
        raise ValueError("no samples")
    best = min(samples, key=lambda s: s[1] - s[0])
    offset = best[2] - (best[0] + best[1]) / 2
    rtts = tuple(t1 - t0 for t0, t1, _ in samples)
    return RttStats(rtts, offset, min(rtts), median(rtts))


class LaneRow(TypedDict):
    """``probe --lanes``: the lane of one peer rank written to (``kvpush.commands.probe.lanes``)."""

    peer: object  # the peer row's name: ``HOST:PORT`` or ``HOST:PORT rank R``
    writer: str  # whose WRITE it is: this probe's P, or the peer P
    lane: dict[str, object]  # ``write``, ``devices``, ``notif``, ``locality``, ``evidence``...
    lane_flags: list[str]


@dataclass(frozen=True)
class ProbeReport:
    address: str
    kind: Literal["kvpush", "vllm"]
    compat_hash: str
    metadata: dict[str, object]
    rtt: RttStats
    compat_checked: bool = False
    differences: list[tuple[str, object, object]] = field(default_factory=list)
    handshake_mode: str | None = None
    handshake_timings_s: dict[str, float] | None = None
    ping_s: list[float] | None = None
    stats: dict[str, object] | None = None
    notes: list[str] = field(default_factory=list)
    suggest: list[str] = field(default_factory=list)  # kvpush command lines that fit the peer
    # This host's NIXL/UCX ({"nixl", "nixl_build", "ucx"}) and the known issues of either side's.
    local_versions: dict[str, str] = field(default_factory=dict)
    version_warnings: list[str] = field(default_factory=list)
    # ``--lanes``: one row per peer rank written to (``kvpush.commands.probe.lanes``).
    lanes: list[LaneRow] | None = None

    @property
    def compatible(self) -> bool | None:
        return (not self.differences) if self.compat_checked else None

    @property
    def exit_status(self) -> ExitStatus:
        return ExitStatus.NOT_READY if self.differences else ExitStatus.OK

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["rtt"] = self.rtt.to_dict()
        d["differences"] = [
            {"field": f, "local": local, "remote": remote} for f, local, remote in self.differences
        ]
        d["compatible"] = self.compatible
        d["status"] = "healthy" if self.exit_status == ExitStatus.OK else "incompatible"
        d["exit_status"] = int(self.exit_status)
        return d


def answered(
    address: str,
    kind: Literal["kvpush", "vllm"],
    compat_hash: str,
    metadata: dict[str, object],
    samples: list[tuple[float, float, float]],
    local: dict[str, object] | None,
    differences: list[tuple[str, object, object]],
    *,
    stats: dict[str, object] | None = None,
    notes: list[str] | None = None,
    suggest: list[str] | None = None,
) -> ProbeReport:
    """The report of a peer's answers, as both probes make it: the round trips of ``samples``,
    and the compatibility checked when a ``local`` geometry was given."""
    return ProbeReport(
        address=address,
        kind=kind,
        compat_hash=compat_hash,
        metadata=metadata,
        rtt=rtt_stats(samples),
        compat_checked=local is not None,
        differences=differences,
        stats=stats,
        notes=notes or [],
        suggest=suggest or [],
    )


def local_compat_fields(pool: PoolConfig) -> dict[str, object]:
    """The compatibility fields (protocol.COMPAT_FIELDS) an endpoint with ``pool`` announces."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "dtype": pool.dtype,
        "kv_layout": pool.kv_layout,
        "block_bytes": pool.head_bytes * pool.kv_heads,  # the model's page, all ranks' shares
        "layers": pool.layers,
        "regions": pool.regions,
        "kv_heads": pool.kv_heads,
    }


def served_ranks(ranks: Iterable[Sequence[int]], tp_size: object = None) -> str:
    """A peer's ranks for a person: ``0..3 (tp 4)`` for pipeline rank 0 and tensor ranks
    0..N-1 (what kvpush serves), else every ``pp,tp`` pair."""
    pairs = [(int(r[0]), int(r[1])) for r in ranks]
    tp = f" (tp {tp_size})" if tp_size is not None else ""
    if pairs and pairs == [(0, t) for t in range(len(pairs))]:
        return (f"0..{len(pairs) - 1}" if len(pairs) > 1 else "0") + tp
    return (", ".join(f"{p},{t}" for p, t in pairs) or "none listed") + tp

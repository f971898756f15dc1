"""Which lane carried a checked pair's bytes, in P's own word.

Owns ``pair_lane``: after ``fleet check`` pushed through a pair, P is asked for its stats
(``StatsReq``) and its peer rows for D are read (``kvpush.commands.probe.lanes.lane_rows``): the
WRITE's transport as UCX reported choosing it (``cma``, ``tcp``, ``rc_mlx5``, ``cuda_ipc``...),
with the flags an operator should not see (``tcp_on_one_host``, ``post_dominates``). An
endpoint that reports no lane (``--no-lanes``, an older kvpush, no answer) gives ``?``. Runs on
the pair's thread, one short side-channel request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpush.errors import KvpushError

#: How long P may take to answer the stats request.
ASK_S = 3.0


@dataclass(frozen=True)
class PairLane:
    word: str = ""  # e.g. "cma", "tcp!tcp_on_one_host", "ambiguous", "?"
    flags: list[str] = field(default_factory=list)
    detail: dict[str, object] = field(default_factory=dict)  # D rank 0's ``lane`` row


def pair_lane(p: str, d: str, token: bytes | None) -> PairLane:
    """P's word on the lane its WRITEs to D took (``?`` when P does not say)."""
    from kvpush.commands.common import control
    from kvpush.commands.probe.lanes import lane_rows, lane_word
    from kvpush.wire import protocol

    try:
        with control.connect(p, token, ASK_S) as client:
            rep = control.call(client, protocol.StatsReq(), ASK_S)
    except KvpushError:
        return PairLane("?")
    if not isinstance(rep, protocol.StatsRep):
        return PairLane("?")
    rows = lane_rows(dict(rep.snapshot), d)
    if not rows:
        return PairLane("?")
    words = sorted({lane_word(r) for r in rows})
    flags = sorted({f for r in rows for f in _flags(r) if isinstance(f, str)})
    lane = rows[0].get("lane")
    return PairLane("|".join(words), flags, dict(lane) if isinstance(lane, dict) else {})


def _flags(row: Mapping[str, object]) -> list[object]:
    flags = row.get("lane_flags")
    return flags if isinstance(flags, list) else []

"""``fleet check --warm``: every pair that passed is left handshaken both ways, in its endpoints'
own word.

Owns ``warm_pairs``. The check's pushes already handshake a pair both ways (D -> P at the decode
leg, P -> D at the registration); ``--warm`` makes sure of it and says so: each endpoint of a pair
that passed is asked for its peer table (``StatsReq``, one short side-channel request each), and
the pair is *warm* when P holds a connection to D and D one to P (every rank row of the other
endpoint connected or degraded). A pair found cold (an idle eviction between the push and the
look, a row that failed) gets one more verified push through ``check_pair`` -- the check's own
path -- and is looked at again. What is not warm then is named, and the check exits 3.

Runs on the caller's thread, after ``check_fleet``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from kvpush.commands.fleet.outcomes import CheckConfig, CheckReport
from kvpush.errors import KvpushError
from kvpush.fleet.record import EndpointRecord

#: How long one endpoint may take to answer its stats request.
ASK_S = 3.0
_LIVE = ("connected", "degraded")


@dataclass(frozen=True)
class WarmPair:
    prefill: str
    decode: str
    p_holds_d: bool
    d_holds_p: bool
    pushed_again: bool = False

    @property
    def warm(self) -> bool:
        return self.p_holds_d and self.d_holds_p

    def to_dict(self) -> dict[str, object]:
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "warm": self.warm,
            "p_holds_d": self.p_holds_d,
            "d_holds_p": self.d_holds_p,
            "pushed_again": self.pushed_again,
        }


@dataclass(frozen=True)
class WarmReport:
    pairs: list[WarmPair]

    @property
    def cold(self) -> list[WarmPair]:
        return [w for w in self.pairs if not w.warm]

    def to_dict(self) -> dict[str, object]:
        return {
            "pairs": [w.to_dict() for w in self.pairs],
            "warm": len(self.pairs) - len(self.cold),
            "cold": len(self.cold),
        }

    def lines(self) -> list[str]:
        """The verdict, then one line per pair that is not warm."""
        n, cold = len(self.pairs), self.cold
        out = [f"warm: {n - len(cold)} of {n} pairs that passed are handshaken both ways"]
        for w in cold:
            missing = [
                what
                for what, ok in (("P holds no connection to D", w.p_holds_d),
                                 ("D holds none to P", w.d_holds_p))
                if not ok
            ]  # fmt: skip
            out.append(f"  not warm: {w.prefill} -> {w.decode}: {'; '.join(missing)}")
        return out


def peer_rows(address: str, token: bytes | None) -> list[Mapping[str, object]]:
    """The endpoint's peer table (its stats reply's ``peers``); empty when it does not answer."""
    from kvpush.commands.common import control
    from kvpush.wire import protocol

    try:
        with control.connect(address, token, ASK_S) as client:
            rep = control.call(client, protocol.StatsReq(), ASK_S)
    except KvpushError:
        return []
    if not isinstance(rep, protocol.StatsRep):
        return []
    peers = dict(rep.snapshot).get("peers")
    return [r for r in peers if isinstance(r, dict)] if isinstance(peers, list) else []


def holds(rows: list[Mapping[str, object]], address: str) -> bool:
    """Whether the peer table ``rows`` has the endpoint at ``address`` connected: every one of
    its rank rows (``HOST:PORT``, ``HOST:PORT rank R``) connected or degraded, and one at least."""
    mine = [
        r
        for r in rows
        if str(r.get("peer")) == address or str(r.get("peer")).startswith(f"{address} rank ")
    ]
    return bool(mine) and all(r.get("state") in _LIVE for r in mine)


def _look(p: str, d: str, token: bytes | None, again: bool = False) -> WarmPair:
    return WarmPair(p, d, holds(peer_rows(p, token), d), holds(peer_rows(d, token), p), again)


def warm_pairs(rep: CheckReport, records: list[EndpointRecord], cfg: CheckConfig) -> WarmReport:
    """Every pair of ``rep`` that passed, looked at in both endpoints' peer tables; a cold one
    pushed through once more and looked at again."""
    from kvpush.commands.fleet.check import check_pair

    by_addr = {r.address: r for r in records}
    once = replace(cfg, pushes=1)
    out = []
    for pr in rep.pairs:
        if pr.outcome != "ok":
            continue
        w = _look(pr.prefill, pr.decode, cfg.auth_token)
        if not w.warm and pr.prefill in by_addr and pr.decode in by_addr:
            check_pair(by_addr[pr.prefill], by_addr[pr.decode], once)
            w = _look(pr.prefill, pr.decode, cfg.auth_token, again=True)
        out.append(w)
    return WarmReport(out)

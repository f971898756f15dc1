"""Both legs of a request over the real side channels, for the fault suites.

``run_leg`` / ``run_legs`` send D's leg (it registers), then P's, with client timeouts short enough
that a dead peer costs seconds, and return a ``Result`` that always says how the request ended
(``ok`` or ``failed`` with a reason, also when the D process itself is gone). Each D leg owns a
fresh client (``tests.support.side``). The plainer runner of the integration suites is
``tests.support.legs``.

Run as ``python -m tests.support.fault_legs legs P D N BLOCKS PREFIX [P_DELAY_S]`` or ``... stats
ADDR``, it runs requests or reads a snapshot and prints one JSON line (the netns test runs it
inside a namespace: ``tests.support.netns.run_in_netns``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tests.support.side import client, request, snapshot


@dataclass
class Result:
    tid: str
    d: str
    outcome: str  # ok | failed
    reason: str = ""
    detail: str = ""
    verified: bool | None = None
    latency_s: float = 0.0  # as the client saw it
    p_outcome: str = ""
    p_reason: str = ""
    server_latency_s: float = 0.0
    t_end: float = 0.0  # monotonic, when the D leg returned


def run_leg(
    tid: str,
    p_addr: str,
    d_addr: str,
    blocks: int,
    *,
    deadline_s: float = 0.0,
    p_delay_s: float = 0.0,
    send_p: bool = True,
    d_timeout_s: float = 20.0,
    p_timeout_s: float = 10.0,
) -> Result:
    """D leg (registers), then after ``p_delay_s`` the P leg; return how D's request ended.

    A D that does not answer (killed, or frozen past the client timeout) yields
    ``failed/d_unreachable``: the request ended with the process that held it.
    """
    from kvpush.errors import KvpushError
    from kvpush.wire import protocol

    host, port = p_addr.rsplit(":", 1)
    out: dict[str, Any] = {}
    t0 = time.monotonic()

    def decode_leg() -> None:
        # A fresh client: the D leg of a request owns its socket (late replies stay there).
        with client(d_addr, d_timeout_s) as c:
            try:
                out["d"] = c.request(
                    protocol.DecodeReq(
                        transfer_id=tid,
                        prefill_host=host,
                        prefill_port=int(port),
                        num_blocks=blocks,
                        deadline_s=deadline_s,
                    ),
                    timeout_s=d_timeout_s,
                )
            except KvpushError as e:
                out["d_err"] = e
        out["t_d"] = time.monotonic()

    t = threading.Thread(target=decode_leg, name=f"leg-{tid}")
    t.start()
    p_outcome, p_reason = "", ""
    if send_p:
        if p_delay_s > 0:
            time.sleep(p_delay_s)
        try:
            p_rep = request(
                p_addr, protocol.PrefillReq(transfer_id=tid, num_blocks=blocks), p_timeout_s
            )
            assert isinstance(p_rep, protocol.PrefillRep), p_rep
            p_outcome, p_reason = p_rep.outcome, p_rep.reason
        except KvpushError as e:
            p_outcome, p_reason = "failed", f"p_unreachable: {e}"
    t.join(d_timeout_s + 10)
    assert not t.is_alive(), f"D leg of {tid} did not return"
    lat = out.get("t_d", time.monotonic()) - t0
    if "d" not in out:
        return Result(
            tid,
            d_addr,
            "failed",
            "d_unreachable",
            str(out.get("d_err", "")),
            latency_s=lat,
            p_outcome=p_outcome,
            p_reason=p_reason,
            t_end=t0 + lat,
        )
    rep = out["d"]
    assert isinstance(rep, protocol.DecodeRep), rep
    return Result(
        tid,
        d_addr,
        rep.outcome,
        rep.reason,
        rep.detail,
        rep.verified,
        lat,
        p_outcome,
        p_reason,
        rep.latency_s,
        t0 + lat,
    )


def run_legs(
    items: list[tuple[str, str, str, int]], concurrency: int = 8, **kw: Any
) -> list[Result]:
    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(lambda it: run_leg(*it, **kw), items))


def _driver_main(args: list[str]) -> int:  # pragma: no cover - runs inside a namespace
    """``legs P D N BLOCKS PREFIX [P_DELAY_S]`` or ``stats ADDR``: one JSON line on stdout."""
    from dataclasses import asdict

    if args[0] == "legs":
        p, d, n, blocks, prefix = args[1], args[2], int(args[3]), int(args[4]), args[5]
        p_delay = float(args[6]) if len(args) > 6 else 0.0
        items = [(f"{prefix}-{i}", p, d, blocks) for i in range(n)]
        res = run_legs(items, concurrency=4, p_delay_s=p_delay, d_timeout_s=30)
        print(json.dumps([asdict(r) for r in res]))
    elif args[0] == "stats":
        print(json.dumps(snapshot(args[1])))
    else:
        print(f"unknown driver command {args[0]!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] in (["legs"], ["stats"]):
        sys.exit(_driver_main(sys.argv[1:]))
    sys.exit(f"usage: {sys.argv[0]} legs ... | stats ADDR")

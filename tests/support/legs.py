"""Send both legs of a request to running endpoints over their real side channels.

Clients come from the tools' one control client (``kvpush.commands.common.control.connect``), one
per address per thread (a client belongs to one thread).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvpush.commands.common import control
from kvpush.transport.client import SideChannelClient
from kvpush.wire import protocol

_local = threading.local()


def _client(address: str) -> SideChannelClient:
    cache: dict[str, SideChannelClient] = getattr(_local, "clients", None) or {}
    _local.clients = cache
    c = cache.get(address)
    if c is None:
        c = cache[address] = control.connect(address, None, timeout_s=30)
    return c


@dataclass
class Outcome:
    transfer_id: str
    decode: str
    rep: protocol.DecodeRep
    t_sent: float
    t_done: float


def run_request(
    tid: str, p_addr: str, d_addr: str, blocks: int, deadline_s: float = 0.0
) -> Outcome:
    """D leg first (registers), then P leg; return when D has the KV (or failed)."""
    t0 = time.monotonic()
    host, port = p_addr.rsplit(":", 1)
    d = _client(d_addr)
    result: dict[str, protocol.SideReply] = {}

    def decode_leg() -> None:
        result["d"] = d.request(
            protocol.DecodeReq(
                transfer_id=tid,
                prefill_host=host,
                prefill_port=int(port),
                num_blocks=blocks,
                deadline_s=deadline_s,
            ),
            timeout_s=60,
        )

    t = threading.Thread(target=decode_leg)
    t.start()
    p_rep = _client(p_addr).request(protocol.PrefillReq(transfer_id=tid, num_blocks=blocks))
    assert isinstance(p_rep, protocol.PrefillRep), p_rep
    t.join(90)
    rep = result["d"]
    assert isinstance(rep, protocol.DecodeRep), rep
    return Outcome(tid, d_addr, rep, t0, time.monotonic())


def stats(address: str) -> dict[str, object]:
    rep = _client(address).request(protocol.StatsReq())
    assert isinstance(rep, protocol.StatsRep)
    return rep.snapshot


def run_many(items: list[tuple[str, str, str, int]], concurrency: int = 8) -> list[Outcome]:
    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(lambda it: run_request(*it), items))

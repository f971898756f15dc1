"""What ``fleet check`` asks an endpoint itself, on the data path, never the registry.

Owns ``gone_proof`` (the proof that an endpoint is gone: its side channel refuses connections,
or a new incarnation answers at its address; a key that went or lapsed is a hint only) and
``free_now`` (an endpoint's free blocks per rank, in its own word), each question bounded by
``PROOF_S``. Runs on the check's threads; plain sockets and the tools' control client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvpush.errors import KvpushError
from kvpush.fleet.record import EndpointRecord
from kvpush.transport.contact import tcp_contact

#: Seconds for each question that proves an endpoint gone, or asks its free blocks.
PROOF_S = 2.0


def gone_proof(addr: str, now: EndpointRecord | None, token: bytes | None) -> str:
    """The data path's proof that the endpoint at ``addr`` is gone ("" when there is none): its
    side channel refuses connections, or a new incarnation -- the one the registry now lists
    -- answers there. A key that went or lapsed is a hint only: a frozen endpoint's lease lapses
    too, and its port still accepts (the kernel does)."""
    from kvpush.commands.common import control

    try:
        c = tcp_contact(addr, PROOF_S, look=False)
    except KvpushError:  # not even an address: nothing to prove
        return ""
    if c.kind == "refused":
        return f"{addr} refuses connections"
    if now is None or c.kind != "zmq":
        return ""
    try:
        with control.connect(addr, token, PROOF_S) as client:
            kv = client.identify(timeout_s=PROOF_S).kvpush
    except KvpushError:
        return ""
    if kv is not None and kv.incarnation == now.incarnation:
        return f"a new incarnation ({now.incarnation[:8]}) answers at {addr}"
    return ""


def free_now(token: bytes | None, tp: Mapping[str, int]) -> Callable[[str], int | None]:
    """An endpoint's free blocks per rank, in its own word (``StatsReq``); None: no answer."""
    from kvpush.commands.common import control
    from kvpush.wire import protocol

    def ask(addr: str) -> int | None:
        try:
            with control.connect(addr, token, PROOF_S) as client:
                rep = control.call(client, protocol.StatsReq(), PROOF_S)
        except KvpushError:
            return None
        if not isinstance(rep, protocol.StatsRep):
            return None
        gauges = rep.snapshot.get("gauges")
        free = gauges.get("pool_free") if isinstance(gauges, dict) else None
        return int(free) // max(1, tp.get(addr, 1)) if isinstance(free, int | float) else None

    return ask

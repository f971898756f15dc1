"""Warm a pair before its first request: the handshakes a request would start, started now.

``warm`` is what ``serve-* --prewarm`` asks of each rank when a compatible peer of the other role
joins the cluster (``kvpush.fleet.prewarm``): P rank p starts the full handshake with every D
rank it writes into (``kvpush.peers.tp.targets``), D rank d the handshake of its mode
(``--handshake``, notif-only by default) with every P rank that writes into it
(``kvpush.peers.tp.sources``) -- exactly the keys and modes a request would use, so the first
request finds them connected. It only calls ``HandshakeManager.ensure``: single-flight (a request
arriving meanwhile joins the same handshake instead of starting another), on the manager's own
handshake threads; nothing here waits. A peer already connected in a sufficient mode is returned
as its connection (the caller checks its incarnation).

Threads: any (the prewarmer's workers). Pure dispatch over the peer table's own locks.
"""

from __future__ import annotations

from concurrent.futures import Future

from kvpush.config import EndpointConfig, HandshakeMode, Role
from kvpush.errors import HandshakeError
from kvpush.peers.handshakes import HandshakeManager, PeerConn, peer_name
from kvpush.peers.tp import sources, targets
from kvpush.peers.validation import mode_satisfies
from kvpush.peers.vllm_peer import PeerHint

Warm = Future[PeerConn] | PeerConn


def warm(
    hs: HandshakeManager,
    cfg: EndpointConfig,
    host: str,
    port: int,
    peer_tp: int,
    engine_id: str,
) -> list[Warm]:
    """Start (or find) every connection rank ``cfg.tp_rank`` would use with the peer endpoint at
    ``host:port`` of ``peer_tp`` ranks and engine ``engine_id``: a future per handshake started
    or joined, the connection itself where one is there already."""
    if cfg.role == Role.PREFILL:
        ranks = targets(cfg.tp_rank, cfg.tp_size, peer_tp)
        mode, peer_role = HandshakeMode.FULL, Role.DECODE
    else:
        ranks = sources(cfg.tp_rank, cfg.tp_size, peer_tp)
        mode, peer_role = cfg.handshake_mode, Role.PREFILL
    out: list[Warm] = []
    for r in ranks:
        key = (host, port, r)
        conn = hs.get(key)
        if conn is not None and mode_satisfies(conn.mode, mode):
            out.append(conn)
            continue
        fut = hs.ensure(key, mode, PeerHint(engine_id, peer_tp, role=peer_role))
        if fut is None:
            conn = hs.get(key)
            if conn is not None:
                out.append(conn)
                continue
            # Connected and forgotten in between: not warm yet (tried again later).
            fut = Future()
            fut.set_exception(HandshakeError(peer_name(key), "connected, then forgotten at once"))
        out.append(fut)
    return out

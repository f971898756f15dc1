"""What an endpoint answers on its side channel about itself: pure functions of its metadata.

``get_meta_payload`` answers vLLM's ``get_meta_msg``, every client's first contact, always in
vLLM's two-part form:

* on kvpush's wire the payload says "kvpush" under the extra key vLLM's decoder ignores and
  carries no NIXL metadata: its compatibility hash can never equal a vLLM engine's and its
  empty ``agent_metadata_bytes`` fail vLLM's decoder cleanly, so a vLLM engine that asks stops
  before it could load anything. With a token set, only "kvpush, token needed" is told.
* on vLLM's wire (``--wire vllm``) it is a real ``NixlHandshakePayload``: the configured
  compatibility hash and ``NixlAgentMetadata`` that passes vLLM's full validation, plus the
  kvpush key (wire ``vllm``), so kvpush tools still know who answered.

What a served rank's answer carries is the endpoint's dialect's (``kvpush.peers.dialect``);
who may be told anything (token, starting, rank) is decided here, the same for both wires.
"""

from __future__ import annotations

from kvpush import PROTOCOL_VERSION, __version__
from kvpush.peers.dialect import Dialect
from kvpush.wire import protocol, vllm


def _identity(
    md: protocol.EndpointMetadata, dialect: Dialect, error: str = "", stopping: bool = False
) -> vllm.KvpushIdentity:
    return vllm.KvpushIdentity(
        protocol=PROTOCOL_VERSION,
        version=__version__,
        wire=dialect.wire.value,
        role=md.role,
        engine_id=md.engine_id,
        incarnation=md.incarnation,
        tp_size=md.tp_size,
        ranks=[(0, r) for r in range(md.tp_size)],
        error=error,
        stopping=stopping,
    )


def get_meta_payload(
    md: protocol.EndpointMetadata | None,
    dialect: Dialect,
    auth_enabled: bool,
    agent_md_full: bytes,
    ranks: tuple[int, int],
    stopping: bool = False,
    closed: bool = False,
) -> vllm.HandshakePayload:
    """``stopping``: the endpoint drains (it still serves what it holds); ``closed``: its roles
    have stopped, and the answer carries no metadata any peer could load."""
    if auth_enabled or md is None:
        ident = vllm.KvpushIdentity(
            protocol=PROTOCOL_VERSION,
            auth=auth_enabled,
            error=vllm.SHUT_DOWN if closed else ("" if md else "starting"),
            stopping=stopping or closed,
        )
        return vllm.HandshakePayload("", b"", ident)
    if closed:  # who it is, and that nothing of it may be loaded any more
        return vllm.HandshakePayload("", b"", _identity(md, dialect, vllm.SHUT_DOWN, stopping=True))
    if ranks != (0, md.tp_rank):
        error = f"rank ({ranks[0]}, {ranks[1]}) is not served here"
        return vllm.HandshakePayload("", b"", _identity(md, dialect, error, stopping))
    compat_hash, amd = dialect.answer(md, agent_md_full)
    return vllm.HandshakePayload(compat_hash, amd, _identity(md, dialect, stopping=stopping))


def refuse_handshake(
    dialect: Dialect, tp_size: int, req: protocol.HandshakeReq
) -> protocol.ErrorRep | None:
    """kvpush's own handshake is refused on vLLM's wire and for a rank this endpoint lacks."""
    refusal = dialect.refuse_handshake(req)
    if refusal is not None:
        return refusal
    if req.tp_rank >= tp_size:
        return protocol.ErrorRep(
            rid=req.rid,
            code="no_such_rank",
            message=f"rank {req.tp_rank} is not served here (ranks 0..{tp_size - 1})",
            hint="ask for a rank the endpoint serves ('kvpush probe' lists them)",
        )
    return None

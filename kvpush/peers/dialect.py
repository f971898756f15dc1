"""One dialect object per wire: what differs between kvpush's wire and vLLM 0.33's push wire.

An endpoint speaks one wire to all its peers (``EndpointConfig.wire``); ``dialect_for`` chooses
its dialect once, and every rank's engine asks that object instead of testing which wire it
speaks. A dialect says:

* how transfers are keyed: a transfer id (kvpush), or vLLM's base request id, which P's and D's
  request ids share (``transfer_key``, ``registration_key``);
* how long a WRITE may take: kvpush's deadline by size, or none on vLLM's wire, where no fence
  could tell D that a late WRITE is over (``write_deadline``);
* which D rank a PUSH_REG stands for: the one it names (kvpush), or on vLLM's wire, which names
  none, this P rank's one target -- or all of them, the fan-out (``d_rank``);
* how a peer's metadata is fetched and checked over the side channel (``fetch``): kvpush's
  ``HandshakeReq`` / ``HandshakeRep``, or vLLM's ``get_meta_msg`` answer checked the way vLLM's
  own client checks it; the loading of the agent after it is the handshake manager's, shared;
* the notification codec (``codec``), and what D does with the blocks of a request it failed
  while P may still write them: tell P with a Cancel (kvpush), or, on vLLM's wire, which has no
  cancel, hold them until P's lease runs out (``abandoned_until``);
* what an endpoint answers about itself (``answer``: the compatibility hash and NIXL metadata
  of its ``get_meta_msg`` answer; ``refuse_handshake``), and whether its requests carry a vLLM
  router's ``kv_transfer_params`` and its side channel declines.

Pure but for ``fetch``, which runs on a handshake thread with that thread's client.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec

from kvpush.config import EndpointConfig, HandshakeMode, Role, Timeouts, VllmWireConfig, Wire
from kvpush.errors import HandshakeError, WrongWireError
from kvpush.peers.validation import check_reply
from kvpush.peers.vllm_peer import PeerHint, check_peer_role, check_vllm_answer
from kvpush.transport.client import SideChannelClient
from kvpush.wire import protocol, vllm
from kvpush.wire.auth import Authenticator
from kvpush.wire.notifs import Codec, NotifCodec, VllmNotifCodec


@dataclass(frozen=True)
class Ask:
    """What a handshake asks of one peer rank: who asks, and what it knows of the peer."""

    peer: str  # the peer's name in messages (host:port rank)
    rank: int
    mode: HandshakeMode
    hint: PeerHint
    local: protocol.EndpointMetadata
    local_hash: str  # protocol.compat_hash(local), computed once per manager


@dataclass(frozen=True)
class Fetched:
    """A peer rank's metadata, fetched and checked, for the handshake manager to load."""

    metadata: protocol.EndpointMetadata
    agent_metadata: bytes
    server_clock: float  # the peer's wall clock when it answered (for the clock offset)
    block_strides: list[int] | None = None  # per region; None: the block length


class Dialect(Protocol):
    """The wire an endpoint speaks, as the engine asks it (see the module's docstring)."""

    wire: Wire
    codec: Codec
    # Requests carry a vLLM router's ``kv_transfer_params`` (P names its engine id, request id
    # and TP size there, and that stands).
    kv_transfer_params: bool
    # Side-channel declines exist (kvpush's own message; a vLLM peer drops on it).
    declines: bool

    def transfer_key(self, transfer_id: str) -> str:
        """P's table key of a transfer (also the owner of its blocks)."""
        ...

    def registration_key(self, reg: protocol.PushReg) -> str:
        """P's table key of the transfer a PUSH_REG registers for."""
        ...

    def write_deadline(self, t_post: float, nbytes: int, timeouts: Timeouts) -> float:
        """When a WRITE of ``nbytes`` posted at ``t_post`` (monotonic) is abandoned."""
        ...

    def d_rank(self, reg: protocol.PushReg, mine: tuple[int, ...]) -> int | None:
        """The D rank a PUSH_REG stands for, given the D ranks this P rank writes (``mine``);
        None: it stands for all of ``mine`` (the fan-out)."""
        ...

    def abandoned_until(self, now: float, timeouts: Timeouts) -> float | None:
        """D failed a request that P may still write: None to tell P with a Cancel (P's
        completion or fence then ends the wait), else until when its blocks stay held."""
        ...

    def fetch(self, client: SideChannelClient, ask: Ask) -> Fetched:
        """A peer rank's metadata over ``client``, checked before anything reaches NIXL."""
        ...

    def compat_hash(self, md: protocol.EndpointMetadata) -> str:
        """The compatibility hash peers of this endpoint must share."""
        ...

    def answer(self, md: protocol.EndpointMetadata, agent_md_full: bytes) -> tuple[str, bytes]:
        """What a served rank's ``get_meta_msg`` answer carries: compatibility hash, and
        vLLM's ``NixlAgentMetadata`` (empty where no vLLM engine may load it)."""
        ...

    def refuse_handshake(self, req: protocol.HandshakeReq) -> protocol.ErrorRep | None:
        """Why kvpush's own handshake request is refused on this wire (None: served)."""
        ...


class KvpushDialect:
    """kvpush's own wire: authenticated framing, failures, cancels, fences and declines."""

    wire = Wire.KVPUSH
    kv_transfer_params = False
    declines = True

    def __init__(self, auth: Authenticator, max_notif_bytes: int = protocol.MAX_NOTIF_BYTES):
        self.codec: Codec = NotifCodec(auth, max_notif_bytes)

    def transfer_key(self, transfer_id: str) -> str:
        return transfer_id

    def registration_key(self, reg: protocol.PushReg) -> str:
        return reg.transfer_id or reg.request_id

    def write_deadline(self, t_post: float, nbytes: int, timeouts: Timeouts) -> float:
        return t_post + timeouts.write_deadline_s(nbytes)

    def d_rank(self, reg: protocol.PushReg, mine: tuple[int, ...]) -> int | None:
        return reg.decode_tp_rank

    def abandoned_until(self, now: float, timeouts: Timeouts) -> float | None:
        return None

    def fetch(self, client: SideChannelClient, ask: Ask) -> Fetched:
        peer, hint, local = ask.peer, ask.hint, ask.local
        client.identify(0, 0)
        kv = client.identity.kvpush if client.identity is not None else None
        if kv is not None and kv.wire == Wire.VLLM.value:
            raise WrongWireError(
                f"{peer} is a kvpush endpoint speaking vLLM's wire (--wire vllm)",
                "vllm",
                "start this endpoint with --wire vllm too, or that one without it",
            )
        if kv is not None:  # without a token: who it is, before anything is sent
            check_peer_role(peer, hint, kv.role, kv.incarnation, local.incarnation)
        rep = client.request(
            protocol.HandshakeReq(mode=ask.mode.value, requester=local.engine_id, tp_rank=ask.rank)
        )
        if not isinstance(rep, protocol.HandshakeRep):
            raise HandshakeError(peer, f"unexpected reply {type(rep).__name__}")
        md = check_reply(local, ask.local_hash, rep, peer)
        check_peer_role(peer, hint, md.role, md.incarnation, local.incarnation)
        if md.tp_rank != ask.rank:
            raise HandshakeError(peer, f"asked for rank {ask.rank}, got rank {md.tp_rank}")
        return Fetched(md, rep.agent_metadata, rep.server_clock)

    def compat_hash(self, md: protocol.EndpointMetadata) -> str:
        return protocol.compat_hash(md)

    def answer(self, md: protocol.EndpointMetadata, agent_md_full: bytes) -> tuple[str, bytes]:
        # A hash no vLLM engine has, and no metadata: a vLLM engine that asks stops cleanly.
        return "kvpush:" + protocol.compat_hash(md), b""

    def refuse_handshake(self, req: protocol.HandshakeReq) -> protocol.ErrorRep | None:
        return None


class VllmDialect:
    """vLLM 0.33's push wire exactly (VLLM_INTEROP.md): no tokens, no failure, cancel, fence
    or decline messages; requests matched by base request id."""

    wire = Wire.VLLM
    kv_transfer_params = True
    declines = False

    def __init__(self, wire: VllmWireConfig, max_notif_bytes: int = protocol.MAX_NOTIF_BYTES):
        self.config = wire
        self.codec: Codec = VllmNotifCodec(max_notif_bytes)

    def transfer_key(self, transfer_id: str) -> str:
        return vllm.base_request_id(transfer_id)

    def registration_key(self, reg: protocol.PushReg) -> str:
        return vllm.base_request_id(reg.request_id)

    def write_deadline(self, t_post: float, nbytes: int, timeouts: Timeouts) -> float:
        return math.inf  # vLLM has none, and no fence could tell its D a late WRITE is over

    def d_rank(self, reg: protocol.PushReg, mine: tuple[int, ...]) -> int | None:
        # vLLM's PUSH_REG names no rank: P_tp >= D_tp leaves one target; D_tp = k * P_tp has
        # every one of the k D ranks register, and the first stands for all (prefill.ranks).
        return mine[0] if len(mine) <= 1 else None

    def abandoned_until(self, now: float, timeouts: Timeouts) -> float | None:
        # No cancel and no fence: P may still WRITE until its lease, no longer renewed, runs
        # out; only then are these blocks anybody's again.
        return now + timeouts.lease_s + timeouts.write_base_s

    def fetch(self, client: SideChannelClient, ask: Ask) -> Fetched:
        ident = client.identify(0, ask.rank)
        role = Role.DECODE if ask.local.role == Role.PREFILL else Role.PREFILL
        vp = check_vllm_answer(ask.peer, ident.payload, ask.local, self.config, ask.hint, role)
        md = msgspec.structs.replace(vp.metadata, tp_rank=ask.rank)
        server_clock = time.time() - (time.perf_counter() - ident.remote_clock)
        return Fetched(md, vp.agent_metadata, server_clock, vp.block_strides)

    def compat_hash(self, md: protocol.EndpointMetadata) -> str:
        return self.config.compat_hash

    def answer(self, md: protocol.EndpointMetadata, agent_md_full: bytes) -> tuple[str, bytes]:
        v = self.config
        amd = vllm.build_agent_metadata(
            engine_id=md.engine_id,
            agent_metadata=agent_md_full,
            base_addrs=list(md.region_base_addrs),
            device_id=md.device_id,
            num_blocks=md.num_blocks,
            block_len=md.block_bytes,
            kv_cache_layout=md.kv_layout,
            block_size=v.block_size,
            attn_backend_name=v.attn_backend_name,
            region_names=list(v.region_names) if v.region_names else None,
            mem_type=md.device_kind,
        )
        return v.compat_hash, amd

    def refuse_handshake(self, req: protocol.HandshakeReq) -> protocol.ErrorRep | None:
        return protocol.ErrorRep(
            rid=req.rid,
            code="wrong_wire",
            message="this endpoint speaks vLLM's push wire (--wire vllm)",
            hint="handshake with it as a vLLM peer: start the other side with --wire vllm",
        )


def dialect_for(cfg: EndpointConfig, auth: Authenticator) -> Dialect:
    """The dialect of ``cfg``'s wire: the one place that asks which wire an endpoint speaks."""
    if cfg.wire == Wire.VLLM and cfg.vllm is not None:  # the config refuses vllm without it
        return VllmDialect(cfg.vllm, cfg.max_notif_bytes)
    return KvpushDialect(auth, cfg.max_notif_bytes)

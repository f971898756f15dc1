"""What a decode request asks of D, as one frozen value handed down whole.

``DecodeOrder`` is the request as the side channel (or a caller in the same process) states it:
which transfer, from which P, how many blocks, by when, and how to answer. ``DecodeGroup``
takes one per request and hands each rank its own copy (``for_rank``); ``DecodeRole`` turns it
into the receiver's request. ``VllmLeg`` holds a vLLM P's coordinates from its
``kv_transfer_params``. Pure data; any thread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvpush.address import format_address
from kvpush.wire import protocol


@dataclass(frozen=True)
class VllmLeg:
    """The parts of a vLLM P's ``kv_transfer_params`` a D request needs."""

    remote_engine_id: str
    remote_request_id: str
    remote_tp_size: int = 1
    remote_pp_size: int = 1


@dataclass(frozen=True)
class DecodeOrder:
    """One decode request.

    ``deadline_s``: 0 takes the endpoint's ``request_deadline_s``. ``vllm_params``: a vLLM P's
    coordinates; D's request id then shares the base of P's (``<base>-<8 hex>``, how vLLM
    matches them) and the transfer id is P's request id (what heartbeats name). ``digest``:
    answer with the sha256 of the received bytes. ``alloc_delay_s``: hold the request that long
    before it gets blocks, as a vLLM request waits in D's scheduler queue (D connects to P and
    heartbeats its lease meanwhile). ``hold``: an ok answer keeps the blocks (no digest on the
    rank): the rank group digests every rank's share, then frees them."""

    transfer_id: str
    prefill_address: str
    num_blocks: int
    deadline_s: float = 0.0
    request_id: str = ""
    vllm_params: VllmLeg | None = None
    digest: bool = False
    alloc_delay_s: float = 0.0
    hold: bool = False

    @classmethod
    def of(cls, req: protocol.DecodeReq) -> DecodeOrder:
        """The order a side-channel ``DecodeReq`` states."""
        return cls(
            transfer_id=req.transfer_id,
            prefill_address=format_address(req.prefill_host, req.prefill_port),
            num_blocks=req.num_blocks,
            deadline_s=req.deadline_s,
            request_id=req.request_id,
            vllm_params=VllmLeg(
                req.remote_engine_id, req.remote_request_id, req.remote_tp_size, req.remote_pp_size
            )
            if req.remote_engine_id
            else None,
            digest=req.digest,
            alloc_delay_s=req.alloc_delay_s,
        )

    def for_rank(self, request_id: str, *, hold: bool) -> DecodeOrder:
        """One rank's share of a request the group answers as a whole: every rank under the
        same request id, no digest of its own (the group digests the whole page)."""
        return dataclasses.replace(self, request_id=request_id, digest=False, hold=hold)

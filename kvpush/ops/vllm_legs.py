"""One leg of a vLLM push deployment, driven by hand: what a router-less operator runs.

* ``decode_leg``: hand a ``--wire vllm`` kvpush D the ``kv_transfer_params`` a vLLM P's
  ``request_finished`` returned; D allocates, registers with that P (PUSH_REG in vLLM's form),
  waits for P's WRITE and its completion notification, and answers with the outcome and the
  sha256 of what landed.
* ``prefill_leg``: ask a ``--wire vllm`` kvpush P to fill blocks for a request id; it answers
  with the ``kv_transfer_params`` a vLLM D needs (shown to the operator at once), then the
  outcome of the push -- WRITE done, or its lease lapsed -- and the sha256 of what it pushed.

The digest is sha256 over the request's bytes region by region in region order, each region's
blocks in the request's block order: the same on both sides when the bytes are the same.
Runs on the caller's thread; one side-channel connection per leg.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpush.config import format_address, parse_address
from kvpush.errors import ConfigError, KvpushError, PeerError
from kvpush.ops import control
from kvpush.wire import protocol

REQUIRED_PARAMS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
)


@dataclass(frozen=True)
class LegReport:
    leg: str  # "decode" | "prefill"
    address: str
    request_id: str
    outcome: str  # "ok" | "failed" | "pending"
    reason: str
    detail: str
    nbytes: int
    sha256: str
    seconds: float
    kv_transfer_params: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_params(text: str) -> dict[str, Any]:
    """``--kv-transfer-params``: a JSON object, or the path of a file holding one."""
    raw = text.strip()
    if not raw.startswith("{"):
        path = Path(raw)
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(
                f"cannot read --kv-transfer-params file {path}: {e.strerror}",
                "pass the JSON object itself, or the path of a file holding it",
            ) from None
        except UnicodeDecodeError:
            raise ConfigError(f"--kv-transfer-params file {path} is not UTF-8 text") from None
    try:
        params = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--kv-transfer-params is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
            "pass the map a vLLM P's request_finished returns, e.g. from its response",
        ) from None
    if not isinstance(params, dict):
        raise ConfigError("--kv-transfer-params must be a JSON object")
    missing = [k for k in REQUIRED_PARAMS if k not in params]
    if missing:
        raise ConfigError(
            f"--kv-transfer-params lacks {', '.join(missing)}",
            "a push-mode vLLM P returns remote_engine_id, remote_request_id, remote_host, "
            "remote_port, tp_size and pp_size",
        )
    if params.get("transfer_mode", "push") != "push":
        raise ConfigError(
            f"--kv-transfer-params are for transfer_mode {params['transfer_mode']!r}",
            "kvpush speaks vLLM's push mode (NixlPushConnector)",
        )
    return params


def blocks_of(params: Mapping[str, Any], blocks: int | None) -> int:
    """How many blocks D allocates: as many as P holds (vLLM refuses any other count)."""
    remote = params.get("remote_block_ids")
    if isinstance(remote, list) and remote and isinstance(remote[0], list):
        n = len(remote[0])
        if blocks is not None and blocks != n:
            raise ConfigError(
                f"--blocks {blocks} but P holds {n} blocks for this request",
                "drop --blocks: D must allocate exactly P's block count",
            )
        return n
    if blocks is None:
        raise ConfigError(
            "these kv_transfer_params do not say how many blocks P holds",
            "pass --blocks N (the request's prompt blocks)",
        )
    return blocks


def decode_leg(
    d_address: str,
    params: Mapping[str, Any],
    blocks: int | None,
    timeout_s: float,
    token: bytes | None = None,
    alloc_delay_s: float = 0.0,
) -> LegReport:
    """``alloc_delay_s``: D holds the request that long before it gets blocks (as a queued
    vLLM request does), heartbeating P's lease meanwhile."""
    n = blocks_of(params, blocks)
    host, port = parse_address(d_address)
    addr = format_address(host, port)
    req = protocol.DecodeReq(
        transfer_id=str(params["remote_request_id"]),
        prefill_host=str(params["remote_host"]),
        prefill_port=int(params["remote_port"]),
        num_blocks=n,
        deadline_s=timeout_s,
        remote_engine_id=str(params["remote_engine_id"]),
        remote_request_id=str(params["remote_request_id"]),
        remote_tp_size=int(params["tp_size"]),
        remote_pp_size=int(params.get("pp_size", 1)),
        digest=True,
        alloc_delay_s=alloc_delay_s,
    )
    t0 = time.monotonic()
    with control.connect(addr, token, timeout_s) as client:
        rep = client.request(req, timeout_s=timeout_s + alloc_delay_s + 5)
    if not isinstance(rep, protocol.DecodeRep):
        raise PeerError(f"{addr} answered a decode leg with {type(rep).__name__}")
    return LegReport(
        leg="decode",
        address=addr,
        request_id=rep.request_id,
        outcome=rep.outcome,
        reason=rep.reason,
        detail=rep.detail,
        nbytes=rep.nbytes,
        sha256=rep.sha256,
        seconds=time.monotonic() - t0,
        kv_transfer_params=dict(params),
    )


def prefill_leg(
    p_address: str,
    request_id: str,
    blocks: int,
    timeout_s: float,
    token: bytes | None = None,
    on_params: Callable[[dict[str, Any]], None] | None = None,
) -> LegReport:
    if not request_id:
        raise ConfigError("--request-id is empty", "pass the request id the vLLM D will use")
    host, port = parse_address(p_address)
    addr = format_address(host, port)
    t0 = time.monotonic()
    with control.connect(addr, token, timeout_s) as client:
        rep = client.request(
            protocol.PrefillReq(
                transfer_id=request_id, num_blocks=blocks, request_id=request_id, digest=True
            )
        )
        if not isinstance(rep, protocol.PrefillRep):
            raise PeerError(f"{addr} answered a prefill leg with {type(rep).__name__}")
        if rep.outcome != "ok":
            return LegReport("prefill", addr, request_id, "failed", rep.reason, "", 0, "", 0.0, {})
        params = dict(rep.kv_transfer_params)
        if not params:
            raise PeerError(
                f"{addr} is not on vLLM's wire: it returned no kv_transfer_params",
                "start the prefill endpoint with --wire vllm",
            )
        if on_params is not None:
            on_params(params)
        try:
            done = client.request(
                protocol.PushWaitReq(transfer_id=request_id, timeout_s=timeout_s),
                timeout_s=timeout_s + 5,
            )
        except KvpushError as e:
            raise PeerError(f"{addr}: waiting for the push of {request_id}: {e.message}") from e
    if not isinstance(done, protocol.PushWaitRep):
        raise PeerError(f"{addr} answered a push wait with {type(done).__name__}")
    return LegReport(
        leg="prefill",
        address=addr,
        request_id=request_id,
        outcome=done.outcome,
        reason=done.reason if done.outcome != "pending" else "deadline",
        detail=done.detail or ("" if done.outcome != "pending" else "no D wrote it in time"),
        nbytes=done.nbytes,
        sha256=done.sha256 or rep.sha256,
        seconds=time.monotonic() - t0,
        kv_transfer_params=params,
    )

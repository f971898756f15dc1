"""One leg of a vLLM push deployment, driven by hand: what a router-less operator runs.

* ``decode_leg``: hand a ``--wire vllm`` kvpush D the ``kv_transfer_params`` a vLLM P's
  ``request_finished`` returned; D allocates, registers with that P (PUSH_REG in vLLM's form),
  waits for P's WRITE and its completion notification, and answers with the outcome and the
  sha256 of what landed.
* ``prefill_leg``: ask a ``--wire vllm`` kvpush P to fill blocks for a request id; it answers
  with the ``kv_transfer_params`` a vLLM D needs (shown to the operator at once), then the
  outcome of the push -- WRITE done, or its lease lapsed -- and the sha256 of what it pushed.

Before a leg is sent, its endpoint is looked at (raw TCP first, then vLLM's ``get_meta_msg``
on the leg's own connection, no extra round trip): a vLLM engine, an endpoint of the other role,
or -- for a prefill leg -- a P on kvpush's own wire is refused with a typed error before
anything else is sent, so a vLLM peer named by mistake gets nothing but ``get_meta_msg``.

The digest is sha256 over the request's bytes region by region in region order, each region's
blocks in the request's block order: the same on both sides when the bytes are the same.
Runs on the caller's thread; one side-channel connection per leg.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.address import format_address, parse_address
from kvpush.commands.common import control
from kvpush.config import Role, require_positive
from kvpush.errors import ConfigError, KvpushError, PeerError, WrongWireError
from kvpush.wire import protocol

if TYPE_CHECKING:
    from kvpush.transport.client import SideChannelClient

REQUIRED_PARAMS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
)
#: The contact check (raw TCP, then ``get_meta_msg``) waits at most this long.
CONTACT_S = 5.0
#: The most blocks one leg may carry (``DecodeReq`` / ``PrefillReq`` bound).
MAX_BLOCKS = 1 << 16
#: The longest a D may hold a request before it gets blocks (``DecodeReq`` bound).
MAX_ALLOC_DELAY_S = 3600.0


@dataclass(frozen=True)
class LegReport:
    leg: Role
    address: str
    request_id: str
    outcome: str  # "ok" | "failed" | "pending"
    reason: str
    detail: str
    nbytes: int
    sha256: str
    seconds: float
    kv_transfer_params: dict[str, object]

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def load_params(text: str) -> dict[str, object]:
    """``--kv-transfer-params``: a JSON object, the path of a file holding one, or ``-`` for
    stdin. A whole vLLM response that carries the map under ``kv_transfer_params`` is taken
    too. The keys D needs are checked here, types included, so a bad map is refused before
    any peer is contacted."""
    raw = text.strip()
    if raw == "-":
        raw = sys.stdin.read()
        where = "--kv-transfer-params from stdin"
    elif not raw.startswith(("{", "[")):  # JSON given inline
        path = Path(raw)
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(
                f"cannot read --kv-transfer-params file {path}: {e.strerror}",
                "pass the JSON object itself, the path of a file holding it, or - for stdin",
            ) from None
        except UnicodeDecodeError:
            raise ConfigError(f"--kv-transfer-params file {path} is not UTF-8 text") from None
        where = f"--kv-transfer-params file {path}"
    else:
        where = "--kv-transfer-params"
    try:
        params = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{where} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
            "pass the map a vLLM P's request_finished returns (the kv_transfer_params of its "
            'response), e.g. \'{"remote_engine_id": ..., "remote_host": ...}\'',
        ) from None
    if isinstance(params, dict) and isinstance(params.get("kv_transfer_params"), dict):
        params = params["kv_transfer_params"]  # a whole vLLM response
    if not isinstance(params, dict):
        raise ConfigError(
            f"{where} must be a JSON object, not {type(params).__name__}",
            "pass the map a vLLM P's request_finished returns",
        )
    return check_params(params, where)


def check_params(
    params: dict[str, object], where: str = "--kv-transfer-params"
) -> dict[str, object]:
    """The router contract a decode leg needs: keys present, each of the right type."""
    missing = [k for k in REQUIRED_PARAMS if k not in params]
    if missing:
        raise ConfigError(
            f"{where} lacks {', '.join(missing)}",
            "a push-mode vLLM P returns remote_engine_id, remote_request_id, remote_host, "
            "remote_port, tp_size and pp_size: pass its kv_transfer_params unchanged",
        )
    if params.get("transfer_mode", "push") != "push":
        raise ConfigError(
            f"{where} are for transfer_mode {params['transfer_mode']!r}",
            "kvpush speaks vLLM's push mode (NixlPushConnector)",
        )
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        if not isinstance(params[key], str) or not params[key]:
            raise ConfigError(
                f"{where}: {key} must be a non-empty string, got {params[key]!r}",
                "pass the kv_transfer_params a vLLM P returned, unchanged",
            )
    for key, lo, hi in (("remote_port", 1, 65535), ("tp_size", 1, 4096), ("pp_size", 1, 4096)):
        value = params.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(
                f"{where}: {key} must be an integer in {lo}..{hi}, got {value!r}",
                "pass the kv_transfer_params a vLLM P returned, unchanged",
            )
    return params


def _checked_int(params: Mapping[str, object], key: str) -> int:
    """An integer key of params ``check_params`` let through (``pp_size`` defaults to 1)."""
    value = params.get(key, 1)
    if not isinstance(value, int):
        raise ConfigError(
            f"--kv-transfer-params: {key} must be an integer, got {value!r}",
            "pass the kv_transfer_params a vLLM P returned, unchanged",
        )
    return value


def blocks_of(params: Mapping[str, object], blocks: int | None) -> int:
    """How many blocks D allocates: as many as P holds (vLLM refuses any other count)."""
    remote = params.get("remote_block_ids")
    if isinstance(remote, list) and remote and isinstance(remote[0], list):
        n = len(remote[0])
        if n == 0:
            raise ConfigError(
                "these kv_transfer_params say P holds no blocks for this request",
                "nothing to receive: P finished the request without KV blocks to push",
            )
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
    return check_blocks(blocks)


def check_blocks(blocks: int) -> int:
    if not 1 <= blocks <= MAX_BLOCKS:
        raise ConfigError(
            f"--blocks must be in 1..{MAX_BLOCKS}, got {blocks}",
            f"pass --blocks between 1 and {MAX_BLOCKS}",
        )
    return blocks


def _contact(client: SideChannelClient, role: Role, timeout_s: float) -> None:
    """Identify the leg's endpoint on the leg's own connection (``get_meta_msg``: safe for a
    vLLM engine) and refuse one that cannot serve this leg, before anything else is sent."""
    addr = client.address
    wait = min(CONTACT_S, timeout_s)
    control.first_contact(addr, wait)
    kv = client.identify(timeout_s=wait).kvpush
    flag = "--decode" if role == Role.DECODE else "--prefill"
    if kv is None:
        raise WrongWireError(
            f"{addr} is a vLLM engine's side channel, not a kvpush {role} endpoint; nothing "
            "but get_meta_msg was sent to it",
            "vllm",
            "a vLLM D gets kv_transfer_params from its router: give --decode a kvpush D "
            "(serve-decode --wire vllm --like <vLLM P>)"
            if role == Role.DECODE
            else "a vLLM P hands out its own kv_transfer_params: give them to 'kvpush leg decode "
            "--decode D --kv-transfer-params', and --prefill a kvpush P (serve-prefill --wire "
            "vllm --like <vLLM D>)",
        )
    if kv.role and kv.role != role:
        raise ConfigError(
            f"{addr} is a {kv.role} endpoint, not {role}", f"give {flag} a {role} endpoint"
        )
    if role == Role.PREFILL and (kv.auth or (kv.wire and kv.wire != "vllm")):
        raise PeerError(
            f"{addr} is a kvpush P on kvpush's own wire: it cannot push into a vLLM D",
            "start it with serve-prefill --wire vllm --like <vLLM D>",
        )


def decode_leg(
    d_address: str,
    params: Mapping[str, object],
    blocks: int | None,
    timeout_s: float,
    token: bytes | None = None,
    alloc_delay_s: float = 0.0,
    trace: tuple[str, str] = ("", ""),
) -> LegReport:
    """``alloc_delay_s``: D holds the request that long before it gets blocks (as a queued
    vLLM request does), heartbeating P's lease meanwhile. ``trace``: the W3C traceparent and
    tracestate the request carries (D's span joins that trace)."""
    params = check_params(dict(params))
    n = blocks_of(params, blocks)
    require_positive("--timeout", timeout_s)
    if not 0 <= alloc_delay_s <= MAX_ALLOC_DELAY_S:
        raise ConfigError(
            f"--alloc-delay must be in 0..{MAX_ALLOC_DELAY_S:g} seconds, got {alloc_delay_s:g}",
            "pass how long D should hold the request before it gets blocks",
        )
    host, port = parse_address(d_address)
    addr = format_address(host, port)
    req = protocol.DecodeReq(
        transfer_id=str(params["remote_request_id"]),
        prefill_host=str(params["remote_host"]),
        prefill_port=_checked_int(params, "remote_port"),
        num_blocks=n,
        deadline_s=timeout_s,
        remote_engine_id=str(params["remote_engine_id"]),
        remote_request_id=str(params["remote_request_id"]),
        remote_tp_size=_checked_int(params, "tp_size"),
        remote_pp_size=_checked_int(params, "pp_size"),
        digest=True,
        alloc_delay_s=alloc_delay_s,
        traceparent=trace[0],
        tracestate=trace[1],
    )
    t0 = time.monotonic()
    with control.connect(addr, token, timeout_s) as client:
        _contact(client, Role.DECODE, timeout_s)
        rep = client.request(req, timeout_s=timeout_s + alloc_delay_s + 5)
    if not isinstance(rep, protocol.DecodeRep):
        raise PeerError(f"{addr} answered a decode leg with {type(rep).__name__}")
    return LegReport(
        leg=Role.DECODE,
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
    on_params: Callable[[dict[str, object]], None] | None = None,
    trace: tuple[str, str] = ("", ""),
) -> LegReport:
    if not request_id:
        raise ConfigError("--request-id is empty", "pass the request id the vLLM D will use")
    if len(request_id.encode()) > 256:
        raise ConfigError("--request-id is longer than 256 bytes", "pass a shorter request id")
    check_blocks(blocks)
    require_positive("--timeout", timeout_s)
    host, port = parse_address(p_address)
    addr = format_address(host, port)
    t0 = time.monotonic()
    with control.connect(addr, token, timeout_s) as client:
        _contact(client, Role.PREFILL, timeout_s)
        rep = client.request(
            protocol.PrefillReq(
                transfer_id=request_id,
                num_blocks=blocks,
                request_id=request_id,
                digest=True,
                traceparent=trace[0],
                tracestate=trace[1],
            )
        )
        if not isinstance(rep, protocol.PrefillRep):
            raise PeerError(f"{addr} answered a prefill leg with {type(rep).__name__}")
        if rep.outcome != "ok":
            return LegReport(
                leg=Role.PREFILL,
                address=addr,
                request_id=request_id,
                outcome="failed",
                reason=rep.reason,
                detail=rep.detail,
                nbytes=0,
                sha256="",
                seconds=time.monotonic() - t0,
                kv_transfer_params={},
            )
        params: dict[str, object] = dict(rep.kv_transfer_params)
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
        leg=Role.PREFILL,
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

"""The router role: send both legs of N requests to running P and D endpoints, collect results.

Owns ``Driver`` (behind ``kvpush drive`` and ``kvpush demo``). Threads: ``concurrency`` worker
threads, each owning its side-channel clients to the P endpoints, and one companion thread per
worker owning its clients to the D endpoints (side-channel clients are not thread-safe). A worker
takes the next request index, hands the decode leg to its companion (D registers its blocks with
P and answers only once the KV has landed and been verified), sends the prefill leg itself, then
waits for the decode reply: both legs are in flight together, as a push-mode router sends them.

Results are plain dataclasses; ``on_result`` is called from worker threads. Nothing here imports
typer or rich.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvpush.config import format_address, parse_address
from kvpush.errors import ConfigError, KvpushError, PeerError, PeerUnreachableError
from kvpush.ops import control
from kvpush.ops.stats import percentile
from kvpush.wire import protocol


@dataclass(frozen=True)
class DriveConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    requests: int = 100
    concurrency: int = 8
    rate: float | None = None  # requests started per second; None: as fast as concurrency allows
    blocks: int = 4
    timeout_s: float = 30.0
    auth_token: bytes | None = None
    run_id: str = ""
    preflight: bool = True

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ConfigError("no prefill endpoint given", "pass --prefill HOST:PORT")
        if not self.decode:
            raise ConfigError("no decode endpoint given", "pass --decode HOST:PORT")
        norm = tuple(format_address(*parse_address(a)) for a in self.prefill)
        object.__setattr__(self, "prefill", norm)
        norm = tuple(format_address(*parse_address(a)) for a in self.decode)
        object.__setattr__(self, "decode", norm)
        for name, value in (
            ("--requests", self.requests),
            ("--concurrency", self.concurrency),
            ("--blocks", self.blocks),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be positive, got {value}", f"pass {name} 1 or more")
        if self.blocks > 1 << 16:
            raise ConfigError(f"--blocks {self.blocks} is too large", "use at most 65536")
        if self.rate is not None and not self.rate > 0:
            raise ConfigError(
                f"--rate must be positive, got {self.rate:g}", "omit --rate for no limit"
            )
        if not self.timeout_s > 0:
            raise ConfigError(
                f"--timeout must be positive, got {self.timeout_s:g}", "pass --timeout > 0"
            )
        if not self.run_id:
            object.__setattr__(self, "run_id", uuid.uuid4().hex[:8])


@dataclass(frozen=True)
class RequestResult:
    index: int
    transfer_id: str
    prefill: str
    decode: str
    ok: bool
    reason: str  # "" when ok
    detail: str
    latency_s: float  # driver-measured: decode leg sent -> decode reply received
    nbytes: int
    verified: bool | None


@dataclass(frozen=True)
class DriveReport:
    requests: int
    ok: int
    failed: int
    verified: int
    failures_by_reason: dict[str, int]
    latency_s: dict[str, float]
    elapsed_s: float
    requests_per_s: float
    bytes_total: int
    gb_per_s: float
    by_decode: dict[str, int]
    by_prefill: dict[str, int]
    first_failures: list[str] = field(default_factory=list)

    @property
    def all_verified(self) -> bool:
        return self.requests > 0 and self.ok == self.requests and self.verified == self.requests

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "ok": self.ok,
            "failed": self.failed,
            "verified": self.verified,
            "all_verified": self.all_verified,
            "failures_by_reason": self.failures_by_reason,
            "first_failures": self.first_failures,
            "latency_s": self.latency_s,
            "elapsed_s": self.elapsed_s,
            "requests_per_s": self.requests_per_s,
            "bytes_total": self.bytes_total,
            "gb_per_s": self.gb_per_s,
            "by_decode": self.by_decode,
            "by_prefill": self.by_prefill,
        }


def summarize(results: list[RequestResult], elapsed_s: float) -> DriveReport:
    lat = sorted(r.latency_s for r in results if r.ok)
    ok = [r for r in results if r.ok]
    nbytes = sum(r.nbytes for r in ok)
    failures = [r for r in results if not r.ok]
    return DriveReport(
        requests=len(results),
        ok=len(ok),
        failed=len(failures),
        verified=sum(1 for r in ok if r.verified is True),
        failures_by_reason=dict(Counter(r.reason for r in failures).most_common()),
        latency_s={
            "p50": percentile(lat, 50),
            "p90": percentile(lat, 90),
            "p99": percentile(lat, 99),
            "max": lat[-1] if lat else 0.0,
        },
        elapsed_s=elapsed_s,
        requests_per_s=len(results) / elapsed_s if elapsed_s > 0 else 0.0,
        bytes_total=nbytes,
        gb_per_s=nbytes / elapsed_s / 1e9 if elapsed_s > 0 else 0.0,
        by_decode=dict(Counter(r.decode for r in results)),
        by_prefill=dict(Counter(r.prefill for r in results)),
        first_failures=[
            f"{r.transfer_id} via {r.decode}: {r.reason}{': ' + r.detail if r.detail else ''}"
            for r in failures[:5]
        ],
    )


def check_roles(cfg: DriveConfig, timeout_s: float = 5.0) -> None:
    """Fail fast: every endpoint answers and has the role it was given as."""
    for role, addrs in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        for addr in addrs:
            with control.connect(addr, cfg.auth_token, min(timeout_s, cfg.timeout_s)) as c:
                rep = c.request(protocol.HandshakeReq(mode="notif", requester="kvpush-drive"))
            if not isinstance(rep, protocol.HandshakeRep):
                raise PeerError(f"{addr} answered a handshake request with {type(rep).__name__}")
            md = protocol.decode_metadata_loose(rep.metadata)
            if md.get("role") != role:
                flag = "--prefill" if role == "prefill" else "--decode"
                raise ConfigError(
                    f"{addr} is a {md.get('role')} endpoint, not {role}",
                    f"give {flag} only {role} endpoints",
                )
            pool = md.get("num_blocks")
            if isinstance(pool, int) and cfg.blocks > pool:
                raise ConfigError(
                    f"--blocks {cfg.blocks} exceeds the pool of {addr} ({pool} blocks)",
                    f"use --blocks {pool} or fewer",
                )


class Driver:
    """Runs one batch of requests; ``add_decode`` may grow the D rotation while it runs."""

    def __init__(
        self,
        cfg: DriveConfig,
        on_result: Callable[[RequestResult], None] | None = None,
        before_request: Callable[[int], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self._on_result = on_result
        self._before = before_request
        self._lock = threading.Lock()
        self._decodes = list(cfg.decode)
        self._next = 0
        self._rr_p = 0
        self._rr_d = 0
        self._results: list[RequestResult] = []
        self._cancel = threading.Event()
        self._t0 = 0.0

    # ------------------------------------------------------------------ control (any thread)
    def add_decode(self, address: str) -> None:
        addr = format_address(*parse_address(address))
        with self._lock:
            if addr not in self._decodes:
                self._decodes.append(addr)

    def cancel(self) -> None:
        """Start no more requests; in-flight ones finish or time out."""
        self._cancel.set()

    @property
    def decodes(self) -> list[str]:
        with self._lock:
            return list(self._decodes)

    def progress(self) -> tuple[int, int, int]:
        """(done, ok, failed) so far."""
        with self._lock:
            ok = sum(1 for r in self._results if r.ok)
            return len(self._results), ok, len(self._results) - ok

    # ------------------------------------------------------------------ run
    def run(self) -> DriveReport:
        if self.cfg.preflight:
            check_roles(self.cfg)
        self._t0 = time.monotonic()
        threads = [
            threading.Thread(target=self._worker, name=f"drive-{i}", daemon=True)
            for i in range(min(self.cfg.concurrency, self.cfg.requests))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - self._t0
        with self._lock:
            results = sorted(self._results, key=lambda r: r.index)
        return summarize(results, elapsed)

    def _take(self) -> tuple[int, str, str] | None:
        with self._lock:
            if self._cancel.is_set() or self._next >= self.cfg.requests:
                return None
            i = self._next
            self._next += 1
            p = self.cfg.prefill[self._rr_p % len(self.cfg.prefill)]
            self._rr_p += 1
        if self._before is not None:
            self._before(i)
        with self._lock:
            d = self._decodes[self._rr_d % len(self._decodes)]
            self._rr_d += 1
        if self.cfg.rate:
            wait = self._t0 + i / self.cfg.rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        return i, p, d

    def _worker(self) -> None:
        p_clients: dict[str, Any] = {}
        d_clients: dict[str, Any] = {}  # touched only by the companion thread
        companion = ThreadPoolExecutor(1, thread_name_prefix=threading.current_thread().name + "-d")
        margin = 5.0
        try:
            while True:
                job = self._take()
                if job is None:
                    return
                i, p, d = job
                tid = f"{self.cfg.run_id}-{i}"
                ph, pp = parse_address(p)

                def decode_leg(d: str = d, tid: str = tid, ph: str = ph, pp: int = pp) -> Any:
                    c = d_clients.get(d)
                    if c is None:
                        c = d_clients[d] = control.connect(
                            d, self.cfg.auth_token, self.cfg.timeout_s
                        )
                    return c.request(
                        protocol.DecodeReq(
                            transfer_id=tid,
                            prefill_host=ph,
                            prefill_port=pp,
                            num_blocks=self.cfg.blocks,
                            deadline_s=self.cfg.timeout_s,
                        ),
                        timeout_s=self.cfg.timeout_s + margin,
                    )

                t0 = time.monotonic()
                fut: Future[Any] = companion.submit(decode_leg)
                prefill_err = ""
                try:
                    c = p_clients.get(p)
                    if c is None:
                        c = p_clients[p] = control.connect(
                            p, self.cfg.auth_token, self.cfg.timeout_s
                        )
                    prep = c.request(
                        protocol.PrefillReq(transfer_id=tid, num_blocks=self.cfg.blocks)
                    )
                    if isinstance(prep, protocol.PrefillRep) and prep.outcome != "ok":
                        prefill_err = f"prefill_{prep.reason or 'failed'}"
                except PeerUnreachableError:
                    prefill_err = "prefill_unreachable"
                except KvpushError as e:
                    prefill_err = f"prefill_error: {e.message}"
                self._record(i, tid, p, d, t0, fut, prefill_err)
        finally:
            companion.shutdown(wait=True)
            for c in p_clients.values():
                c.close()
            for c in d_clients.values():
                c.close()

    def _record(
        self, i: int, tid: str, p: str, d: str, t0: float, fut: Future[Any], prefill_err: str
    ) -> None:
        ok = False
        reason = detail = ""
        nbytes = 0
        verified: bool | None = None
        try:
            rep = fut.result()
            if isinstance(rep, protocol.DecodeRep):
                ok = rep.outcome == "ok"
                reason = "" if ok else (rep.reason or "failed")
                detail = rep.detail
                nbytes = rep.nbytes
                verified = rep.verified
            else:
                reason = f"unexpected reply {type(rep).__name__}"
        except PeerUnreachableError:
            reason = "decode_timeout"
            detail = f"no decode reply within {self.cfg.timeout_s:g}s"
        except KvpushError as e:
            reason = "decode_error"
            detail = e.message
        latency = time.monotonic() - t0
        if prefill_err and not ok:
            reason = prefill_err  # the cause; the decode leg's failure is its consequence
        result = RequestResult(i, tid, p, d, ok, reason, detail, latency, nbytes, verified)
        with self._lock:
            self._results.append(result)
        if self._on_result is not None:
            self._on_result(result)


def drive(
    cfg: DriveConfig, on_result: Callable[[RequestResult], None] | None = None
) -> DriveReport:
    return Driver(cfg, on_result).run()

"""Pure matching of P's finished blocks with D's PUSH_REGs, and P's leases. No threads, no I/O.

Either side may arrive first; both are keyed by ``transfer_id`` (the request id when a PUSH_REG
carries no transfer id). A finished request holds P blocks under a lease that starts when its
blocks finish; D's heartbeats renew it while D waits; an expired lease gives the blocks back.
A registration that never meets its blocks is dropped after ``reg_ttl_s`` (D's own deadline
fails the request on D's side).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpush.wire import protocol


@dataclass(frozen=True)
class Finished:
    key: str
    transfer_id: str
    request_id: str
    block_ids: np.ndarray
    t_finished: float  # monotonic


@dataclass(frozen=True)
class Registration:
    key: str
    reg: protocol.PushReg
    sender: str  # NIXL agent name the PUSH_REG came from ("" if in-process)
    t_arrived: float


@dataclass(frozen=True)
class Push:
    """A matched pair: P's blocks and D's registration, ready to be written."""

    finished: Finished
    registration: Registration
    attempt: int = 0

    @property
    def key(self) -> str:
        return self.finished.key


def reg_key(reg: protocol.PushReg) -> str:
    return reg.transfer_id or reg.request_id


class DuplicateError(ValueError):
    pass


class Matcher:
    def __init__(self, lease_s: float, reg_ttl_s: float) -> None:
        self.lease_s = lease_s
        self.reg_ttl_s = reg_ttl_s
        self._finished: dict[str, Finished] = {}
        self._regs: dict[str, Registration] = {}
        self._lease_until: dict[str, float] = {}  # key -> monotonic expiry (finished, unmatched)

    # ------------------------------------------------------------------ arrivals
    def add_finished(self, f: Finished, now: float) -> Push | None:
        if f.key in self._finished:
            raise DuplicateError(f"transfer {f.key} already finished and waiting")
        reg = self._regs.pop(f.key, None)
        if reg is not None:
            return Push(f, reg)
        self._finished[f.key] = f
        self._lease_until[f.key] = now + self.lease_s
        return None

    def add_registration(self, r: Registration) -> Push | None:
        if r.key in self._regs:
            raise DuplicateError(f"transfer {r.key} already registered")
        f = self._finished.pop(r.key, None)
        if f is not None:
            self._lease_until.pop(r.key, None)
            return Push(f, r)
        self._regs[r.key] = r
        return None

    # ------------------------------------------------------------------ leases and expiry
    def renew(self, keys: list[str], now: float) -> int:
        """Heartbeat: extend each waiting lease to at least now + 2/3 of its length."""
        n = 0
        ext = now + self.lease_s * 2 / 3
        for k in keys:
            if k in self._lease_until:
                if self._lease_until[k] < ext:
                    self._lease_until[k] = ext
                n += 1
        return n

    def expire(self, now: float) -> tuple[list[Finished], list[Registration]]:
        """Remove and return finished requests whose lease lapsed and stale registrations."""
        gone_f = [k for k, t in self._lease_until.items() if t <= now]
        fins = []
        for k in gone_f:
            del self._lease_until[k]
            fins.append(self._finished.pop(k))
        gone_r = [k for k, r in self._regs.items() if now - r.t_arrived > self.reg_ttl_s]
        regs = [self._regs.pop(k) for k in gone_r]
        return fins, regs

    def registration(self, key: str) -> Registration | None:
        return self._regs.get(key)

    def finished(self, key: str) -> Finished | None:
        return self._finished.get(key)

    def cancel(self, key: str) -> tuple[Finished | None, Registration | None]:
        self._lease_until.pop(key, None)
        return self._finished.pop(key, None), self._regs.pop(key, None)

    def drain_all(self) -> tuple[list[Finished], list[Registration]]:
        fins = list(self._finished.values())
        regs = list(self._regs.values())
        self._finished.clear()
        self._regs.clear()
        self._lease_until.clear()
        return fins, regs

    # ------------------------------------------------------------------ telemetry
    @property
    def finished_waiting(self) -> int:
        return len(self._finished)

    @property
    def regs_waiting(self) -> int:
        return len(self._regs)

    def waiting_keys(self) -> list[str]:
        return list(self._finished)

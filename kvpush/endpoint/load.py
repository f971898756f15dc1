"""What a load generator drives an endpoint with: the engine's own verbs, as ``Endpoint`` methods.

``LoadVerbs`` is mixed into ``kvpush.endpoint.core.Endpoint`` (kept apart so that the core stays
about building, serving and stopping). Nothing here re-implements a path the engine has:

* P's ``prefill`` and ``finish`` and D's ``decode`` are the groups' own (``kvpush.prefill.group``,
  ``kvpush.decode.group``) -- the wire's transfer keys, every rank reserved or none, a refusal
  told to the D ranks that registered -- so a measured call costs what a served request costs.
  ``finish`` is ``prefill`` without the pattern (a model that has just computed its KV, for timed
  parts whose D does not verify). Each is the group's method itself, with its signature and
  docstring (``_group_verb``), called on the endpoint's group;
* D's content check switched off for timed parts and on again (``set_verify``);
* the pool's free blocks and whether it is idle (``free_blocks``, ``pool_counts``,
  ``wait_idle``), read from every rank's allocator;
* a handshake forgotten on purpose (``forget_handshake``): rank 0's owner thread drops the peer
  as it drops one proven gone (``forget_peer``: its NIXL agent and descriptors released there,
  work in flight with it failed), and the call returns once that thread has done it;
* the bytes a handshake reply carries (``metadata_sizes``).

Threads: any. ``prefill``, ``finish`` and ``decode`` may run on several threads at once; the
others are cheap reads, or (``forget_handshake``) wait for the owner thread a few passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvpush.address import parse_address
from kvpush.config import EndpointConfig
from kvpush.decode.group import DecodeGroup
from kvpush.endpoint.rank import Rank
from kvpush.errors import KvpushError
from kvpush.peers.state import PeerGone
from kvpush.prefill.group import PrefillGroup
from kvpush.runtime.owner import OwnerThread
from kvpush.telemetry.names import Failure

_G = TypeVar("_G")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _group_verb(
    pick: Callable[[LoadVerbs, str], _G], method: Callable[Concatenate[_G, _P], _R]
) -> Callable[Concatenate[LoadVerbs, _P], _R]:
    """The group's ``method`` as the endpoint's verb of the same name and signature: called on
    the group ``pick`` returns (a KvpushError naming the verb on an endpoint of the other role)."""
    name = method.__name__

    def verb(self: LoadVerbs, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return method(pick(self, name), *args, **kwargs)

    verb.__name__, verb.__qualname__ = name, f"LoadVerbs.{name}"
    verb.__doc__ = method.__doc__
    return verb


class LoadVerbs:
    """The load verbs of an ``Endpoint`` (see the module docstring)."""

    cfg: EndpointConfig
    ranks: list[Rank[Any]]
    group: object  # the endpoint's PrefillGroup or DecodeGroup

    # ------------------------------------------------------------------ the groups
    def _p(self, verb: str) -> PrefillGroup:
        if not isinstance(self.group, PrefillGroup):
            raise KvpushError(f"{verb}() is P's", "call it on a prefill endpoint")
        return self.group

    def _d(self, verb: str) -> DecodeGroup:
        if not isinstance(self.group, DecodeGroup):
            raise KvpushError(f"{verb}() is D's", "call it on a decode endpoint")
        return self.group

    # ------------------------------------------------------------------ P and D: the groups' own
    # P: what a served ``PrefillReq`` does: every rank's share reserved (all or nothing), filled
    # with the pattern and handed to its writer; ``finish`` does it without the pattern (raises
    # ``NoFreeBlocksError`` when a rank's pool is full: check ``free_blocks`` first).
    prefill = _group_verb(_p, PrefillGroup.prefill)
    finish = _group_verb(_p, PrefillGroup.finish)
    # D: what a served ``DecodeReq`` does; the future's ``DecodeRep`` says how it ended and how
    # long it took (it never raises for a peer's failure). ``set_verify``: timed parts run
    # without the content check, then a verified pass checks the bytes.
    decode = _group_verb(_d, DecodeGroup.decode)
    set_verify = _group_verb(_d, DecodeGroup.set_verify)

    # ------------------------------------------------------------------ pool
    def free_blocks(self) -> int:
        """The fewest free blocks of any rank's pool (what one more transfer can count on)."""
        return min(rk.pool.allocator.counts()["free"] for rk in self.ranks)

    def pool_counts(self) -> dict[str, int]:
        """Every rank's allocator counts, summed (``total``, ``free``, ``quarantined``, ...)."""
        counts = [rk.pool.allocator.counts() for rk in self.ranks]
        return {k: sum(c[k] for c in counts) for k in counts[0]}

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Wait until no block is allocated or in flight (every push done or failed) or
        ``timeout_s`` passed; return the summed counts."""
        deadline = time.monotonic() + timeout_s
        while True:
            c = self.pool_counts()
            if c["free"] + c["quarantined"] == c["total"] or time.monotonic() > deadline:
                return c
            time.sleep(0.01)

    # ------------------------------------------------------------------ handshakes
    def forget_handshake(self, address: str, timeout_s: float = 10.0) -> None:
        """Forget rank 0's connections to the endpoint at ``address``, so that the next
        handshake starts from nothing: rank 0's owner thread drops them (``forget_peer``, reason
        ``peer_left``) and releases their NIXL resources; returns once it has."""
        host, port = parse_address(address)
        why = f"{address}: its handshake forgotten on purpose"
        role = self.ranks[0].role
        role.forget_peer(PeerGone(host, port, None, Failure.PEER_LEFT, why))
        _two_passes(role.owner, timeout_s, address)

    def metadata_sizes(self) -> dict[str, int]:
        """Bytes this endpoint sends in a handshake reply: its NIXL agent metadata in each mode
        and kvpush's own endpoint metadata."""
        rk = self.ranks[0]
        return {
            "agent_full": len(rk.agent_md_full),
            "agent_conn_only": len(rk.agent_md_conn),
            "endpoint": len(rk.md_bytes),
        }


def _two_passes(owner: OwnerThread, timeout_s: float, address: str) -> None:
    """Return once ``owner`` has run a whole pass that began after this call: what was handed to
    its inboxes before the call has been handled then (a pass drains every inbox). Its
    heartbeat counts the passes it began: the one under way now may have drained its inboxes
    already; the next one drains them, and is over when the one after it begins."""
    start = owner.heartbeat.count
    deadline = time.monotonic() + timeout_s
    while owner.heartbeat.count < start + 2:
        if not owner.alive or time.monotonic() > deadline:
            raise KvpushError(
                f"forgetting {address}: {owner.name} did not get to it in {timeout_s:g}s",
                "the rank is stopping or failed; its log says why",
            )
        time.sleep(0.0005)

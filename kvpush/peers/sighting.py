"""Who answers at a peer's side channel now: the data path's own evidence about a hint.

A registry event (a key deleted or lapsed, a record with another incarnation) is a *hint*: a
lapsed lease says only that etcd heard nothing for one TTL (a frozen process, a stalled etcd, a
wiped prefix), not that the process is gone. ``look`` asks the peer's side channel itself:

- ``refused``: nothing listens at the address any more -- the process that held it is gone
  (proof, as ``kvpush.peers.watch`` takes it);
- ``answers``: an endpoint answered and said its incarnation (vLLM's ``get_meta_msg`` first,
  which a kvpush endpoint answers with its identity; with a token set, an authenticated
  notif-only ``HandshakeReq``, whose reply carries the metadata). Another incarnation than the
  one held is proof that the old process no longer holds the address; the same one refutes the
  hint. A vLLM listener, or a kvpush endpoint still starting, is another process too
  (``incarnation`` empty, ``other_process``);
- a kvpush endpoint whose roles have stopped (its answer says ``stopping`` and "shutting down",
  and it refuses every request until its side channel closes) counts as ``refused``: it serves
  nothing more, whatever incarnation it names;
- ``silent``: a connection was accepted but nothing useful came back in time (a frozen or
  wedged process, a partition, a token this endpoint does not share): nothing is proven.

Runs on the caller's thread (the fleet membership's checker pool), bounded by ``timeout_s``.
Sends only what every first contact sends; no state of the peer changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvpush.address import format_address
from kvpush.errors import KvpushError
from kvpush.peers.watch import refused
from kvpush.transport.client import SideChannelClient
from kvpush.wire import protocol
from kvpush.wire.auth import Authenticator
from kvpush.wire.vllm import KvpushIdentity

LOOK_TIMEOUT_S = 2.0

SeenKind = Literal["refused", "answers", "silent"]


@dataclass(frozen=True)
class Sighting:
    kind: SeenKind
    incarnation: str = ""  # what answered (``answers``); empty: another process, no incarnation
    detail: str = ""

    def proves_gone(self, incarnation: str) -> bool:
        """True when the process of ``incarnation`` no longer holds the address."""
        return self.kind == "refused" or (
            self.kind == "answers" and self.incarnation != incarnation
        )


def _said(addr: str, kv: KvpushIdentity | None) -> Sighting | None:
    """What the first-contact answer proves by itself (None: a token hides the incarnation)."""
    if kv is None:
        return Sighting("answers", detail=f"a vLLM side channel answers at {addr}")
    if kv.shut_down:
        return Sighting("refused", detail=f"{addr} is shutting down: it serves nothing more")
    if kv.incarnation:
        return Sighting("answers", kv.incarnation, f"incarnation {kv.incarnation[:12]}")
    if kv.error:  # a kvpush endpoint still starting: a process of its own
        return Sighting("answers", detail=f"an endpoint answers at {addr}: {kv.error}")
    return None


def look(
    host: str,
    port: int,
    auth: Authenticator,
    requester: str,
    timeout_s: float = LOOK_TIMEOUT_S,
) -> Sighting:
    """Who answers at ``host:port`` now (see the module docstring)."""
    addr = format_address(host, port)
    if refused(host, port, min(1.0, timeout_s)):
        return Sighting("refused", detail=f"connection to {addr} refused")
    try:
        with SideChannelClient(host, port, auth=auth, timeout_s=timeout_s) as c:
            said = _said(addr, c.identify().kvpush)
            if said is not None:
                return said
            rep = c.request(protocol.HandshakeReq(mode="notif", requester=requester))
    except KvpushError as e:
        return Sighting("silent", detail=e.message)
    except OSError as e:
        return Sighting("silent", detail=f"{addr}: {e}")
    if not isinstance(rep, protocol.HandshakeRep):
        return Sighting("silent", detail=f"{addr} answered {type(rep).__name__}")
    try:
        inc = protocol.decode_metadata_loose(rep.metadata).get("incarnation")
    except KvpushError as e:
        return Sighting("silent", detail=f"{addr}: {e.message}")
    if not isinstance(inc, str) or not inc:
        return Sighting("silent", detail=f"{addr} answered without an incarnation")
    return Sighting("answers", inc, f"incarnation {inc[:12]}")

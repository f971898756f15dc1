"""Why a drive request failed: the ``Failure`` an error maps to (``commands.common.reasons``)."""

from __future__ import annotations

from kvpush.commands.common import reasons
from kvpush.config import Role
from kvpush.errors import PeerError, PeerUnreachableError
from kvpush.telemetry.names import Failure


def test_an_admitted_peer_answering_starting_is_another_process() -> None:
    e = PeerError("127.0.0.1:5600: starting")
    assert reasons.starting(e)
    reason, detail = reasons.from_served_error(e, Role.PREFILL)
    assert reason is Failure.PEER_RESTARTED
    assert "127.0.0.1:5600: starting" in detail


def test_other_refusals_keep_their_reasons() -> None:
    for e, want in (
        (PeerError("127.0.0.1:5600: bad transfer id"), Failure.BAD_REQUEST),
        (PeerError("decode endpoint is shutting down"), Failure.SHUTTING_DOWN),
        (PeerUnreachableError("127.0.0.1:5600 refused"), Failure.PREFILL_UNREACHABLE),
        (PeerError("127.0.0.1:5600: starting up the pool"), Failure.BAD_REQUEST),
    ):
        assert reasons.from_served_error(e, Role.PREFILL)[0] is want, e

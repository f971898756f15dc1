"""P's caps on what peers can make it hold, each with the reason a request over it is refused.

Every table or queue a peer can grow with valid-looking messages has a cap here; a message
over one is refused at once with the named reason (an ``ErrorRep`` code or a decline to D)
and counted as that failure kind. docs/reliability.md ("Caps and bounds") lists them with
what happens at each. Pure data.
"""

from __future__ import annotations

from kvpush.telemetry.names import Failure

#: ``PushWaitReq``s waiting at once (each is one entry of one timer heap, not a thread).
MAX_PUSH_WAITS = 4096
#: Transfers P remembers as declined or cancelled before their blocks finished
#: (``CancelledEarly``); a ``DeclineReq`` arriving at the cap is refused whole.
MAX_DECLINED_IDS = 65_536
#: D's registrations waiting for P's blocks (``Registered``); one more is declined to its D.
MAX_PENDING_REGISTRATIONS = 16_384

REASONS: dict[str, Failure] = {
    "MAX_PUSH_WAITS": Failure.TOO_MANY_WAITS,
    "MAX_DECLINED_IDS": Failure.TOO_MANY_DECLINED,
    "MAX_PENDING_REGISTRATIONS": Failure.TOO_MANY_REGISTRATIONS,
}

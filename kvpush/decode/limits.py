"""D's caps on what peers can make it hold, each with the reason a request over it is refused.

A decode request held back before it gets blocks (``alloc_delay_s``, as a vLLM request waits
in D's queue) costs D no blocks but a table row, a connection to P and heartbeats until its
time comes: their number is capped, and one over the cap is answered at once, failed with
``too_many_delayed``. docs/reliability.md ("Caps and bounds") lists every cap. Pure data.
"""

from __future__ import annotations

#: Decode requests held back for their ``alloc_delay_s`` at once.
MAX_DELAYED_REQUESTS = 4096

#: An abandoned request whose blocks stay quarantined this long is reported (once, with what
#: it waits on): a fence normally lands within a fence timeout or two.
QUARANTINE_REPORT_S = 10.0

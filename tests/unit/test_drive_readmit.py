"""Drive's memory of which process passed its checks at each address (``Readmission``): what
the peer monitor asks when a liveness answer comes back (``replaced``)."""

from __future__ import annotations

from kvpush.commands.common.results import DriveConfig
from kvpush.commands.drive.readmit import Readmission

P, D = "127.0.0.1:5600", "127.0.0.1:5601"


def _readmission() -> Readmission:
    cfg = DriveConfig(prefill=(P,), decode=(D,))
    meta = {
        P: {"role": "prefill", "incarnation": "p-one", "num_blocks": 64},
        D: {"role": "decode", "incarnation": "d-one", "num_blocks": 64},
    }
    return Readmission(cfg, meta)


def test_another_incarnation_or_a_start_where_one_served_is_another_process() -> None:
    ra = _readmission()
    assert not ra.replaced(P, "p-one", starting=False)  # the one that passed its checks
    assert ra.replaced(P, "p-two", starting=False)  # restarted at its port
    assert ra.replaced(D, "", starting=True)  # a serving endpoint never goes back to starting
    assert not ra.replaced(D, "", starting=False)  # no incarnation said (auth on): no proof


def test_an_address_never_checked_is_no_proof_either_way() -> None:
    ra = _readmission()
    assert not ra.replaced("127.0.0.1:5700", "x", starting=False)
    assert not ra.replaced("127.0.0.1:5700", "", starting=True)

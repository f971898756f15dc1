"""What an operator sees when a peer dies: D's log says it once, in kvpush's words (NIXL's own
glog lines stay out), real P and D processes on 127.0.0.1."""

from __future__ import annotations

import re
import threading
import time

import pytest

from tests.conftest import SMALL
from tests.support.fault_legs import Result, run_leg
from tests.support.procs import Launcher
from tests.support.waits import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

#: A glog/absl line: severity letter, MMDD, time, thread, file:line] (``E1201 21:40:02.1 ...]``).
GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ ", re.MULTILINE)


def test_p_death_is_one_kvpush_line_in_ds_log_not_nixl_glog(serve: Launcher) -> None:
    p = serve.serve("prefill", *SMALL)
    d = serve.serve("decode", *SMALL, "--heartbeat", "0.3", "--log-level", "info")
    out: list[Result] = []
    # D registers 2 requests with P, whose blocks P never gets (no P leg): D heartbeats P.
    legs = [
        threading.Thread(
            target=lambda i=i: out.append(
                run_leg(f"orphan-{i}", p.address, d.address, 2, send_p=False, d_timeout_s=30)
            )
        )
        for i in range(2)
    ]
    for t in legs:
        t.start()
    wait_for(lambda: '"heartbeats_sent"' in d.log_text(), 20, "D heartbeating P")
    p.kill()
    for t in legs:
        t.join(30)
    assert [r.reason for r in out] == ["prefill_dead"] * 2, out
    time.sleep(1.0)  # later heartbeats would find P gone again
    log = d.log_text()
    assert not GLOG.findall(log), log
    assert "genNotif" not in log, log  # NIXL's own (glog) words never reach D's log
    # kvpush's own words, once: the peer evicted, and why it went (NIXL's status, by name).
    gone = [ln for ln in log.splitlines() if "evicting peer" in ln and p.address in ln]
    assert len(gone) == 1 and "REMOTE_DISCONNECT" in gone[0], log

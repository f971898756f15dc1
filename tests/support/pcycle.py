"""Stop a P again and again under running Ds: the P side of the freeze stress (issue 16).

Usage: ``python -m tests.support.pcycle OUT_JSON CYCLES TP D_ADDR [D_ADDR ...]``. Each cycle opens
a real P endpoint in this process (``kvpush.endpoint.open_endpoint``: its own NIXL agents, its
own side channel on a free port), drives one request per D through it (so every D handshakes
with every rank of this P), and stops it: each P rank tells each D it stopped, and each D evicts
it -- the path on which issue 16's D froze. A P endpoint in one long-lived process costs ~50 ms
where a cold ``serve-prefill`` costs ~2.5 s of CPU (importing torch), which is what lets a few
hundred cycles fit in a test. Writes the totals (``cycles``, ``ok``, ``failed``, ``verified``,
``by_reason``, ``seconds``) as JSON to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import replace

from kvpush.commands.drive.driver import DriveConfig, Driver
from kvpush.config import EndpointConfig, PoolConfig, Role
from kvpush.endpoint import open_endpoint

POOL_CFG = PoolConfig(num_blocks=64, layers=2, block_bytes=4096)


def main() -> int:
    out, cycles, tp, decodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    t0 = time.monotonic()
    ok = failed = verified = 0
    reasons: Counter[str] = Counter()
    for _ in range(cycles):
        ep = open_endpoint(
            EndpointConfig(role=Role.PREFILL, tp_size=tp, pool=replace(POOL_CFG, tp_size=tp))
        )
        try:
            rep = Driver(
                DriveConfig(
                    prefill=(ep.address,),
                    decode=tuple(decodes),
                    requests=len(decodes),
                    concurrency=len(decodes),
                    blocks=2,
                    timeout_s=30,
                    preflight=False,  # the Ds were checked by the test; each P is fresh
                )
            ).run()
        finally:
            ep.stop()
        ok += rep.ok
        failed += rep.failed
        verified += rep.verified
        reasons.update(rep.failures_by_reason)
    result = {
        "cycles": cycles,
        "ok": ok,
        "failed": failed,
        "verified": verified,
        "by_reason": dict(reasons),
        "seconds": time.monotonic() - t0,
    }
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

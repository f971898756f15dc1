"""What NIXL 1.5.1's etcd backend does when etcd is down at publish time, and whether its watcher
drops an agent whose keys someone else deletes. Run as a script, with the repository on
PYTHONPATH, in a process of its own (NIXL reads NIXL_ETCD_* once, process-wide). Prints one JSON
object; ``tests/faults/test_fleet_registry.py`` asserts on it.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from kvpush.config import AgentConfig
from kvpush.fleet.etcd import Etcd
from kvpush.memory.descriptors import block_descs
from kvpush.transport.nixl import NixlAgent
from tests.support.etcd import EtcdServer


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        return probe(Path(tmp))


def probe(tmp: Path) -> int:
    server = EtcdServer(tmp / "etcd")  # ports chosen, not started
    ns = "/nixl/kvpush/probe"
    cfg = AgentConfig(etcd_endpoints=server.url, etcd_namespace=ns)
    out: dict[str, object] = {}
    a = NixlAgent("probe-a", cfg)
    buf = torch.zeros(4096, dtype=torch.uint8)
    a.register(buf)
    try:
        a.publish()  # etcd is down
        out["publish_while_down_raised"] = False
    except Exception as err:  # what kvpush would have to handle
        out["publish_while_down_raised"] = repr(err)
    server.start()
    try:
        e = Etcd([server.url])
        time.sleep(2)
        out["keys_after_etcd_came_up"] = [k for k, _ in e.get_prefix(ns + "/")[0]]
        a.publish()  # what kvpush's registrar does at every (re-)registration
        time.sleep(0.5)
        out["keys_after_publish_again"] = [k for k, _ in e.get_prefix(ns + "/")[0]]
        b = NixlAgent("probe-b", cfg)
        b.fetch_remote("probe-a", 10)
        out["b_loaded_a"] = True
        # A peer evicted and handshaken again keeps its agent name: loaded from etcd again, it
        # is usable, not refused as stale (what kvpush bench handshake's etcd rows do per round).
        descs = block_descs([buf.data_ptr()], 4, 1024, 0)
        b.release_dlist(b.prep_remote("probe-a", descs, "DRAM"))
        b.remove_remote("probe-a")
        b.fetch_remote("probe-a", 10)
        try:
            b.release_dlist(b.prep_remote("probe-a", descs, "DRAM"))
            out["b_reloaded_a_usable"] = True
        except Exception as err:
            out["b_reloaded_a_usable"] = repr(err)
        out["deleted"] = e.delete_prefix(f"{ns}/probe-a/")  # kvpush's cleanup after a lapse
        deadline = time.monotonic() + 10
        dropped = False
        while time.monotonic() < deadline and not dropped:
            dropped = not b._agent.check_remote_metadata("probe-a")
            time.sleep(0.1)
        out["b_dropped_a_after_delete"] = dropped
        b.close()
    finally:
        a.close()
        server.stop()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

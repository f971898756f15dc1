"""Issue 17's single cases, measured on whichever kvpush tree is the cwd (before / after).

    PYTHONPATH=$PWD .venv/bin/python scripts/hostile_cases.py CASE... [tp SIZES]

Cases: ``closed`` (a closed P port from D's request path), ``like`` (``--like`` a closed port),
``absurd`` (inf/nan/negative/huge timeout_s, deadline_s, alloc_delay_s), ``metrics`` (a busy
metrics port with a 2 GiB pool: exit status, seconds, peak RSS), ``waits`` (3,000 push waits:
threads and RSS), ``dup`` (a duplicate registration, and its newline-and-escape transfer id in
P's log), ``dd`` (a D told that another D, or itself, is its P), ``tp 2,4096,65536`` (claimed
vLLM TP sizes against a TP-1 P). Uses the test suite's launcher (``tests.support``): real
``kvpush serve-*`` processes on 127.0.0.1. A measuring script, not library code.
"""

# ruff: noqa: E501
import math
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from kvpush.wire import protocol
from tests.support.hostile import Flood, reason_of
from tests.support.procs import KVPUSH, Launcher, clean_env, wait_ready
from tests.support.procstats import ProcStats
from tests.support.side import request, snapshot


def free():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GEOM = ["--num-blocks", "256", "--layers", "2", "--block-bytes", "4096"]
which = sys.argv[1:]
tmp = Path(tempfile.mkdtemp())
L = Launcher(tmp)


def pair(*extra, d_extra=()):
    p = L.serve("prefill", *GEOM, *extra, wait=False)
    d = L.serve("decode", *GEOM, *extra, *d_extra, wait=False)
    wait_ready(p)
    wait_ready(d)
    return p, d


def dec(d, host, port, tid, timeout=90, **kw):
    t0 = time.monotonic()
    try:
        rep = request(
            d.address,
            protocol.DecodeReq(
                transfer_id=tid, prefill_host=host, prefill_port=port, num_blocks=2, **kw
            ),
            timeout_s=timeout,
        )
    except Exception as e:
        rep = f"{type(e).__name__}: {e}"
    return time.monotonic() - t0, rep


try:
    if "closed" in which:
        p, d = pair()
        t, rep = dec(d, "127.0.0.1", free(), "closed-1")
        print(
            f"CLOSED P PORT from D: {t:.2f}s {rep.reason if hasattr(rep, 'reason') else rep}: {getattr(rep, 'detail', rep)}"
        )
    if "like" in which:
        t0 = time.monotonic()
        r = subprocess.run(
            [*KVPUSH, "serve-decode", "--wire", "vllm", "--like", f"127.0.0.1:{free()}"],
            capture_output=True,
            text=True,
            env=clean_env(),
        )
        print(
            f"--like CLOSED PORT: {time.monotonic() - t0:.2f}s rc={r.returncode} {r.stderr.strip().splitlines()[-2:]}"
        )
    if "absurd" in which:
        p, d = pair()
        host, port = p.address.rsplit(":", 1)
        for v in (math.inf, math.nan, -1.0, 1e300):
            f = Flood(p.address)
            f.send(protocol.PushWaitReq(transfer_id="x", timeout_s=v))
            r = f.collect(1, 3)
            f.close()
            print(
                f"PushWaitReq timeout_s={v}: {[(type(x).__name__, reason_of(x), getattr(x, 'outcome', '')) for x in r.values()] or 'NO ANSWER in 3s'}"
            )
            for fld in ("deadline_s", "alloc_delay_s"):
                f = Flood(d.address)
                f.send(
                    protocol.DecodeReq(
                        transfer_id=f"a{uuid.uuid4().hex[:6]}",
                        prefill_host=host,
                        prefill_port=int(port),
                        num_blocks=1,
                        **{fld: v},
                    )
                )
                r = f.collect(1, 3)
                f.close()
                print(
                    f"DecodeReq {fld}={v}: {[(type(x).__name__, reason_of(x), getattr(x, 'message', '')[:80]) for x in r.values()] or 'NO ANSWER in 3s'}"
                )
        print(
            "P log exceptions:",
            p.log_text().count("Traceback"),
            [ln for ln in p.log_text().splitlines() if "Error" in ln][:3],
        )
    if "waits" in which:
        p, d = pair()
        b = ProcStats.of(p.popen.pid)
        f = Flood(p.address)
        for i in range(3000):
            f.send(protocol.PushWaitReq(transfer_id=f"w{i}", timeout_s=20))
        time.sleep(3)
        a = ProcStats.of(p.popen.pid)
        print(
            f"3000 PushWaitReq: threads {b.threads} -> {a.threads}, RSS {b.rss_mb:.0f} -> {a.rss_mb:.0f} MB"
        )
        f.close()
    if "dup" in which:
        p, d = pair(d_extra=("--request-deadline", "20"))
        host, port = p.address.rsplit(":", 1)
        tid = "dup\nFORGED 2026 ERROR kvpush: owned \x1b[31mred\x1b[0m"
        threading.Thread(
            target=lambda: dec(d, host, int(port), tid, request_id="A"), daemon=True
        ).start()
        time.sleep(1)
        t, rep = dec(d, host, int(port), tid, request_id="B")
        print(
            f"DUPLICATE REGISTRATION: second answered after {t:.1f}s: {getattr(rep, 'reason', rep)} {getattr(rep, 'detail', '')[:100]!r}"
        )
        lines = [ln for ln in p.log_text().splitlines() if ln.startswith("FORGED") or "\x1b" in ln]
        print(f"NEWLINE ID: P log lines forged: {len(lines)}: {lines[:2]!r}")
    if "dd" in which:
        d1 = L.serve("decode", *GEOM, wait=False)
        d2 = L.serve("decode", *GEOM, wait=False)
        wait_ready(d1)
        wait_ready(d2)
        for name, tgt in (("another D", d2), ("itself", d1)):
            host, port = tgt.address.rsplit(":", 1)
            t, rep = dec(d1, host, int(port), f"dd{uuid.uuid4().hex[:6]}", deadline_s=6)
            g = snapshot(d1.address)["gauges"]
            print(
                f"D told {name} is its P: {t:.1f}s {getattr(rep, 'reason', rep)}: {getattr(rep, 'detail', '')[:160]!r}; quarantined={g['pool_quarantined']}"
            )
        time.sleep(1)
        print(
            "  after:",
            {k: snapshot(d1.address)["gauges"][k] for k in ("pool_free", "pool_quarantined")},
            "D2 push_regs_received:",
            snapshot(d2.address)["counters"].get("push_regs_received"),
        )
    if "tp" in which:
        p, d = pair("--wire", "vllm", "--compat-hash", "5" * 64)
        host, port = p.address.rsplit(":", 1)
        for tp in [int(x) for x in (sys.argv[sys.argv.index("tp") + 1].split(","))]:
            b = ProcStats.of(d.popen.pid)
            t, rep = dec(
                d,
                host,
                int(port),
                f"t{tp}",
                timeout=120,
                remote_engine_id=p.engine_id,
                remote_request_id=f"t{tp}-{uuid.uuid4().hex[:6]}",
                remote_tp_size=tp,
            )
            s = snapshot(d.address)
            a = ProcStats.of(d.popen.pid)
            print(
                f"vLLM claimed remote_tp_size={tp}: {t:.1f}s {getattr(rep, 'reason', rep)}: {getattr(rep, 'detail', '')[:120]!r}; D handshakes_started={s['counters'].get('handshakes_started')} peer rows={len(s.get('peers', []))} RSS {b.rss_mb:.0f}->{a.rss_mb:.0f} MB"
            )
    if "metrics" in which:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            args = [
                *KVPUSH,
                "serve-prefill",
                "--port",
                "0",
                "--metrics-port",
                str(port),
                "--num-blocks",
                "2048",
                "--layers",
                "16",
                "--block-bytes",
                "32768",
            ]
            code = f"import resource,subprocess,sys,time\nt=time.monotonic()\np=subprocess.run({args!r},capture_output=True,text=True)\nprint(p.returncode, round(time.monotonic()-t,2), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss//1024)\nsys.stderr.write(p.stderr)"
            o = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env()
            )
            print(
                f"BUSY METRICS PORT, 2 GiB pool: rc, seconds, peak RSS MB = {o.stdout.split()}; {[ln for ln in o.stderr.splitlines() if ln.startswith(('error', 'hint'))]}"
            )
finally:
    L.close()

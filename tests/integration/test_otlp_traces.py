"""OpenTelemetry traces across drive, D and P (issue 28, part 1), with real parts: a real OTLP/HTTP
receiver (``tests.support.otlp.Collector``: ``POST /v1/traces`` decoded with the OpenTelemetry
proto package), real P and D processes (``serve-* --otlp-traces-endpoint``) and ``kvpush drive``
pushing through them.

* every request is one trace: drive's ``kvpush.request`` client span, D's ``kvpush.decode`` and
  P's ``kvpush.prefill`` server spans its children, each side's phases as child spans in order;
* P SIGKILLed mid-run: the failed requests' spans (drive's, and D's for the ones D held) have
  error status and the reason, D's last step the one it failed in;
* the collector down (a closed port): every push still ok, the spans dropped and counted
  (drive's ``--json``, the endpoints' ``kvpush_trace_spans_dropped_total`` and ``-o json``);
* tracing off: ``import kvpush.cli`` and a serve that pushes load no ``opentelemetry`` module;
* ``leg --traceparent`` (and ``$TRACEPARENT``) joins a trace a router started, on vLLM's wire.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvpush.commands.common.ports import free_port
from kvpush.telemetry.tracing.spans import D_CHAIN, DECODE, P_CHAIN, PREFILL, REQUEST
from tests.conftest import SMALL, run_cli
from tests.support.otlp import (
    KIND_CLIENT,
    KIND_INTERNAL,
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_OK,
    Collector,
    Span,
)
from tests.support.procs import KVPUSH, Launcher, Proc, clean_env, launch, serve_cmd, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

N = 12  # requests of the happy path


def _env(**extra: str) -> dict[str, str]:
    """The children's environment: no OpenTelemetry setting of the caller's but ``extra``."""
    env = clean_env(**extra)
    for k in [k for k in env if k.startswith("OTEL_") and k not in extra]:
        del env[k]
    return env


def _pair(procs: Launcher, *args: str, env: dict[str, str]) -> tuple[Proc, Proc]:
    """A P and a D started side by side (each takes seconds to come up), both ready."""
    p = procs.serve("prefill", *SMALL, *args, wait=False, env=env)
    d = procs.serve("decode", *SMALL, *args, wait=False, env=env)
    wait_ready(p)
    wait_ready(d)
    return p, d


def _traced(url: str) -> tuple[str, ...]:
    return ("--otlp-traces-endpoint", url)


def _named(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]


def _children(spans: list[Span], parent: Span) -> list[Span]:
    return sorted(
        (s for s in spans if s.parent_id == parent.span_id), key=lambda s: (s.start_ns, s.end_ns)
    )


def _whole(n: int) -> object:
    """A condition: ``n`` requests with drive's, D's and P's spans and every phase step."""

    def cond(spans: list[Span]) -> bool:
        names = [s.name for s in spans]
        return all(names.count(x) >= n for x in (REQUEST, DECODE, PREFILL)) and all(
            names.count(step) >= n for step, _, _ in (*D_CHAIN, *P_CHAIN)
        )

    return cond


def _check_steps(spans: list[Span], parent: Span, chain: tuple[tuple[str, object, object], ...]):
    kids = _children(spans, parent)
    assert [k.name for k in kids] == [name for name, _, _ in chain], kids
    prev_end = parent.start_ns
    for k in kids:
        assert k.kind == KIND_INTERNAL and k.service == parent.service, k
        assert k.status != STATUS_ERROR, k
        assert k.attrs.get("kvpush.phase"), k  # the stamp it ends at
        assert prev_end <= k.start_ns <= k.end_ns <= parent.end_ns, (parent, k)
        prev_end = k.end_ns


def test_every_request_is_one_trace_across_drive_d_and_p(tmp_path: Path) -> None:
    col = Collector()
    procs = Launcher(tmp_path)
    try:
        p, d = _pair(procs, *_traced(col.url), env=_env())
        r = run_cli(
            "drive", "-p", p.address, "-d", d.address, "-n", str(N), "-c", "4", "--json",
            *_traced(col.url), env=_env(),
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        out = json.loads(r.stdout)
        assert out["traces"] == {
            "endpoint": col.url,
            "sample_ratio": 1.0,
            "spans": N,
            "exported": N,
            "dropped": 0,
        }
        assert f"traces: {N} span(s) to {col.url}, {N} exported, 0 dropped" in r.stderr
        spans = col.wait_for(_whole(N))  # type: ignore[arg-type]
    finally:
        procs.close()
        col.close()
    traces: dict[str, list[Span]] = {}
    for s in spans:
        traces.setdefault(s.trace_id, []).append(s)
    assert len(traces) == N, {t: [s.name for s in ss] for t, ss in traces.items()}
    tids = set()
    for ss in traces.values():
        (req,) = _named(ss, REQUEST)
        (dec,) = _named(ss, DECODE)
        (pre,) = _named(ss, PREFILL)
        assert (req.service, req.kind, req.parent_id) == ("kvpush-drive", KIND_CLIENT, "")
        assert (dec.service, dec.kind, dec.parent_id) == ("kvpush-decode", KIND_SERVER, req.span_id)
        assert (pre.service, pre.kind, pre.parent_id) == (
            "kvpush-prefill",
            KIND_SERVER,
            req.span_id,
        )
        tid = req.attrs["kvpush.transfer_id"]
        tids.add(tid)
        for s in (req, dec, pre):
            assert s.status == STATUS_OK, s
            assert s.attrs["kvpush.transfer_id"] == tid and s.attrs["kvpush.outcome"] == "ok", s
            assert s.attrs["kvpush.bytes"] == req.attrs["kvpush.bytes"] == 4 * 4 * 4096, s
        assert dec.attrs["kvpush.peer"] == p.address and pre.attrs["kvpush.peer"] == d.address
        assert dec.attrs["kvpush.verified"] is True and dec.attrs["kvpush.wire"] == "kvpush"
        assert pre.attrs["kvpush.peer_rank"] == 0 and pre.attrs["kvpush.blocks"] == 4
        # One host, one clock: the server spans start inside drive's; D answers before drive
        # hears it (P's push ends with its own late view of the WRITE: no bound on its end).
        assert req.start_ns <= dec.start_ns <= dec.end_ns <= req.end_ns, (req, dec)
        assert req.start_ns <= pre.start_ns, (req, pre)
        _check_steps(ss, dec, D_CHAIN)
        _check_steps(ss, pre, P_CHAIN)
    assert len(tids) == N


def test_p_killed_mid_run_gives_error_spans_with_the_reason(tmp_path: Path) -> None:
    """P freezes under load (so D holds requests for it), then is SIGKILLed: the requests it
    took down fail, and their spans say so, with the reason."""
    col = Collector()
    procs = Launcher(tmp_path)
    try:
        p, d = _pair(procs, *_traced(col.url), env=_env())
        drive = subprocess.Popen(
            [*KVPUSH, "drive", "-p", p.address, "-d", d.address, "-n", "400", "-c", "4",
             "--timeout", "3", "--peer-grace", "0", "--json", *_traced(col.url)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        )  # fmt: skip
        try:
            col.wait_for(lambda ss: len(_named(ss, DECODE)) >= 5)
            p.popen.send_signal(signal.SIGSTOP)  # D holds requests registered with it...
            time.sleep(0.5)
            p.popen.kill()  # ...when it dies
            stdout, stderr = drive.communicate(timeout=60)
        finally:
            if drive.poll() is None:
                drive.kill()
        assert drive.returncode == 1, stdout + stderr
        out = json.loads(stdout)
        assert out["failed"] > 0 and out["traces"]["dropped"] == 0, out
        failed = out["failed"]

        def settled(ss: list[Span]) -> bool:
            bad_req = [s for s in _named(ss, REQUEST) if s.status == STATUS_ERROR]
            bad_dec = [s for s in _named(ss, DECODE) if s.status == STATUS_ERROR]
            return len(bad_req) == failed and len(bad_dec) >= 1

        spans = col.wait_for(settled)
    finally:
        procs.close()
        col.close()
    by_id = {s.span_id: s for s in spans}
    for s in _named(spans, REQUEST):
        if s.status != STATUS_ERROR:
            continue
        reason = s.attrs["kvpush.reason"]
        assert s.attrs["kvpush.outcome"] == "failed" and reason, s
        assert s.message.startswith(str(reason)), s
        assert s.attrs.get("kvpush.transfer_id"), s
    for dec in _named(spans, DECODE):
        if dec.status != STATUS_ERROR:
            continue
        reason = dec.attrs["kvpush.reason"]
        assert reason and dec.message.startswith(str(reason)), dec
        assert dec.attrs["kvpush.outcome"] == "failed", dec
        parent = by_id.get(dec.parent_id)
        assert parent is not None and parent.name == REQUEST, dec  # drive's span, same trace
        assert parent.status == STATUS_ERROR, parent
        kids = _children(spans, dec)
        assert kids, dec
        last = kids[-1]  # the step it failed in: D's last, from its start to the failure
        assert last.status == STATUS_ERROR and last.attrs["error.type"] == reason, last
        assert all(k.status != STATUS_ERROR for k in kids[:-1]), kids
        assert last.end_ns <= dec.end_ns


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on {url}")


def _wait_metric(url: str, name: str, at_least: float, timeout_s: float = 30.0) -> float:
    until = time.monotonic() + timeout_s
    while True:
        v = _metric(url, name)
        if v >= at_least or time.monotonic() >= until:
            return v
        time.sleep(0.1)


def test_a_collector_that_is_down_costs_dropped_spans_never_a_push(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    env = _env(OTEL_EXPORTER_OTLP_TRACES_TIMEOUT="1")
    procs = Launcher(tmp_path)
    try:
        mp, md = free_port(), free_port()
        p = procs.serve(
            "prefill", *SMALL, *_traced(url), "--metrics-port", str(mp), wait=False, env=env
        )
        d = procs.serve(
            "decode", *SMALL, *_traced(url), "--metrics-port", str(md), wait=False, env=env
        )
        wait_ready(p)
        wait_ready(d)
        name = "kvpush_trace_spans_dropped_total"
        assert _metric(f"http://127.0.0.1:{md}/metrics", name) == 0  # declared at 0
        n = 20
        r = run_cli(
            "drive", "-p", p.address, "-d", d.address, "-n", str(n), "-c", "4", "--json",
            *_traced(url), env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        out = json.loads(r.stdout)
        assert out["ok"] == n and out["all_verified"], out
        assert out["traces"]["spans"] == n and out["traces"]["exported"] == 0
        assert out["traces"]["dropped"] == n, out["traces"]
        # Each side's span and its 5 steps per request, all dropped, all counted.
        per = 1 + len(D_CHAIN)
        for port in (md, mp):
            got = _wait_metric(f"http://127.0.0.1:{port}/metrics", name, n * per)
            assert got == n * per, (port, got)
        # ... and in its -o json lines (one every 0.5 s).
        until = time.monotonic() + 10
        while True:
            lines = [ln for ln in d.log_text().splitlines() if ln.startswith("{")]
            last = json.loads(lines[-1])["counters"].get("trace_spans_dropped")
            if last == n * per or time.monotonic() >= until:
                break
            time.sleep(0.1)
        assert last == n * per, lines[-1]
        assert "span(s) dropped so far" in d.log_text()
    finally:
        procs.close()


def test_tracing_off_loads_no_opentelemetry(tmp_path: Path) -> None:
    code = (
        "import sys, kvpush.cli, kvpush.cli.app, kvpush.commands.serve.command, "
        "kvpush.commands.drive.command, kvpush.endpoint; "
        "otel = sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry'); "
        "assert not otel, otel"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=_env())
    # A serve without the flag, pushed through: its imports, as Python itself lists them.
    procs = Launcher(tmp_path)
    try:
        ready = tmp_path / "d.ready.json"
        cmd = serve_cmd("decode", ready, *SMALL)
        cmd[1:1] = ["-X", "importtime"]
        d = launch(cmd, ready, tmp_path / "d.log", role="decode", env=_env(), wait=False)
        procs.procs.append(d)
        p = procs.serve("prefill", *SMALL, env=_env(), wait=False)
        wait_ready(d)
        wait_ready(p)
        r = run_cli("drive", "-p", p.address, "-d", d.address, "-n", "4", "--json", env=_env())
        assert r.returncode == 0, r.stdout + r.stderr
        assert "traces" not in json.loads(r.stdout)
        assert d.stop() == 0
    finally:
        procs.close()
    log = d.log_text()
    assert "kvpush.telemetry.tracing" in log  # importtime lists what was loaded
    assert "opentelemetry" not in log


def test_legs_join_a_trace_a_router_started(tmp_path: Path) -> None:
    """vLLM's wire carries no trace context: the router's traceparent reaches kvpush through
    ``leg --traceparent``. Traced, the leg is the router's span's child and the endpoint's span
    the leg's; untraced, the leg hands the router's context to the endpoint as it is."""
    router = "00-" + "4b" * 16 + "-" + "a1" * 8 + "-01"
    trace_id, router_span = "4b" * 16, "a1" * 8
    col = Collector()
    procs = Launcher(tmp_path)
    try:
        geom = ["--num-blocks", "16", "--layers", "2", "--block-bytes", "4096"]
        wire = [*geom, "--kv-regions", "per-layer", "--wire", "vllm", "--compat-hash", "5" * 64]
        p = procs.serve("prefill", *wire, *_traced(col.url), wait=False, env=_env())
        d = procs.serve("decode", *wire, *_traced(col.url), wait=False, env=_env())
        wait_ready(p)
        wait_ready(d)
        leg_p = subprocess.Popen(
            [*KVPUSH, "leg", "prefill", "-p", p.address, "--request-id", "cmpl-tr-00000000",
             "--blocks", "2", "--json", "--traceparent", router, *_traced(col.url)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            env=_env(),
        )  # fmt: skip
        assert leg_p.stdout is not None
        handed = leg_p.stdout.readline()
        r = run_cli(
            "leg", "decode", "-d", d.address, "--kv-transfer-params", handed, "--json",
            env=_env(TRACEPARENT=router),  # OpenTelemetry's environment carrier
        )  # fmt: skip
        _out, err = leg_p.communicate(timeout=60)
        assert r.returncode == 0 and leg_p.returncode == 0, r.stderr + err
        spans = col.wait_for(
            lambda ss: len(_named(ss, PREFILL)) == 1 and len(_named(ss, DECODE)) == 1
        )
    finally:
        procs.close()
        col.close()
    assert {s.trace_id for s in spans} == {trace_id}
    (leg,) = _named(spans, REQUEST)
    (pre,) = _named(spans, PREFILL)
    (dec,) = _named(spans, DECODE)
    assert (leg.service, leg.kind, leg.parent_id) == ("kvpush-leg", KIND_CLIENT, router_span)
    assert leg.attrs["kvpush.outcome"] == "ok" and leg.attrs["kvpush.wire"] == "vllm"
    assert pre.parent_id == leg.span_id and pre.attrs["kvpush.wire"] == "vllm"
    assert dec.parent_id == router_span  # no span of the leg's own: the router's context
    assert dec.status == pre.status == STATUS_OK
    _check_steps(spans, dec, D_CHAIN[:3] + D_CHAIN[4:])  # a vLLM P's bytes are not verified

"""No endpoint freezes (issue 16): P stops, D evictions and simultaneous SIGTERMs under CPU load.

Every endpoint runs ``-o json --interval 0.5``: a line every half second from its main thread,
so a whole-process freeze shows as a gap in its lines, and its freeze watchdog counts any thread
(side channel, writer, receiver) or the whole process standing still (``watchdog_stalls``).

* ``test_a_stopped_process_is_reported_by_its_watchdog``: SIGSTOP a real D for 3 s (the whole
  process stands still, as under a native call holding the interpreter lock): once it runs
  again its log says so and ``-o json`` counts the stall.
* ``test_p_stops_and_d_evictions_under_load`` (slow): 200 P endpoints (TP 2) started, driven
  through three D processes and stopped, with two busy-loop processes on the host's two cores:
  each stop makes every D evict both P ranks (1,200 evictions). Every D keeps printing, counts no
  stall, and exits 0 within its drain timeout.
* ``test_simultaneous_sigterms_under_load`` (slow): 40 rounds of one P and four Ds SIGTERMed at
  the same instant after pushing load through them (200 SIGTERMs), under the same CPU load:
  every endpoint printed up to the signal and exited 0 within its drain timeout.
  The 200 endpoint processes come from ``tests.support.zygote`` (kvpush and torch imported
  once, forked per endpoint, each child running the CLI's own entry point): 200 cold starts
  would need more CPU than this host gives in the test's time.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpush.commands.drive.driver import DriveConfig, Driver
from tests.support.procs import ROOT, Launcher, Proc, clean_env, dump_stacks, wait_ready
from tests.support.zygote import Zygote

SMALL = ["--num-blocks", "64", "--layers", "2", "--block-bytes", "4096"]
INTERVAL = 0.5
MAX_GAP_S = 5.0  # the most a telemetry line may be late: 10 intervals
DRAIN_S = 10.0  # serve's default --drain-timeout: the exit bound after SIGTERM
# At least 200 of each (issue 16); more or fewer for a longer or quicker run.
P_CYCLES = int(os.environ.get("KVPUSH_FREEZE_CYCLES", "200"))
P_TP = 2
N_DECODE = 3
ROUNDS = int(os.environ.get("KVPUSH_FREEZE_ROUNDS", "40"))
PER_ROUND = 5  # one P, four Ds
START_S = 180.0  # starting is not what is tested: other work on this host may slow it a lot


def json_lines(text: str) -> list[dict[str, object]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def stamp(line: dict[str, object]) -> float:
    """A telemetry line's ``ts`` (wall-clock seconds)."""
    ts = line["ts"]
    assert isinstance(ts, int | float | str), line
    return float(ts)


def gaps(lines: list[dict[str, object]]) -> float:
    ts = [stamp(x) for x in lines]
    return max((b - a for a, b in itertools.pairwise(ts)), default=0.0)


def counter(line: dict[str, object], name: str) -> int:
    counters = line.get("counters", {})
    assert isinstance(counters, dict)
    return int(counters.get(name, 0))


def native_stacks(pid: int) -> str:
    """Where a process stands, Python and native frames (the harness's py-spy dump), kept in
    ``/tmp/kvpush-freeze-PID.txt`` too."""
    out = dump_stacks(pid)
    Path(f"/tmp/kvpush-freeze-{pid}.txt").write_text(out)
    return out


@contextlib.contextmanager
def cpu_load() -> Iterator[None]:
    """Two busy loops: one per core of this host (started once the endpoints are up: what is
    tested is stopping under load, not starting)."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], env=clean_env())
        for _ in range(2)
    ]
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait(10)


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    lau = Launcher(tmp_path)
    try:
        yield lau
    finally:
        lau.close()


def wait_line(
    p: Proc, cond: Callable[[dict[str, object]], bool], timeout: float = 30.0
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = json_lines(p.log_text())
        if lines and cond(lines[-1]):
            return lines[-1]
        time.sleep(0.1)
    raise AssertionError(f"no such telemetry line within {timeout}s:\n{p.log_text()[-3000:]}")


@pytest.mark.timeout(120)
def test_a_stopped_process_is_reported_by_its_watchdog(launcher: Launcher) -> None:
    d = launcher.serve("decode", *SMALL, "--watchdog-timeout", "1")
    line = wait_line(d, lambda x: True)
    assert counter(line, "watchdog_stalls") == 0
    gauges = line["gauges"]
    assert isinstance(gauges, dict) and "threads_stalled" in gauges, line
    d.popen.send_signal(signal.SIGSTOP)
    time.sleep(3)
    d.popen.send_signal(signal.SIGCONT)
    line = wait_line(d, lambda x: counter(x, "watchdog_stalls") >= 1)
    log = d.log_text()
    assert "watchdog: process made no progress for" in log
    # The threads did not stall on their own: only the process is reported.
    assert log.count("made no progress") == 1, log[-3000:]
    assert d.stop() == 0


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~1 min on an idle host; 13 min at load 30 (other work)
def test_p_stops_and_d_evictions_under_load(launcher: Launcher, tmp_path: Path) -> None:
    ds = [
        launcher.serve("decode", *SMALL, "--interval", str(INTERVAL), wait=False)
        for _ in range(N_DECODE)
    ]
    for d in ds:
        wait_ready(d, START_S)
        wait_line(d, lambda x: True)
    out = tmp_path / "pcycle.json"
    t0 = time.monotonic()
    with cpu_load():
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.support.pcycle",
                str(out),
                str(P_CYCLES),
                str(P_TP),
                *(d.address for d in ds),
            ],
            cwd=ROOT,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=1300,
        )
    cycled_s = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] == res["verified"] == P_CYCLES * N_DECODE, res
    stop_at = time.time()
    for d in ds:
        lines = json_lines(d.log_text())
        assert d.popen.poll() is None, d.log_text()[-3000:]
        assert gaps(lines) < MAX_GAP_S, f"{d.log}: a telemetry gap of {gaps(lines):.1f}s"
        assert stamp(lines[-1]) > stop_at - MAX_GAP_S
        # Every rank of every P told this D it stopped, and was evicted for it.
        assert d.log_text().count("P stopped: shutting_down") == P_CYCLES * P_TP
        assert counter(lines[-1], "watchdog_stalls") == 0, d.log
    t1 = time.monotonic()
    for d in ds:
        d.popen.send_signal(signal.SIGTERM)
    for d in ds:
        assert d.popen.wait(max(0.1, t1 + DRAIN_S - time.monotonic())) == 0, d.log_text()[-3000:]
    print(
        f"{P_CYCLES} P stops x {P_TP} ranks x {N_DECODE} Ds in {cycled_s:.1f}s "
        f"({res['seconds']:.1f}s cycling); Ds exited in {time.monotonic() - t1:.1f}s"
    )


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_simultaneous_sigterms_under_load(tmp_path: Path) -> None:
    zy = Zygote()
    exits: list[float] = []
    t0 = time.monotonic()
    load = contextlib.ExitStack()
    try:
        load.enter_context(cpu_load())
        for rnd in range(ROUNDS):
            procs: list[tuple[int, Path, Path]] = []
            for i in range(PER_ROUND):
                role = "prefill" if i == 0 else "decode"
                ready = tmp_path / f"r{rnd}-{i}.ready"
                log = tmp_path / f"r{rnd}-{i}.log"
                argv = [f"serve-{role}", "--port", "0", "--ready-file", str(ready)]
                argv += ["-o", "json", "--interval", str(INTERVAL), *SMALL]
                procs.append((zy.spawn(argv, log), ready, log))
            addrs = []
            for pid, ready, log in procs:
                deadline = time.monotonic() + START_S
                while not ready.exists():
                    assert zy.exit_of(pid) is None, log.read_text()[-3000:]
                    assert time.monotonic() < deadline, log.read_text()[-3000:]
                    time.sleep(0.02)
                addrs.append(json.loads(ready.read_text())["address"])
                while not json_lines(log.read_text()):  # printing before the signal comes
                    assert time.monotonic() < deadline, log.read_text()[-3000:]
                    time.sleep(0.02)
            rep = Driver(
                DriveConfig(
                    prefill=(addrs[0],),
                    decode=tuple(addrs[1:]),
                    requests=16,
                    concurrency=8,
                    blocks=2,
                    timeout_s=30,
                )
            ).run()
            assert rep.all_verified, rep.first_failures
            wall, mono = time.time(), time.monotonic()
            for pid, _, _ in procs:
                os.kill(pid, signal.SIGTERM)
            for pid, _, log in procs:
                deadline = mono + DRAIN_S + 20
                while (ended := zy.exit_of(pid)) is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert ended is not None, (
                    f"{log}: no exit {DRAIN_S + 20}s after SIGTERM\n{native_stacks(pid)}"
                )
                status, at = ended
                text = log.read_text()
                assert status == 0, text[-3000:]
                assert at - mono < DRAIN_S, f"{log}: exited {at - mono:.1f}s after SIGTERM"
                exits.append(at - mono)
                lines = json_lines(text)
                assert gaps(lines) < MAX_GAP_S, f"{log}: a telemetry gap of {gaps(lines):.1f}s"
                assert stamp(lines[-1]) > wall - MAX_GAP_S, log
                assert counter(lines[-1], "watchdog_stalls") == 0, log
    finally:
        load.close()
        zy.close()
    exits.sort()
    print(
        f"{len(exits)} SIGTERMs in {ROUNDS} rounds, {time.monotonic() - t0:.1f}s; exit after "
        f"SIGTERM p50 {exits[len(exits) // 2]:.2f}s max {exits[-1]:.2f}s"
    )
    assert len(exits) == ROUNDS * PER_ROUND

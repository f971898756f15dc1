"""The live view as an operator sees it: ``serve-* -o live`` on a real pseudo-terminal of 80x24
and 200x50, rendered by pyte (``tests.support.term``), with real pushes going through it."""

from __future__ import annotations

import json
import re
import select
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SMALL
from tests.support.procs import KVPUSH, Launcher, clean_env, wait_ready
from tests.support.term import Terminal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

N = 12  # requests pushed through P


def _p_on_terminal(tmp_path: Path, cols: int, rows: int, tp: int) -> tuple[Terminal, str]:
    """A P drawing its live view on a terminal of ``cols`` x ``rows``, and its address."""
    ready = tmp_path / "p.ready"
    cmd = [*KVPUSH, "serve-prefill", *SMALL, "--port", "0", "--tp", str(tp),
           "--ready-file", str(ready)]  # fmt: skip
    term = Terminal(cmd, cols, rows, clean_env())
    term.wait_for(lambda _: ready.exists(), 120)
    return term, str(json.loads(ready.read_text())["address"])


def _push(term: Terminal, p_address: str, serve: Launcher, tp: int) -> None:
    """Start a D and drive ``N`` requests through P and it, reading P's terminal meanwhile (a
    terminal nobody reads blocks the writer, as a real one would)."""
    d = serve.serve("decode", *SMALL, "--tp", str(tp), wait=False)
    term.wait_for(lambda _: d.ready_file is not None and d.ready_file.exists(), 60)
    wait_ready(d)
    drive = subprocess.Popen(
        [*KVPUSH, "drive", "-p", p_address, "-d", d.address, "-n", str(N), "-c", "2",
         "--blocks", "2", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(), text=True,
    )  # fmt: skip
    while drive.poll() is None:
        term.pump(0.2)
    out, err = drive.communicate()
    assert drive.returncode == 0, out + err


def _frame(lines: list[str]) -> list[str]:
    """The rows from the view's header down (log lines scroll above it)."""
    start = max(i for i, ln in enumerate(lines) if ln.startswith("kvpush prefill"))
    return lines[start:]


@pytest.mark.parametrize("tp", [1, 2])
def test_every_section_is_visible_at_80x24(tmp_path: Path, serve: Launcher, tp: int) -> None:
    term, address = _p_on_terminal(tmp_path, 80, 24, tp)
    try:
        _push(term, address, serve, tp)
        total = 64 * tp
        idle = f"allocated 0  inflight 0  quar. 0  free {total}  of {total} blocks"

        def settled(s: list[str]) -> bool:
            # The last push counted, and the frame drawn after it settled: the counters move
            # before the owner publishes its queue gauges, and a frame may be half redrawn
            # when the screen is read -- so wait for the whole quiet frame, then check it.
            text = "\n".join(s)
            quiet = re.search(r"Queues\s+finished 0  regs 0  deferred 0  inflight 0", text)
            return f"pushes {N * tp}" in text and idle in text and quiet is not None

        shown = term.wait_for(settled, 20)
        frame = _frame(shown)
        text = "\n".join(frame)
        assert "..." not in text, text  # nothing cut by the terminal's height
        assert all(len(ln) <= 80 for ln in shown)
        assert re.search(r"Handshakes  (\d)/\1 ready", text), text
        assert re.search(r"Queues\s+finished 0  regs 0  deferred 0  inflight 0", text), text
        assert re.search(r"Rates\s+pushes/s [\d.]+  GB/s [\d.]+  notifs/s [\d.]+", text), text
        assert "requests/s" not in text  # a P's requests are its pushes
        assert re.search(rf"Totals\s+pushes {N * tp}  pushed [\d.]+ kB", text), text
        assert re.search(
            rf"Latency\s+handshake_duration n=\d+ .*\n"
            rf"(?:\s+phase_\w+ n=.*\n)*\s+push_latency n={N * tp} ",
            text,
        ), text
        assert re.search(r"Failures none", text), text
        assert idle in text, text
        if tp > 1:
            head = next(i for i, ln in enumerate(frame) if ln.startswith("rank fin."))
            assert frame[head].split()[-2:] == ["pushes/s", "GB/s"], text
            rows = [frame[head + 1 + r].split() for r in range(tp)]
            assert [row[0] for row in rows] == [str(r) for r in range(tp)], text
            assert all(row[-3] == "1/0/0" for row in rows), text  # each rank: 1 D connected
    finally:
        assert term.close() == 0


def test_every_section_is_visible_at_200x50_in_the_full_view(
    tmp_path: Path, serve: Launcher
) -> None:
    term, address = _p_on_terminal(tmp_path, 200, 50, 2)
    try:
        _push(term, address, serve, 2)
        shown = term.wait_for(lambda s: any("Ranks" in ln for ln in s) and any(
            re.search(rf"pushes/s\s+[\d.,]+\s+{2 * N}$", ln) for ln in s), 20)  # fmt: skip
        text = "\n".join(_frame(shown))
        assert "..." not in text, text
        for title in ("Handshakes  2/2 ready", "Queues", "Throughput", "Latency (ms)",
                      "Failures", "Pool", "Ranks"):  # fmt: skip
            assert title in text, text
        assert re.search(r"GB/s\s+[\d.]+\s+[\d.]+ kB", text), text
        assert "requests/s" not in text
        assert re.search(rf"push_latency\s+{2 * N}\s", text), text
        assert "of 128 blocks" in text and "in-flight WRITEs" in text
        head = next(ln for ln in _frame(shown) if ln.lstrip().startswith("rank  finished"))
        assert head.split()[-2:] == ["pushes/s", "GB/s"]
    finally:
        assert term.close() == 0


def _reflow(term: Terminal, cols: int, rows: int) -> None:
    """Resize as a terminal that re-wraps its lines does (VTE, iTerm2, kitty, tmux): every row
    longer than the new width continues on the next rows; the cursor stays after the text."""
    lines = term.display()[: term.screen.cursor.y + 1]
    wrapped = [ln[i : i + cols] for ln in lines for i in range(0, max(len(ln), 1), cols)]
    term.screen.resize(rows, cols)
    term.screen.reset()
    term.stream.feed("\r\n".join(wrapped[-rows:]).encode())
    term.resize(cols, rows)


def test_a_resize_redraws_one_clean_frame(tmp_path: Path) -> None:
    term, _ = _p_on_terminal(tmp_path, 200, 50, 1)
    try:
        term.wait_for(lambda s: any("Pool" in ln for ln in s), 20)
        _reflow(term, 80, 24)
        term.pump(1.5)
        shown = term.display()
        assert shown[0].startswith("kvpush prefill"), "\n".join(shown)  # no ghost above it
        assert sum("kvpush prefill" in ln for ln in shown) == 1, "\n".join(shown)
        assert "..." not in "\n".join(shown)
    finally:
        assert term.close() == 0


def test_live_asked_with_stderr_not_a_terminal_warns_and_prints_lines(
    tmp_path: Path, free_port: int
) -> None:
    ready = tmp_path / "p.ready"
    cmd = [*KVPUSH, "serve-prefill", *SMALL, "--port", str(free_port), "-o", "live",
           "--interval", "0.3", "--ready-file", str(ready)]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(),
                         text=True)  # fmt: skip
    try:
        assert p.stdout is not None
        readable, _, _ = select.select([p.stdout], [], [], 120)  # before: nothing, ever
        first = p.stdout.readline() if readable else ""
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0
    assert first.split()[1] == "prefill" and "pushes/s=" in first, first
    assert (
        "-o live draws on stderr, which is not a terminal here: printing plain lines on stdout "
        "instead (-o plain or -o json says so without this warning)"
    ) in err

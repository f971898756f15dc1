"""``fleet watch`` and ``fleet check`` at the sizes operators work in (issue 27, item 4).

``fleet watch`` draws on a real pseudo-terminal of 80x24 and 100x30 (rendered by pyte,
``tests.support.term``): every endpoint's role and whole ``HOST:PORT`` are on its row, whatever
else the width leaves out. ``fleet check`` written to a pipe with ``COLUMNS=80`` is never cut:
every address whole, every figure there. Real endpoints, listed with ``--peer`` (no etcd).
"""

from __future__ import annotations

import pytest

from tests.conftest import SMALL, run_cli
from tests.support.procs import KVPUSH, Launcher, Proc, clean_env, wait_ready
from tests.support.term import Terminal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _fleet(serve: Launcher) -> list[Proc]:
    procs = [serve.start(role, *SMALL, wait=False) for role in ("prefill", "decode", "decode")]
    for p in procs:
        wait_ready(p)
    return procs


def _peers(procs: list[Proc]) -> list[str]:
    return [a for p in procs for a in ("--peer", f"{p.address}={p.role}")]


@pytest.mark.parametrize(("cols", "rows"), [(80, 24), (100, 30)])
def test_watch_keeps_role_and_address(serve: Launcher, cols: int, rows: int) -> None:
    procs = _fleet(serve)
    cmd = [*KVPUSH, "fleet", "watch", *_peers(procs), "--duration", "30"]
    term = Terminal(cmd, cols, rows, clean_env())
    try:

        def every_row(lines: list[str]) -> bool:
            return all(
                any(ln.split()[:2] == [p.role[0].upper(), p.address] for ln in lines if ln.split())
                for p in procs
            )

        screen = term.wait_for(every_row, 60)
        assert all(len(ln) <= cols for ln in screen)
        assert any("health" in ln for ln in screen), "\n".join(screen)
    finally:
        term.proc.terminate()
        term.proc.wait(10)


def test_check_to_a_pipe_is_never_cut(serve: Launcher) -> None:
    procs = _fleet(serve)
    env = clean_env(COLUMNS="80")
    r = run_cli("fleet", "check", *_peers(procs), "--pushes", "2", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    p, d1, d2 = procs
    pair_rows = [ln.split() for ln in r.stdout.splitlines() if ln.startswith(p.address)]
    # the matrix row, then one figures row per pair: whole addresses, every column
    assert [p.address, "ok"] == pair_rows[0][:2], r.stdout
    figures = {row[1]: row for row in pair_rows[1:]}
    assert set(figures) == {d1.address, d2.address}, r.stdout
    assert all(len(row) == 10 and row[2] == "ok" for row in figures.values()), r.stdout
    assert max(len(ln) for ln in r.stdout.splitlines()) > 80  # wider than COLUMNS: not cut

"""``python -m kvpush.commands.bench SCENARIO [--quick] [--json] [--out-dir DIR] [--device D]``: the
bench without the CLI app (``kvpush bench`` is the same command)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpush.commands.bench import NAMES
from kvpush.commands.bench.console import run_bench


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpush.commands.bench")
    ap.add_argument("scenario", help=f"{', '.join(NAMES)} or all ('kvpush bench' runs trace, peer)")
    ap.add_argument("--quick", action="store_true", help="short smoke version")
    ap.add_argument("--json", action="store_true", help="JSON on stdout instead of tables")
    ap.add_argument("--out-dir", type=Path, default=None, help="results, charts and logs")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (scenario device)")
    a = ap.parse_args(argv)
    return run_bench(a.scenario, a.quick, a.json, a.out_dir, a.device)


if __name__ == "__main__":
    sys.exit(main())

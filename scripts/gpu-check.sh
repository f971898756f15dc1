#!/usr/bin/env bash
# The GPU path, in one go (issue 20): run on a CUDA host from the repository root.
#
#   scripts/gpu-wheels.sh             # here, once: the wheels a bare GPU host lacks (gpu-wheels/)
#   scripts/gpu-check.sh              # on the GPU host: < 8 minutes
#   scripts/gpu-check.sh --dry-run    # here, on the CPU: the same steps with --device cpu, small
#
# Steps: (1) size of what travels (checkout + gpu-wheels/ < 64 MiB); (2) install the wheels of
# the packages the host lacks (into a private folder, never into the host's Python); (3) CUDA
# present (else a clear error, exit 2); versions of torch, NIXL, UCX; (4) tests/integration/test_gpu_path.py
# (P and D with --device cuda, TP 1 at llama-8b and llama-70b-tp8, TP 2 where two GPUs allow,
# every byte verified at D, telemetry showing the device); (5) kvpush bench device --device
# cuda (kvpush push-only GB/s vs a raw NIXL VRAM->VRAM WRITE loop vs a torch device-to-device
# copy of the same bytes). Results in $OUT (when set) or gpu-out/: gpu-check.log, summary.json,
# gpu-tests.jsonl, device.json (and logs.tar.gz when a step failed). Exit 0 when all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
OUTDIR="${OUT:-gpu-out}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) shift; OUTDIR="$1" ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "error: unknown argument '$1'" >&2
           echo "hint: scripts/gpu-check.sh [--dry-run] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
LOG="$OUTDIR/gpu-check.log"
: > "$LOG"
rm -f "$OUTDIR/gpu-tests.jsonl" "$OUTDIR/device.json" "$OUTDIR/summary.json" "$OUTDIR/logs.tar.gz"
say() { echo "$*" | tee -a "$LOG"; }
T0=$(date +%s)
if [ $DRY = 1 ]; then DEVICE=cpu; QUICK=--quick; MODE=dry-run; else DEVICE="${KVPUSH_GPU_DEVICE:-cuda}"; QUICK=; MODE=gpu; fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ $DRY = 1 ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
say "== kvpush gpu-check ($MODE, device $DEVICE), results in $OUTDIR"

# (1) what travels: the checkout (tracked and untracked-not-ignored files) plus the wheels
checkout=$( (git ls-files -z --cached --others --exclude-standard 2>/dev/null || true) \
    | xargs -0 -r du -cb 2>/dev/null | awk 'END { print $1 + 0 }')
wheels=0
if ls gpu-wheels/*.whl >/dev/null 2>&1; then wheels=$(du -cb gpu-wheels/*.whl | awk 'END { print $1 }'); fi
total=$((checkout + wheels))
limit=$((64 * 1024 * 1024))
say "$(awk -v c="$checkout" -v w="$wheels" -v t="$total" 'BEGIN { printf "size: checkout %.2f MiB + gpu-wheels %.2f MiB = %.2f MiB (limit 64 MiB)", c/1048576, w/1048576, t/1048576 }')"
if [ "$total" -ge "$limit" ]; then
    say "error: checkout + gpu-wheels/ is over 64 MiB"
    say "hint: fetch only the wheels this host lacks (scripts/gpu-wheels.sh), or remove untracked files"
    exit 1
fi

# (2) packages the host lacks, from gpu-wheels/ (a private --target folder on PYTHONPATH)
missing=()
for w in gpu-wheels/*.whl; do
    [ -e "$w" ] || continue
    dist=$(basename "$w" | cut -d- -f1)
    if ! "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" >/dev/null 2>&1; then
        missing+=("$w")
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    SITE="${TMPDIR:-/tmp}/kvpush-gpu-site"
    say "installing ${#missing[@]} wheel(s) the host lacks into $SITE: $(printf '%s ' "${missing[@]##*/}")"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${missing[@]}" >>"$LOG" 2>&1; then
        say "error: the wheels in gpu-wheels/ do not install on this host's $("$PY" -V 2>&1)"
        say "hint: fetch them for this Python: GPU_PYTHON=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') scripts/gpu-wheels.sh"
        exit 1
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import nixl, zmq, msgspec, sortedcontainers, typer, rich, prometheus_client, torch" >>"$LOG" 2>&1; then
    say "error: a package kvpush needs is missing on this host (see $LOG)"
    say "hint: run scripts/gpu-wheels.sh where pip works, and bring gpu-wheels/ along"
    exit 1
fi

# (3) CUDA, versions
if [ $DRY = 0 ]; then
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
        say "error: no usable CUDA device on this host (torch.cuda.is_available() is False)"
        say "hint: run this on a GPU host, or 'scripts/gpu-check.sh --dry-run' to test the script on the CPU"
        exit 2
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | tee -a "$LOG"
fi
"$PY" - "$DEVICE" <<'PYEOF' 2>&1 | tee -a "$LOG"
import sys
import torch
from kvpush.transport.versions import local_versions
dev = sys.argv[1]
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
if dev.startswith("cuda"):
    n = torch.cuda.device_count()
    print(f"CUDA devices: {n}: " + ", ".join(torch.cuda.get_device_name(i) for i in range(n)))
v = local_versions()
print(f"NIXL {v.nixl or '?'} ({v.nixl_build or '?'}), UCX {v.ucx or '?'}")
PYEOF

rc=0
# (4) endpoints at model shapes, every byte verified, telemetry shows the device
say "== tests/integration/test_gpu_path.py (device $DEVICE)"
t=$(date +%s)
KVPUSH_GPU_DEVICE="$DEVICE" KVPUSH_GPU_OUT="$OUTDIR" timeout 200 "$PY" -m pytest -q -p no:cacheprovider \
    -m gpu -rs tests/integration/test_gpu_path.py 2>&1 | tee -a "$LOG"
tests_rc=${PIPESTATUS[0]}
say "tests: exit $tests_rc in $(( $(date +%s) - t )) s"
[ "$tests_rc" = 0 ] || rc=1

# (5) kvpush vs raw NIXL vs torch copy, same bytes, same run
say "== kvpush bench device --device $DEVICE $QUICK"
t=$(date +%s)
BENCH_DIR="$(mktemp -d)"
timeout 260 "$PY" -m kvpush bench device --device "$DEVICE" $QUICK --out-dir "$BENCH_DIR" 2>&1 | tee -a "$LOG"
bench_rc=${PIPESTATUS[0]}
say "bench: exit $bench_rc in $(( $(date +%s) - t )) s"
[ -f "$BENCH_DIR/device.json" ] && cp "$BENCH_DIR/device.json" "$OUTDIR/device.json"
[ "$bench_rc" = 0 ] && [ -f "$OUTDIR/device.json" ] || rc=1
if [ "$rc" != 0 ]; then
    tar -czf "$OUTDIR/logs.tar.gz" -C "$BENCH_DIR" . 2>/dev/null || true
fi
rm -rf "$BENCH_DIR"

elapsed=$(( $(date +%s) - T0 ))
"$PY" - "$OUTDIR" "$MODE" "$DEVICE" "$tests_rc" "$bench_rc" "$elapsed" "$total" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out, mode, device, tests_rc, bench_rc, elapsed, size = sys.argv[1:]
o = Path(out)
tests = [json.loads(x) for x in (o / "gpu-tests.jsonl").read_text().splitlines()] if (o / "gpu-tests.jsonl").exists() else []
bench = json.loads((o / "device.json").read_text()) if (o / "device.json").exists() else None
summary = {
    "mode": mode, "device": device, "elapsed_s": int(elapsed), "travel_bytes": int(size),
    "tests_exit": int(tests_rc), "bench_exit": int(bench_rc), "tests": tests,
    "bench_cells": [
        {k: c[k] for k in ("shape", "tokens", "request_bytes", "kvpush_median", "raw_median", "copy_median", "verified", "verify_requests")}
        for c in (bench or {}).get("figures", {}).get("cells", [])
    ],
}
(o / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
ok = int(tests_rc) == 0 and int(bench_rc) == 0 and bench is not None
print(f"== gpu-check {'PASSED' if ok else 'FAILED'} ({mode}, device {device}) in {elapsed} s; results in {out}")
PYEOF
exit $rc

#!/usr/bin/env bash
# Build (or refresh) the local virtualenv .venv with everything kvpush and its tests need.
# Idempotent: a stamp keyed on pyproject.toml skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv" >&2
    "$PY" -m venv .venv
fi
STAMP=.venv/.kvpush-stamp
WANT="$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "bootstrap: GPU host: installing torch (CUDA build)" >&2
        "${PIP[@]}" "torch>=2.4,<3"
    else
        # CPU-only host: the CPU build; a plain 'torch' would pull a multi-GB CUDA build.
        echo "bootstrap: CPU host: installing torch==2.13.0 (CPU build)" >&2
        "${PIP[@]}" "torch==2.13.0"
    fi
fi
echo "bootstrap: installing kvpush and its test tools into .venv" >&2
"${PIP[@]}" -e '.[test]'
echo "$WANT" > "$STAMP"

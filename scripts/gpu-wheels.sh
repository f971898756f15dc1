#!/usr/bin/env bash
# Prepare, here, what a bare GPU host lacks for scripts/gpu-check.sh: wheels in gpu-wheels/
# (ignored by git), fetched with `pip download` for the GPU host's Python and platform.
#
#   scripts/gpu-wheels.sh                    # Python 3.12 (the GPU image's python3), NIXL for CUDA 13
#   GPU_PYTHON=3.11 NIXL_CUDA=cu12 scripts/gpu-wheels.sh
#
# What a GPU image with torch typically lacks: nixl (the meta package, pure Python, and the
# build for its CUDA major: nixl-cu13 for torch +cu130, ~56 MiB), pyzmq, msgspec; and
# sortedcontainers and requests where missing. gpu-check.sh
# installs only those the host lacks, and checks that checkout + wheels stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${GPU_PYTHON:-3.12}"
CUDA="${NIXL_CUDA:-cu13}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# The NIXL release kvpush is tested with here (the one in .venv), else the newest 1.x.
NIXL_VERSION="${NIXL_VERSION:-$("$PY" -c 'import importlib.metadata as m; print(m.version("nixl"))' 2>/dev/null || echo 1.5.1)}"
DEST=gpu-wheels
rm -rf "$DEST"
mkdir -p "$DEST"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" \
    "nixl==$NIXL_VERSION" "nixl-$CUDA==$NIXL_VERSION" "pyzmq>=26" "msgspec>=0.19" \
    "sortedcontainers>=2.4" "requests>=2.28"
echo "wheels for Python $PYVER, NIXL $NIXL_VERSION ($CUDA), in $DEST/:"
ls -l "$DEST" | awk 'NR > 1 { printf "  %8.2f MiB  %s\n", $5 / 1048576, $9 }'
du -cb "$DEST"/*.whl | awk 'END { printf "  %8.2f MiB  total\n", $1 / 1048576 }'

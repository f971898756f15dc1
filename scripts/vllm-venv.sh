#!/usr/bin/env bash
# Build (once) the virtualenv the vLLM interop tests run vLLM's real NixlPushConnector in, and
# print its python on stdout (nothing else goes to stdout).
#
# vLLM is installed with --no-deps (its own pins would pull a CUDA torch), then the CPU build of
# torch, nixl 1.5.1 (the cu12 wheel runs without CUDA: UCX over DRAM) and only the light packages
# vLLM's connector, config and request modules import. Idempotent: if the venv's python already
# imports the connector and nixl, nothing is installed. Takes ~2-3 minutes the first time.
#
#   VLLM_VENV     where the venv lives (default: .vllm-venv in the repository root); point it at
#                 an existing one to skip the build
#   VLLM_VERSION  (default 0.33.0: the version the tests and kvpush's vLLM wire are pinned to)
#   PYTHON        the interpreter to build it from (default python3)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VLLM_VENV:-$ROOT/.vllm-venv}
VER=${VLLM_VERSION:-0.33.0}
PY=${PYTHON:-python3}
probe='import vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector, nixl, msgspec, numpy'
ok() { [ -x "$VENV/bin/python" ] && VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "$probe" >/dev/null 2>&1; }
if ok; then
    echo "$VENV/bin/python"
    exit 0
fi
echo "vllm-venv: building $VENV (vllm $VER --no-deps, torch 2.13.0 CPU, nixl 1.5.1)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" >&2
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0 >&2
"${PIP[@]}" --no-deps "vllm==$VER" >&2
"${PIP[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1 >&2
"${PIP[@]}" msgspec pyzmq numpy packaging psutil urllib3 regex transformers cbor2 aiohttp \
    requests openai-harmony openai pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo \
    prometheus_client xgrammar fastapi partial_json_parser llguidance einops pydantic pyyaml \
    sympy >&2
if ! ok; then
    echo "vllm-venv: $VENV/bin/python still cannot import vLLM's connector:" >&2
    VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "$probe" >&2 || true
    exit 1
fi
echo "$VENV/bin/python"

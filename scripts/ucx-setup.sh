#!/usr/bin/env bash
# Install Debian's ucx-utils (ucx_perftest, ucx_info) for `make test-slow`: `kvpush bench rate`
# sets UCX's own message rates beside kvpush's and raw NIXL's (kvpush.commands.bench.ucx_floors),
# and tests/unit/test_bench_floors.py runs the real ucx_perftest. Nothing to do when it is there.
# Needs root (apt-get); installs without recommends. The bench itself runs without it (it says
# the floors were skipped, and how to install them).
set -euo pipefail
if command -v ucx_perftest >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "ucx-setup: ucx_perftest missing and installing it needs root: run 'sudo apt-get install -y --no-install-recommends ucx-utils' (or this script as root)" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ucx-setup: no apt-get here: install UCX's tools so that ucx_perftest is on PATH" >&2
    exit 1
fi
echo "ucx-setup: installing Debian's ucx-utils (ucx_perftest)" >&2
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -qq --no-install-recommends ucx-utils >/dev/null; }
install || { apt-get update -qq && install; }
if ! command -v ucx_perftest >/dev/null 2>&1; then
    echo "ucx-setup: the ucx-utils package installed no ucx_perftest" >&2
    exit 1
fi
echo "ucx-setup: UCX $(ucx_info -v | sed -n 's/^# Version //p')" >&2

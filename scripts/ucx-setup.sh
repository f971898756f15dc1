#!/usr/bin/env bash
# UCX's own tools (ucx_perftest, ucx_info) inside .venv, for `make test-slow`: `kvpush bench rate`
# sets UCX's own message rates beside kvpush's and raw NIXL's (kvpush.commands.bench.ucx_floors),
# and tests/unit/test_bench_floors.py runs the real ucx_perftest. Nothing to do when they are there.
#
# Debian's ucx-utils and libucx0 are downloaded (apt-get download: no root) and unpacked into
# .venv/ucx; .venv/bin/ucx_perftest and .venv/bin/ucx_info run them with their own libraries.
# Never `apt-get install ucx-utils`: it pulls in rdma-core's ibverbs-providers, and with those on
# the host every process that loads NIXL 1.5.1's wheel crashes at exit (SIGSEGV in the wheel's
# libnl-route destructor; seen here 2026-12-07, gone once ibverbs-providers was removed).
# The bench itself runs without these tools (it says the floors were skipped, and how to add them).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.venv/ucx
if [ -x .venv/bin/ucx_perftest ] && [ -x "$DEST/usr/bin/ucx_perftest" ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then
    echo "ucx-setup: no apt-get/dpkg here: put UCX's ucx_perftest on PATH to measure UCX's floors" >&2
    exit 1
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fetch() { (cd "$tmp" && apt-get download -q=2 ucx-utils libucx0 >/dev/null 2>&1); }
if ! fetch; then
    if [ "$(id -u)" != 0 ]; then
        echo "ucx-setup: apt-get download ucx-utils failed and refreshing apt's lists needs root: run 'sudo apt-get update' first" >&2
        exit 1
    fi
    apt-get update -qq
    fetch || { echo "ucx-setup: apt-get download ucx-utils libucx0 failed" >&2; exit 1; }
fi
rm -rf "$DEST"
mkdir -p "$DEST"
for deb in "$tmp"/*.deb; do
    dpkg -x "$deb" "$DEST"
done
so="$(find "$DEST" -name 'libucp.so.0' | head -1)"
[ -n "$so" ] || { echo "ucx-setup: libucx0 unpacked no libucp.so.0" >&2; exit 1; }
lib="$(cd "$(dirname "$so")" && pwd)"
for tool in ucx_perftest ucx_info; do
    cat > ".venv/bin/$tool" <<WRAP
#!/bin/sh
# UCX's $tool unpacked by scripts/ucx-setup.sh, run with its own libraries and modules.
LD_LIBRARY_PATH="$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" UCX_MODULE_DIR="$lib/ucx" exec "$(cd "$DEST" && pwd)/usr/bin/$tool" "\$@"
WRAP
    chmod +x ".venv/bin/$tool"
done
if ! ver="$(.venv/bin/ucx_info -v 2>&1)"; then
    echo "ucx-setup: the unpacked ucx_info does not run: ${ver##*$'\n'}" >&2
    rm -f .venv/bin/ucx_perftest .venv/bin/ucx_info
    exit 1
fi
echo "ucx-setup: UCX $(sed -n 's/^# Version //p' <<<"$ver") in $DEST" >&2

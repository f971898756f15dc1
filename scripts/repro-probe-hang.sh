#!/usr/bin/env bash
# Diagnostic (not part of any suite): tests/component/test_cli_probe.py::test_handshake_and_ping
# once saw its second probe ('probe P --handshake notif') print nothing for 60 s under heavy load.
# This runs the test's two probes against one P N times (default 30); on a probe alive after 38 s
# it writes py-spy dumps of the probe and of P to $OUT (default /tmp) and stops. Run it beside a
# loaded machine (e.g. during 'make test') to catch the hang.
set -u
cd "$(dirname "$0")/.."
K=.venv/bin/kvpush
N="${1:-30}"
OUT="${OUT:-/tmp}"
$K serve-prefill --port 0 --num-blocks 64 --layers 2 --block-bytes 4096 -o json --interval 60 \
    > "$OUT/rp-p.log" 2>&1 &
PP=$!
trap 'kill $PP 2>/dev/null' EXIT
for _ in $(seq 1 60); do grep -q "127.0.0.1:[0-9]" "$OUT/rp-p.log" && break; sleep 1; done
PORT=$(grep -o "127.0.0.1:[0-9]*" "$OUT/rp-p.log" | head -1 | cut -d: -f2)
[ -n "$PORT" ] || { echo "P did not start: see $OUT/rp-p.log"; exit 1; }
echo "P on $PORT"
for i in $(seq 1 "$N"); do
    timeout 60 $K probe "127.0.0.1:$PORT" --handshake full --ping 5 --json > /dev/null \
        || echo "full probe $i: exit $?"
    timeout 60 $K probe "127.0.0.1:$PORT" --handshake notif > /dev/null &
    PR=$!
    for _ in $(seq 1 38); do sleep 1; kill -0 $PR 2>/dev/null || break; done
    if kill -0 $PR 2>/dev/null; then
        echo "HANG at $i: dumps in $OUT/rp-spy-probe.txt, $OUT/rp-spy-p.txt"
        .venv/bin/py-spy dump --pid $PR > "$OUT/rp-spy-probe.txt" 2>&1
        .venv/bin/py-spy dump --pid $PP > "$OUT/rp-spy-p.txt" 2>&1
        wait $PR
        exit 2
    fi
    wait $PR || echo "notif probe $i: exit $?"
done
echo "no hang in $N rounds"

#!/usr/bin/env bash
# Install Debian's prometheus package (prometheus and promtool) for `make test-prom`
# (tests/prometheus: promtool checks and unit-tests deploy/prometheus/kvpush-alerts.yml, and a
# real Prometheus the tests start on a free port scrapes real endpoints). Nothing to do when both
# binaries are there. Needs root (apt-get); installs without recommends (no node exporter).
# Never leaves the daemon running: the tests start their own server; on a host with systemd the
# package's prometheus.service (enabled and started by its postinst) is stopped and disabled.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/bin/$1" ]; }
if have prometheus && have promtool; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "prometheus-setup: prometheus/promtool missing and installing them needs root: run 'sudo apt-get install -y --no-install-recommends prometheus' (or this script as root)" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "prometheus-setup: no apt-get here: install Prometheus >= 2.26 so that prometheus and promtool are on PATH" >&2
    exit 1
fi
echo "prometheus-setup: installing Debian's prometheus (prometheus, promtool)" >&2
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
install || { apt-get update -qq && install; }
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
fi
if ! { have prometheus && have promtool; }; then
    echo "prometheus-setup: the prometheus package installed no prometheus/promtool binary" >&2
    exit 1
fi
echo "prometheus-setup: $(prometheus --version 2>&1 | head -1)" >&2

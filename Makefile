# The two commands a newcomer runs (README "Set-up"): each builds .venv by itself.
.PHONY: demo test test-slow test-vllm test-prom lint docs

demo:
	@scripts/bootstrap.sh
	.venv/bin/kvpush demo

# On TEST_WORKERS processes (pytest-xdist): most of a test's time is waiting on the processes it
# starts, so two workers on a 2-core host halve the run (15.7 -> 8.3 min). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test:
	@scripts/bootstrap.sh
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) -m "not vllm and not gpu and not prometheus"

# The slow suites; first unpacks UCX's tools into .venv (scripts/ucx-setup.sh: apt-get download,
# no root) for the bench's UCX floors.
test-slow:
	@scripts/bootstrap.sh
	scripts/ucx-setup.sh
	.venv/bin/python -m pytest -q -m slow

# Against vLLM's real NixlPushConnector (tests/vllm), in a second venv (.vllm-venv, built once, ~3 min;
# VLLM_VENV=/path reuses another). Not part of `make test`.
test-vllm:
	@scripts/bootstrap.sh
	PY="$$(scripts/vllm-venv.sh)" && KVPUSH_VLLM_PYTHON="$$PY" .venv/bin/python -m pytest -q -m vllm tests/vllm

# The alert rules and the Grafana dashboard (deploy/) against promtool and a real Prometheus
# scraping real endpoints (tests/prometheus); installs Debian's prometheus first (root, once).
# Not part of `make test`.
test-prom:
	@scripts/bootstrap.sh
	scripts/prometheus-setup.sh
	.venv/bin/python -m pytest -q -m prometheus tests/prometheus

lint:
	@scripts/bootstrap.sh
	.venv/bin/ruff check kvpush tests
	.venv/bin/ruff format --check kvpush tests
	.venv/bin/mypy kvpush
	.venv/bin/mypy --explicit-package-bases tests
	.venv/bin/lint-imports

docs:
	@scripts/bootstrap.sh
	.venv/bin/python -m kvpush.cli.gendocs  # completions/, man/kvpush.1, docs/cli.md

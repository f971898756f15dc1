# The two commands a newcomer runs (README "Set-up"): each builds .venv by itself.
.PHONY: demo test test-slow lint docs

demo:
	@scripts/bootstrap.sh
	.venv/bin/kvpush demo

test:
	@scripts/bootstrap.sh
	.venv/bin/python -m pytest -q

test-slow:
	@scripts/bootstrap.sh
	.venv/bin/python -m pytest -q -m slow

lint:
	@scripts/bootstrap.sh
	.venv/bin/ruff check kvpush tests
	.venv/bin/ruff format --check kvpush tests
	.venv/bin/mypy kvpush
	.venv/bin/mypy --explicit-package-bases tests
	.venv/bin/lint-imports

docs:
	@scripts/bootstrap.sh
	.venv/bin/python -m kvpush.cli.gendocs

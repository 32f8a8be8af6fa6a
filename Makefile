# Two commands: `make serve` and `make test`. Each creates .venv if missing and installs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= tiny
PYTEST_ARGS ?=

.PHONY: serve test lint install install-test redis-server

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# Stamps record which install ran, so a changed pyproject.toml reinstalls.
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -e '.[test]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test redis-server

# The remote-tier tests run a real redis-server on loopback. Where it is missing and apt-get is
# there (Debian, Ubuntu), install it; as root directly, otherwise through sudo.
redis-server:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  command -v apt-get >/dev/null || { echo "install redis-server (7 or later)"; exit 1; }; \
	  $$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y redis-server; }

serve: $(VENV)/.installed
	$(PY) -m flipjax.serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-test redis-server
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n auto --dist loadfile $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m ruff format --check .

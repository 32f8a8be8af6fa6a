# Two commands: `make serve` and `make test`. Each creates .venv if missing and installs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= tiny
PYTEST_ARGS ?=

.PHONY: serve test lint install install-test

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
install-test: $(VENV)/.installed-test

serve: $(VENV)/.installed
	$(PY) -m flipjax.serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-test
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n auto --dist loadfile $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m ruff format --check .

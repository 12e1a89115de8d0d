# Each target builds its own virtual environment from nothing (python3 -m venv) on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test lint demo bench clean

$(STAMP): requirements-dev.txt client/pyproject.toml exporter/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt -e ./client -e ./exporter
	touch $(STAMP)

venv: $(STAMP)

## make test: lint, type-check and run the whole test suite
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

## make demo: exporter + a real training run; prints where to look and live values
demo: $(STAMP)
	$(BIN)/python scripts/demo.py $(DEMO_ARGS)

## make bench: the benchmarks of docs/performance.md and docs/reliability.md (each also takes
## --smoke: seconds, for CI)
bench: $(STAMP)
	$(BIN)/python benchmarks/attacks.py
	$(BIN)/python benchmarks/cardinality.py
	$(BIN)/python benchmarks/client_log.py
	$(BIN)/python benchmarks/training_overhead.py
	$(BIN)/python benchmarks/ingest.py
	$(BIN)/python benchmarks/rules_eval.py
	$(BIN)/python benchmarks/gpu.py
	$(BIN)/python benchmarks/callbacks.py
	$(BIN)/python benchmarks/detection/run.py
	$(BIN)/python benchmarks/peers.py
	$(BIN)/python benchmarks/scrape.py
	$(BIN)/python benchmarks/fuzz.py
	$(BIN)/python benchmarks/faults.py

clean:
	rm -rf $(VENV)

# Each target builds its own virtual environment from nothing (python3 -m venv) on first use:
# .venv with the whole development toolchain (requirements-dev.txt), and for `make demo` only
# .venv-demo: the two packages and torch (requirements-demo.txt).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_VENV  ?= .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed

.PHONY: venv check test lint generate demo bench clean release-check

$(STAMP): requirements-dev.txt requirements-demo.txt client/pyproject.toml exporter/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt -e ./client -e ./exporter
	touch $(STAMP)

venv: $(STAMP)

## make lint: ruff (lint and format) and mypy
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

## make check: the inner loop: lint and the tests not marked slow (no subprocess exporters,
## no real training, no Prometheus end-to-end)
check: lint
	$(BIN)/python -m pytest -m "not slow"

## make test: lint and the whole test suite (what CI runs)
test: lint
	$(BIN)/python -m pytest

## make release-check: a release's own checks, not part of `make test` (minutes): two builds
## of the exporter's image from one commit give the same layers
release-check: $(STAMP)
	$(BIN)/python -m pytest -m release -s

## make generate: rebuild every generated file (dashboards, their Kubernetes ConfigMaps and
## PrometheusRules, the metric tables of docs/metrics.md, the golden captures); tests fail
## when a committed copy differs from what its generator builds
generate: $(STAMP)
	$(BIN)/python deploy/grafana/build_dashboards.py
	$(BIN)/python deploy/kubernetes/build.py
	$(BIN)/python scripts/build_metrics_doc.py
	TRAINMON_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/exporter/test_golden.py tests/client/test_golden_wire.py tests/exporter/views/test_captures.py

$(DEMO_STAMP): requirements-demo.txt client/pyproject.toml exporter/pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install -q -r requirements-demo.txt -e ./client -e ./exporter
	touch $(DEMO_STAMP)

## make demo: exporter + a real training run; prints where to look and live values, then
## (in a terminal) keeps serving until Ctrl-C. Its own light environment, .venv-demo.
demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/python scripts/demo.py $(DEMO_ARGS)

## make bench: the benchmarks of docs/performance.md and docs/reliability.md;
## make bench BENCH_ARGS=--smoke: all of them in seconds (what CI runs)
bench: $(STAMP)
	$(BIN)/python benchmarks/attacks.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/auth.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/cardinality.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/prometheus_memory.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/client_log.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/custom_names.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/training_overhead.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/ingest.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/admission.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/rules_eval.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/goodput_job.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/goodput_cost.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/gpu.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/callbacks.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/trainmon_run.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/detection/run.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/detection/false_alarms.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/detection/gain_drift.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/peers.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/scrape.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/fuzz.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/faults.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/soak.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/ingest_memory.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_VENV)

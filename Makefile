# Quick start: `make demo` and `make test`. Both create .venv and install when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Feast needs pandas<3 and tenacity<9: it gets its own interpreter and lock (docs/data.md, "Feature store sources").
FEAST_VENV := .venv-feast
FEAST_STAMP := $(FEAST_VENV)/.feast-installed
export TRAINYARD_HOME ?= $(CURDIR)/.trainyard
export DAGSTER_HOME ?= $(TRAINYARD_HOME)/dagster
export GX_ANALYTICS_ENABLED := False
export WANDB_SILENT := true
export DO_NOT_TRACK := 1

.PHONY: install demo test test-all lint ui mlflow-ui optuna-ui bench kind-e2e kind-e2e-clean clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip>=24"
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	# litdata (shards) without its torchvision requirement: see the note in pyproject.toml's dependencies.
	$(BIN)/pip install --quiet --no-deps -c constraints.txt litdata
	touch $@

$(FEAST_STAMP): deploy/feast/requirements.in deploy/feast/constraints.txt
	test -x $(FEAST_VENV)/bin/python || $(PYTHON) -m venv $(FEAST_VENV)
	$(FEAST_VENV)/bin/pip install --quiet --upgrade "pip>=24"
	$(FEAST_VENV)/bin/pip install --quiet -c deploy/feast/constraints.txt -r deploy/feast/requirements.in
	touch $@

install: $(STAMP) $(FEAST_STAMP)

demo: $(STAMP) $(FEAST_STAMP)
	$(BIN)/trainyard demo

# Fast suite; slow end-to-end tests also run when CI is set (as .ci/run does) or with SLOW=1.
# Three workers (one test file each at a time) on 2 cores: much of a test waits on
# subprocesses, daemons and sensor ticks, so with two workers the cores sat 22% idle
# (docs/benchmarks.md, "The test suite's time"). xdist hands out files with the most
# tests first (tests/conftest.py says why not longest first). WORKERS=0 runs in this process.
WORKERS ?= 3
test: $(STAMP) $(FEAST_STAMP)
	$(BIN)/pytest $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile) $(if $(SLOW),--slow,) --durations=25 $(PYTEST_ARGS)

# Everything: the slow tests and the extended ones (multi-minute variants of what a slow test covers; not in .ci/run).
test-all: $(STAMP) $(FEAST_STAMP)
	$(BIN)/pytest $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile) --slow --extended --durations=25 $(PYTEST_ARGS)

# The architecture's contracts: layers and cycles (import-linter), ruff, and mypy on the core and the pod side.
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/pytest -q -p no:cacheprovider -p no:xdist tests/test_boundary.py -k "imports_only or imports_no_orchestration"
	$(BIN)/ruff check .
	$(BIN)/mypy

# dagster dev runs with SIGINT and SIGTERM at their defaults: started in the background
# by a non-interactive shell (a script, an IDE task, CI) it inherits SIGINT ignored,
# and Dagster then ignores SIGTERM too (it gives SIGTERM SIGINT's handler), so neither
# Ctrl-C nor kill would stop it. `trainyard init` gives DAGSTER_HOME its dagster.yaml.
DAGSTER_PORT ?= 3000
ui: $(STAMP)
	$(BIN)/trainyard init
	exec env --default-signal=INT,TERM $(BIN)/dagster dev -w workspace.yaml -p $(DAGSTER_PORT)

# MLflow 3 opens on its GenAI view; the registered models (champion, challenger) are at MLFLOW_MODELS_URL.
MLFLOW_PORT ?= 5000
MLFLOW_MODELS_URL = http://127.0.0.1:$(MLFLOW_PORT)/\#/models?workflowType=machine_learning
mlflow-ui: $(STAMP)
	@echo "Registered models: $(MLFLOW_MODELS_URL)"
	exec $(BIN)/mlflow ui --backend-store-uri sqlite:///$(TRAINYARD_HOME)/mlflow.db --host 127.0.0.1 --port $(MLFLOW_PORT)

# The study storage the sweeps use (pipelines.environments): TRAINYARD_OPTUNA_URL in the
# cluster environment, else SQLite under TRAINYARD_HOME. Its tables are created first,
# as the first sweep would: optuna-dashboard fails on a storage without them.
OPTUNA_PORT ?= 8080
OPTUNA_URL = $(if $(filter cluster,$(TRAINYARD_ENV)),$(TRAINYARD_OPTUNA_URL),sqlite:///$(TRAINYARD_HOME)/optuna.db)
optuna-ui: $(STAMP)
	@mkdir -p $(TRAINYARD_HOME)
	@$(BIN)/python -c 'import sys, optuna; optuna.storages.RDBStorage(sys.argv[1])' "$(OPTUNA_URL)"
	@echo "Optuna dashboard: http://127.0.0.1:$(OPTUNA_PORT)/"
	exec $(BIN)/optuna-dashboard --host 127.0.0.1 --port $(OPTUNA_PORT) "$(OPTUNA_URL)"

# Every benchmark (or BENCH="bench.overhead bench.checkpoint_blocking"); ends with a table of targets
# and fails when a target is missed or a benchmark failed (docs/benchmarks.md).
bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH)

# The digits pipeline as a 2-node JobSet gang on a kind cluster with the real JobSet and
# Kueue controllers (docs/kubernetes.md, "End to end on kind"). Needs Docker, kind, kubectl
# and the internet; without a Docker daemon it says so and exits 0 (skipped).
kind-e2e:
	bash deploy/kind/e2e.sh

kind-e2e-clean:
	bash deploy/kind/e2e.sh clean

clean:
	rm -rf $(TRAINYARD_HOME) bench/results

# Quick start: `make demo` and `make test`. Both create .venv and install when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export TRAINYARD_HOME ?= $(CURDIR)/.trainyard
export DAGSTER_HOME ?= $(TRAINYARD_HOME)/dagster
export GX_ANALYTICS_ENABLED := False
export WANDB_SILENT := true
export DO_NOT_TRACK := 1

.PHONY: install demo test test-all lint ui mlflow-ui bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip>=24"
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/trainyard demo

# Fast suite; slow end-to-end tests also run when CI is set (as .ci/run does) or with SLOW=1.
# Two workers (one test file each at a time): much of a test is waiting on subprocesses,
# so two files overlap well even on 2 cores. WORKERS=0 runs in this process.
WORKERS ?= 2
test: $(STAMP)
	$(BIN)/pytest $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile) $(if $(SLOW),--slow,) $(PYTEST_ARGS)

# The architecture's contracts: layers and cycles (import-linter), ruff, and mypy on the core and the pod side.
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/mypy

ui: $(STAMP)
	$(BIN)/trainyard init
	$(BIN)/dagster dev -w workspace.yaml

mlflow-# The architecture's contracts: layers and cycles (import-linter), ruff, and mypy on the core and the pod side.
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/mypy

ui: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(TRAINYARD_HOME)/mlflow.db --port 5000

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(TRAINYARD_HOME) bench/results

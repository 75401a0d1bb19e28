# The two entry points of the README. Both create .venv and install what is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test lint typecheck clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m mlflow_hvd.cli.train --np 2 --epochs 5

lint: setup
	$(VENV)/bin/ruff check mlflow_hvd tests examples benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff format --check mlflow_hvd tests examples benchmarks

typecheck: setup
	$(VENV)/bin/mypy

test: setup
	$(VENV)/bin/ruff check mlflow_hvd tests examples benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m pytest -ra $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache mlflow.db mlruns spark-warehouse

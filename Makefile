# The two entry points of the README. Both create .venv and install what is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-gpu test-old-end test-new-end lint typecheck docs clean lock

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m mlflow_hvd.cli.train --np 2 --epochs 5

lint: setup
	$(VENV)/bin/ruff check mlflow_hvd tests examples benchmarks scripts
	$(VENV)/bin/lint-imports
	$(PY) scripts/bars.py

typecheck: setup
	$(VENV)/bin/mypy

# The manual (docs/, README sections included) as a site in site/; --strict: a broken link,
# anchor, include or API reference fails the build
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Every tier, cheapest first, each one's wall time printed (scripts/test_tiers.sh): setup,
# static checks (lint, layering, size tripwires, types, docs), then pytest's fast tier (no
# JVM, no TensorFlow rank), main tier, cluster tier, and the old end. TIERS="fast" runs one.
test:
	PYTEST_ARGS="$(PYTEST_ARGS)" bash scripts/test_tiers.sh

# The GPU tier, on a machine with NVIDIA GPUs (scripts/gpu_tier.sh): NCCL collectives, the
# examples on one GPU per rank, Spark's GPU scheduling, torch.distributed on nccl, in the new
# end's environment with Horovod's NCCL build. Without a GPU: one line, exit 77 (skipped).
test-gpu:
	PYTEST_ARGS="$(PYTEST_ARGS)" bash scripts/gpu_tier.sh

# The old end of the supported ranges (Python 3.12, TensorFlow 2.16, pyspark 3.5, MLflow
# 3.10) in its own venv, installed as into a user's existing environment; `make test` runs it.
test-old-end:
	bash scripts/end_tier.sh old $(PYTEST_ARGS)

# The new end (Python 3.13, TensorFlow 2.21, PyTorch 2.14 as PyPI gives it on Linux: its CUDA
# build, Horovod built for CPU tensors against it, pyspark 4.3, MLflow 3.17) in its own venv,
# installed as into a user's existing environment; `make test` runs it.
test-new-end:
	bash scripts/end_tier.sh new $(PYTEST_ARGS)

# Re-resolve the main environment from pyproject.toml under requirements/pins.txt, keeping the
# versions already locked where they still fit (UPGRADE=1: take the newest): the whole tested
# set in one pass, then the runtime alone under it, split into requirements/lock-py3.11.txt
# (what users run: python_env.yaml) and requirements/lock-dev-py3.11.txt (scripts/split_lock.py).
# PyTorch's CPU build is not on PyPI: FIND_LINKS says where it lies (a directory of wheels,
# or PyTorch's CPU index page https://download.pytorch.org/whl/cpu/torch/).
FIND_LINKS ?= /opt/wheels
lock: setup
	cat requirements/lock-py3.11.txt requirements/lock-dev-py3.11.txt > .lock-whole.txt
	$(VENV)/bin/uv pip compile pyproject.toml --extra tensorflow-cpu --extra torch --extra connect \
	  --extra dev -c requirements/pins.txt --generate-hashes --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_28 --no-header $(if $(UPGRADE),--upgrade) \
	  --find-links $(FIND_LINKS) -o .lock-whole.txt
	$(VENV)/bin/uv pip compile pyproject.toml --extra tensorflow-cpu --extra torch \
	  -c .lock-whole.txt --generate-hashes --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_28 --no-header --find-links $(FIND_LINKS) \
	  -o .lock-runtime.txt
	$(PY) scripts/split_lock.py .lock-whole.txt .lock-runtime.txt requirements/lock-py3.11.txt \
	  requirements/lock-dev-py3.11.txt
	rm -f .lock-whole.txt .lock-runtime.txt
	$(VENV)/bin/uv pip compile pyproject.toml requirements/old-end.in --extra tensorflow-cpu \
	  --generate-hashes --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
	  --no-header $(if $(UPGRADE),--upgrade) -o requirements/lock-old-end-py3.12.txt
	$(VENV)/bin/uv pip compile pyproject.toml requirements/new-end.in --extra tensorflow-cpu \
	  --extra torch --generate-hashes --python-version 3.13 \
	  --python-platform x86_64-manylinux_2_28 --no-header --no-python-downloads \
	  $(if $(UPGRADE),--upgrade) -o requirements/lock-new-end-py3.13.txt

clean:
	rm -rf $(VENV) .venv-old-end .venv-new-end site test-output .pytest_cache .mypy_cache .ruff_cache mlflow.db mlruns spark-warehouse

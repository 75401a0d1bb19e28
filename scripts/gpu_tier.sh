#!/usr/bin/env bash
# `make test-gpu`: the GPU tier (tests/test_gpu.py), on a machine with NVIDIA GPUs and their
# driver. Where nvidia-smi lists none it prints one line and exits 77: skipped, never passed
# (`make test` does not run it; CI has no GPU).
#
# It runs in the new end's environment (scripts/end_tier.sh new --prepare: Python 3.13,
# PyTorch's CUDA 13 build, tensorflow-cpu 2.21) with Horovod's NCCL build installed
# (HOROVOD_GPU_OPERATIONS=NCCL python -m mlflow_hvd.cli.horovod: compiled once, from the wheel
# cache afterwards) and left installed (`make test-new-end` puts its CPU build back). PYTEST_ARGS
# go to pytest.
# HOROVOD_BUILD_CUDA_CC_LIST=80,90 (Horovod's switch) compiles for those GPUs only.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

reason=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
  reason="nvidia-smi is not on PATH"
elif ! listed="$(nvidia-smi --query-gpu=index --format=csv,noheader 2>&1)"; then
  reason="nvidia-smi failed: $(echo "$listed" | head -n1)"
elif [ -z "$(echo "$listed" | tr -d '[:space:]')" ]; then
  reason="nvidia-smi lists no GPU"
fi
if [ -n "$reason" ]; then
  echo "test-gpu: SKIPPED (not passed): no GPU here ($reason); nothing ran"
  exit 77
fi

started=$(date +%s)
GPU_WHEEL=0 bash scripts/end_tier.sh new --prepare || exit $?
PY="$ROOT/.venv-new-end/bin/python"
[ -x "$PY" ] || PY="${NEW_END_VENV:?}/bin/python"
HOROVOD_GPU_OPERATIONS=NCCL "$PY" -m mlflow_hvd.cli.horovod || exit $?
rc=0
read -r -a EXTRA <<< "${PYTEST_ARGS:-}"
MLFLOW_HVD_TIER=gpu "$PY" -m pytest -ra -s -m gpu "${EXTRA[@]}" || rc=$?
echo "test-gpu: exit $rc after $(($(date +%s) - started))s on $(echo "$listed" | wc -l) GPU(s)"
exit $rc

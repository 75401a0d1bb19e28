#!/usr/bin/env bash
# The old-end test environment: Python 3.12, TensorFlow 2.16, pyspark 3.5 (Spark 3.5's own
# JVM side), the oldest supported MLflow. Built the way a user with an existing environment
# installs mlflow_hvd (docs/install.md: your own environment):
#   1. the user's environment: requirements/lock-old-end-py3.12.txt (hash-checked);
#   2. `pip install -e '.[tensorflow-cpu]'`, which must keep every version already there;
#   3. `python -m mlflow_hvd.cli.horovod`, which builds Horovod against that TensorFlow (once:
#      the wheel is cached like the main environment's).
# Then runs the tests marked old_end. Idempotent: steps 1-2 are skipped while the lock and
# pyproject.toml are unchanged.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OLD_END_VENV:-$ROOT/.venv-old-end}"
LOCK="$ROOT/requirements/lock-old-end-py3.12.txt"

die() { echo "old-end: $*" >&2; exit 1; }

find_python() {
  if [ -n "${PYTHON_OLD_END:-}" ]; then echo "$PYTHON_OLD_END"; return; fi
  if python3.12 -c '' >/dev/null 2>&1; then command -v python3.12; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    # pyenv's shim answers only for the active versions: ask for an installed 3.12
    local found
    found="$(ls -d "$(pyenv root)"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -n1)"
    if [ -n "$found" ]; then echo "$found"; return; fi
  fi
  return 1
}

PYTHON="$(find_python)" || die "Python 3.12 not found: install it (e.g. 'pyenv install 3.12') or set PYTHON_OLD_END=/path/to/python3.12"
[ "$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "3.12" ] \
  || die "$PYTHON is not Python 3.12"

if [ ! -x "$VENV/bin/python" ]; then
  echo "old-end: creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.mlflow_hvd-old-end"
KEY="$(cat "$LOCK" "$ROOT/pyproject.toml" "$0" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$KEY" ]; then
  "$PY" -m pip install --quiet --upgrade "pip>=24"
  "$PY" -m pip install --quiet --require-hashes -r "$LOCK"
  before="$("$PY" -m pip freeze --exclude-editable | grep -iv '^mlflow[-_]hvd' | sort)"
  "$PY" -m pip install --quiet -e "$ROOT[tensorflow-cpu]"
  after="$("$PY" -m pip freeze --exclude-editable | grep -iv '^mlflow[-_]hvd' | sort)"
  if [ "$before" != "$after" ]; then
    diff <(echo "$before") <(echo "$after") >&2 || true
    die "installing mlflow_hvd changed the environment's packages (above): it must keep the user's"
  fi
  echo "old-end: mlflow_hvd installed; the environment's $(echo "$after" | wc -l) packages are unchanged"
  echo "$KEY" > "$STAMP"
fi
"$PY" -m mlflow_hvd.cli.horovod
"$PY" -c 'import sys, mlflow, pyspark, tensorflow as tf, keras; print("old-end: Python %d.%d.%d" % sys.version_info[:3], "TensorFlow", tf.__version__, "Keras", keras.__version__, "pyspark", pyspark.__version__, "MLflow", mlflow.__version__)' 2>/dev/null
cd "$ROOT"
exec "$PY" -m pytest -ra -m old_end "$@"

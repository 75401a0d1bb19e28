#!/usr/bin/env bash
# The old-end test environment: Python 3.12, TensorFlow 2.16, pyspark 3.5 (Spark 3.5's own
# JVM side), the oldest supported MLflow. Built the way a user with an existing environment
# installs mlflow_hvd (docs/install.md: your own environment):
#   1. the user's environment: requirements/lock-old-end-py3.12.txt (hash-checked);
#   2. `pip install -e '.[tensorflow-cpu]'`, which must keep every version already there;
#   3. `python -m mlflow_hvd.cli.horovod`, which builds Horovod against that TensorFlow (once:
#      the wheel is cached like the main environment's).
# Then runs the tests marked old_end (`--prepare`: stops before them; `--status FILE`: also
# writes their exit code and start and end times there).
#
# Step 1's environment depends on the lock alone: it lives outside the checkout, in the cache
# (like Horovod's wheels; $MLFLOW_HVD_CACHE/venvs/old-end-<digest of the lock and Python>),
# so a new clone on the same machine reuses it; the two most recently used are kept.
# `.venv-old-end` in the checkout links to it. OLD_END_VENV=<dir> uses that directory instead.
# Steps 2-3 run again whenever the checkout or pyproject.toml differ from the last run's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCK="$ROOT/requirements/lock-old-end-py3.12.txt"
CACHE_ROOT="${MLFLOW_HVD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlflow_hvd}"
PREPARE_ONLY=0
STATUS=""  # --status FILE: write "<exit code> <tests' start> <tests' end>" (epoch seconds)
if [ "${1:-}" = "--prepare" ]; then PREPARE_ONLY=1; shift; fi
if [ "${1:-}" = "--status" ]; then STATUS="$2"; shift 2; fi

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

ENV_KEY="$( (cat "$LOCK"; "$PYTHON" -c 'import sys; print(sys.version, sys.executable)') \
  | sha256sum | cut -c1-16)"
if [ -n "${OLD_END_VENV:-}" ]; then
  VENV="$OLD_END_VENV"
else
  VENV="$CACHE_ROOT/venvs/old-end-$ENV_KEY"
  mkdir -p "$CACHE_ROOT/venvs"
  # a checkout's own environment from before the cache (a directory) is left as it is
  if [ -L "$ROOT/.venv-old-end" ] || [ ! -e "$ROOT/.venv-old-end" ]; then
    ln -sfn "$VENV" "$ROOT/.venv-old-end"
  fi
fi
mkdir -p "$(dirname "$VENV")"
# one builder at a time per environment (two clones' CI on one machine)
exec 9> "$VENV.lock"
flock -w 1800 9 || die "another run held $VENV.lock for 30 minutes"

PY="$VENV/bin/python"
ENV_STAMP="$VENV/.mlflow_hvd-old-end-env"
if [ ! -f "$ENV_STAMP" ] || [ "$(cat "$ENV_STAMP")" != "$ENV_KEY" ]; then
  rm -rf "$VENV"
  echo "old-end: creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
  "$PY" -m pip install --quiet --upgrade "pip>=24"
  "$PY" -m pip install --quiet --require-hashes -r "$LOCK"
  echo "$ENV_KEY" > "$ENV_STAMP"
else
  echo "old-end: reusing $VENV (the lock's environment)"
fi
touch "$ENV_STAMP"  # most recently used: kept by the pruning below
# the two most recently used environments stay; older ones (older locks) go
if [ -z "${OLD_END_VENV:-}" ]; then
  ls -dt "$CACHE_ROOT"/venvs/old-end-*/.mlflow_hvd-old-end-env 2>/dev/null | tail -n +3 \
    | while read -r stale; do
        old="$(dirname "$stale")"
        echo "old-end: removing the unused environment $old"
        rm -rf "$old" "$old.lock"
      done
fi

STAMP="$VENV/.mlflow_hvd-old-end"
KEY="$( (echo "$ROOT"; cat "$LOCK" "$ROOT/pyproject.toml" "$0") | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$KEY" ]; then
  before="$("$PY" -m pip freeze --exclude-editable | grep -iv '^mlflow[-_]hvd' | sort)"
  "$PY" -m pip install --quiet -e "$ROOT[tensorflow-cpu]"
  after="$("$PY" -m pip freeze --exclude-editable | grep -iv '^mlflow[-_]hvd' | sort)"
  if [ "$before" != "$after" ]; then
    diff <(echo "$before") <(echo "$after") >&2 || true
    rm -rf "$VENV"  # no longer the lock's environment
    die "installing mlflow_hvd changed the environment's packages (above): it must keep the user's"
  fi
  echo "old-end: mlflow_hvd installed; the environment's $(echo "$after" | wc -l) packages are unchanged"
  echo "$KEY" > "$STAMP"
fi
"$PY" -m mlflow_hvd.cli.horovod
"$PY" -c 'import sys, mlflow, pyspark, tensorflow as tf, keras; print("old-end: Python %d.%d.%d" % sys.version_info[:3], "TensorFlow", tf.__version__, "Keras", keras.__version__, "pyspark", pyspark.__version__, "MLflow", mlflow.__version__)' 2>/dev/null
[ "$PREPARE_ONLY" = 1 ] && exit 0
flock -u 9
cd "$ROOT"
started=$(date +%s)
rc=0
MLFLOW_HVD_TIER=old-end "$PY" -m pytest -ra -m old_end "$@" || rc=$?
[ -z "$STATUS" ] || echo "$rc $started $(date +%s)" > "$STATUS"
exit $rc

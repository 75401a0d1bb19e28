#!/usr/bin/env bash
# The test environments at the two ends of the supported ranges, each built the way a user
# with an existing environment installs mlflow_hvd (docs/install.md: your own environment):
#
#   old  Python 3.12, TensorFlow 2.16, pyspark 3.5 (Spark 3.5's own JVM side), the oldest
#        supported MLflow; tests marked old_end
#   new  Python 3.13, TensorFlow 2.21, PyTorch 2.14 as `pip install torch` gives it (PyPI's
#        CUDA 13 build, on machines without a GPU too), pyspark 4.3, the newest MLflow that
#        installs; tests marked new_end
#
#   bash scripts/end_tier.sh old|new [--prepare] [--status FILE] [--after FILE] [pytest args...]
#
#   1. the user's environment: requirements/lock-<end>-end-py3.1x.txt (hash-checked, pip);
#   2. `pip install -e '.[<extras>]'`, which must keep every version already there;
#   3. `python -m mlflow_hvd.cli.horovod --cpu`, which builds Horovod against those frameworks
#      (once: the wheel is cached like the main environment's).
# Then runs the end's tests (`--prepare`: stops before them; `--status FILE`: also writes their
# exit code and start and end times there; `--after FILE`: starts them once FILE exists, for
# a caller that prepares the environment early and runs the tests when cores are idle).
#
# PREP_NICE=N runs steps 1-3 at that niceness (`make test` gives 10: they run beside the
# main environment's set-up and tiers, which come first; the tests run at the caller's).
#
# Step 1's environment depends on the lock alone: it lives outside the checkout, in the cache
# (like Horovod's wheels; $MLFLOW_HVD_CACHE/venvs/<end>-end-<digest of the lock and Python>),
# so a new clone on the same machine reuses it; another lock's environment is removed first,
# unless a run used it in the last two hours. `.venv-<end>-end` in the checkout links to it;
# <END>_END_VENV=<dir> (OLD_END_VENV, NEW_END_VENV) uses that directory instead. Steps 2-3
# run again whenever the checkout or pyproject.toml differ from the last run's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
END="${1:-}"
case "$END" in
  old) PYVER=3.12; EXTRAS="tensorflow-cpu"; CUSTOM_PYTHON="${PYTHON_OLD_END:-}"
       CUSTOM_VENV="${OLD_END_VENV:-}" ;;
  new) PYVER=3.13; EXTRAS="tensorflow-cpu,torch"; CUSTOM_PYTHON="${PYTHON_NEW_END:-}"
       CUSTOM_VENV="${NEW_END_VENV:-}" ;;
  *) echo "usage: scripts/end_tier.sh old|new [--prepare] [--status FILE] [--after FILE]" \
       "[pytest args]" >&2
     exit 2 ;;
esac
shift
NAME="$END-end"
LOCK="$ROOT/requirements/lock-$NAME-py$PYVER.txt"
CACHE_ROOT="${MLFLOW_HVD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlflow_hvd}"
PREPARE_ONLY=0
STATUS=""  # --status FILE: write "<exit code> <tests' start> <tests' end>" (epoch seconds)
if [ "${1:-}" = "--prepare" ]; then PREPARE_ONLY=1; shift; fi
if [ "${1:-}" = "--status" ]; then STATUS="$2"; shift 2; fi
AFTER=""  # --after FILE: the tests wait for FILE (at most AFTER_WAIT seconds)
AFTER_WAIT=7200
if [ "${1:-}" = "--after" ]; then AFTER="$2"; shift 2; fi

die() { echo "$NAME: $*" >&2; exit 1; }
PREP=()
[ -z "${PREP_NICE:-}" ] || PREP=(nice -n "$PREP_NICE")

find_python() {
  if [ -n "$CUSTOM_PYTHON" ]; then echo "$CUSTOM_PYTHON"; return; fi
  if "python$PYVER" -c '' >/dev/null 2>&1; then command -v "python$PYVER"; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    # pyenv's shim answers only for the active versions: ask for an installed one
    local found
    found="$(ls -d "$(pyenv root)"/versions/"$PYVER".*/bin/python"$PYVER" 2>/dev/null \
      | sort -V | tail -n1)"
    if [ -n "$found" ]; then echo "$found"; return; fi
  fi
  return 1
}

# The new end also checks Horovod's NCCL build (docs/gpus.md: the wheel for GPU nodes) on
# this machine without a GPU: built as a user builds it (compiled when its inputs change,
# from the wheel cache otherwise), installed, tested (tests/test_gpu_wheel.py, tier
# new-end-gpu), and the CPU build put back (`--cpu`, from the cache: seconds; a run stopped
# in between leaves the NCCL build, which the next run's `--cpu` replaces). Its JUnit report
# is the tests' with "-gpu" added. GPU_WHEEL=0 leaves it out.
gpu_wheel() {
  local junit=() arg t0 rc=0
  for arg in "$@"; do
    case "$arg" in --junitxml=*) junit=("${arg%.xml}-gpu.xml" -o junit_duration_report=total) ;; esac
  done
  t0=$(date +%s)
  HOROVOD_GPU_OPERATIONS=NCCL "${PREP[@]}" "$PY" -m mlflow_hvd.cli.horovod \
    || die "the NCCL build failed (above)"
  (cd "$ROOT" && MLFLOW_HVD_TIER=new-end-gpu "${PREP[@]}" "$PY" -m pytest -ra -m gpu_wheel \
    "${junit[@]}") || rc=$?
  "${PREP[@]}" "$PY" -m mlflow_hvd.cli.horovod --cpu  # the CPU build again
  [ "$rc" = 0 ] || die "the NCCL build's tests failed (exit $rc, above)"
  # the CPU build is what the check finds: no NCCL in either extension
  local report
  report="$("$PY" -m mlflow_hvd.cli.horovod --check)" || die "the CPU build's check failed"
  case "$report" in *NCCL*) die "the CPU build did not come back: $report" ;; esac
  echo "$NAME: the NCCL build checked in $(($(date +%s) - t0))s; the CPU build is back"
}

PYTHON="$(find_python)" || die "Python $PYVER not found: install it (e.g. 'pyenv install $PYVER') or set PYTHON_${END^^}_END=/path/to/python$PYVER"
[ "$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$PYVER" ] \
  || die "$PYTHON is not Python $PYVER"

ENV_KEY="$( (cat "$LOCK"; "$PYTHON" -c 'import sys; print(sys.version, sys.executable)') \
  | sha256sum | cut -c1-16)"
if [ -n "$CUSTOM_VENV" ]; then
  VENV="$CUSTOM_VENV"
else
  VENV="$CACHE_ROOT/venvs/$NAME-$ENV_KEY"
  mkdir -p "$CACHE_ROOT/venvs"
  # a checkout's own environment from before the cache (a directory) is left as it is
  if [ -L "$ROOT/.venv-$NAME" ] || [ ! -e "$ROOT/.venv-$NAME" ]; then
    ln -sfn "$VENV" "$ROOT/.venv-$NAME"
  fi
fi
mkdir -p "$(dirname "$VENV")"
# one builder at a time per environment (two clones' CI on one machine)
exec 9> "$VENV.lock"
flock -w 1800 9 || die "another run held $VENV.lock for 30 minutes"

PY="$VENV/bin/python"
ENV_STAMP="$VENV/.mlflow_hvd-$NAME-env"
# The environments of other locks (this end's earlier versions: up to 8 GB each) go before
# this one is built, unless another run used one in the last two hours (a CI run of
# another branch on this machine; a run takes at most 90 minutes)
if [ -z "$CUSTOM_VENV" ]; then
  for stale in "$CACHE_ROOT"/venvs/"$NAME"-*/.mlflow_hvd-"$NAME"-env; do
    old="$(dirname "$stale")"
    [ -e "$stale" ] && [ "$old" != "$VENV" ] || continue
    [ -n "$(find "$stale" -mmin -120)" ] && continue
    echo "$NAME: removing $old, the environment of another lock ($(du -sh "$old" | cut -f1))"
    rm -rf "$old" "$old.lock"
  done
fi
if [ ! -f "$ENV_STAMP" ] || [ "$(cat "$ENV_STAMP")" != "$ENV_KEY" ]; then
  rm -rf "$VENV"
  echo "$NAME: creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
  "$PY" -m pip install --quiet --upgrade "pip>=24"
  "${PREP[@]}" "$PY" -m pip install --quiet --require-hashes -r "$LOCK"
  echo "$ENV_KEY" > "$ENV_STAMP"
else
  echo "$NAME: reusing $VENV (the lock's environment)"
fi
touch "$ENV_STAMP"  # in use: kept by the pruning above, in other runs

STAMP="$VENV/.mlflow_hvd-$NAME"
KEY="$( (echo "$ROOT"; cat "$LOCK" "$ROOT/pyproject.toml" "$0") | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$KEY" ]; then
  before="$("$PY" -m pip freeze --exclude-editable | grep -iv '^mlflow[-_]hvd' | sort)"
  "${PREP[@]}" "$PY" -m pip install --quiet -e "$ROOT[$EXTRAS]"
  after="$("$PY" -m pip freeze --exclude-editable | grep -iv '^mlflow[-_]hvd' | sort)"
  if [ "$before" != "$after" ]; then
    diff <(echo "$before") <(echo "$after") >&2 || true
    rm -rf "$VENV"  # no longer the lock's environment
    die "installing mlflow_hvd changed the environment's packages (above): it must keep the user's"
  fi
  echo "$NAME: mlflow_hvd installed; the environment's $(echo "$after" | wc -l) packages are unchanged"
  echo "$KEY" > "$STAMP"
fi
# the CPU build (--cpu: also where a stopped run left the NCCL build installed)
"${PREP[@]}" "$PY" -m mlflow_hvd.cli.horovod --cpu
if [ "$END" = new ] && [ "${GPU_WHEEL:-1}" != 0 ]; then gpu_wheel "$@"; fi
"$PY" -c "import sys, mlflow, pyspark, tensorflow as tf, keras; print('$NAME: Python %d.%d.%d' % sys.version_info[:3], 'TensorFlow', tf.__version__, 'Keras', keras.__version__, 'pyspark', pyspark.__version__, 'MLflow', mlflow.__version__)" 2>/dev/null
[ "$PREPARE_ONLY" = 1 ] && exit 0
flock -u 9
if [ -n "$AFTER" ]; then
  waited=0
  while [ ! -e "$AFTER" ]; do
    [ "$waited" -lt "$AFTER_WAIT" ] || die "$AFTER did not appear within ${AFTER_WAIT}s"
    sleep 1
    waited=$((waited + 1))
  done
fi
cd "$ROOT"
started=$(date +%s)
rc=0
MLFLOW_HVD_TIER="$NAME" "$PY" -m pytest -ra -m "${END}_end" "$@" || rc=$?
touch "$ENV_STAMP"  # used until now
[ -z "$STATUS" ] || echo "$rc $started $(date +%s)" > "$STATUS"
exit $rc

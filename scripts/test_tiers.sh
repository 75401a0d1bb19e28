#!/usr/bin/env bash
# `make test`: every tier, cheapest first, so that a broken commit fails in minutes.
#
#   setup     .venv from the locks + Horovod (scripts/setup.sh); the old end's environment
#             is built meanwhile, in the background (scripts/old_end.sh --prepare)
#   static    ruff, lint-imports (layering), scripts/bars.py, mypy, mkdocs --strict
#   fast      pytest: no JVM, no rank that imports TensorFlow or PyTorch (checked)
#   main      pytest: Horovod ranks, the shared local-cluster session, servers, browser
#   cluster   pytest: the two-node namespace cluster (one for the whole tier)
#   old-end   pytest -m old_end in the old end's environment (Python 3.12, TF 2.16, ...)
#
# Each tier's wall time is printed when it ends, and all of them at the end (also on
# failure). A tier that fails stops the run. PYTEST_ARGS are passed to every pytest tier;
# TIERS="fast main" runs only those (setup always runs).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
TIERS="${TIERS:-static fast main cluster old-end}"
LOGS="${MLFLOW_HVD_TIER_LOGS:-$ROOT/test-output/tiers}"
mkdir -p "$LOGS"
read -r -a EXTRA <<< "${PYTEST_ARGS:-}"

SUMMARY=()
START=$(date +%s)
PREPARE_PID=""

clock() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }

summary() {
  echo
  echo "== tier wall times =="
  for line in "${SUMMARY[@]}"; do echo "  $line"; done
  echo "  total ${TOTAL_STATUS:-interrupted} $(clock $(($(date +%s) - START)))"
}

finish() {
  [ -n "$PREPARE_PID" ] && kill "$PREPARE_PID" 2>/dev/null
  summary
}
trap finish EXIT

# tier NAME COMMAND...: runs COMMAND, records its wall time; a failure ends the run
tier() {
  local name="$1"; shift
  local t0 rc
  t0=$(date +%s)
  echo
  echo "== tier $name: $(date -u +%H:%M:%S) =="
  "$@"
  rc=$?
  local took=$(($(date +%s) - t0))
  if [ $rc -eq 0 ]; then
    SUMMARY+=("$(printf '%-8s ok     %s' "$name" "$(clock $took)")")
    echo "== tier $name: ok in $(clock $took) =="
  else
    SUMMARY+=("$(printf '%-8s FAILED %s (exit %d)' "$name" "$(clock $took)" $rc)")
    echo "== tier $name: FAILED (exit $rc) after $(clock $took) =="
    TOTAL_STATUS="FAILED"
    exit $rc
  fi
}

wants() { [[ " $TIERS " == *" $1 "* ]]; }

static() {
  "$VENV/bin/ruff" check mlflow_hvd tests examples benchmarks scripts \
    && "$VENV/bin/lint-imports" \
    && "$PY" scripts/bars.py \
    && "$VENV/bin/mypy" \
    && NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --quiet
}

# the tiers partition the suite by markers (tests/conftest.py adds them from fixtures)
pytest_tier() {
  local name="$1" expr="$2"
  MLFLOW_HVD_TIER="$name" "$PY" -m pytest -ra -m "$expr" "${EXTRA[@]}"
}

old_end() {
  if [ -n "$PREPARE_PID" ]; then
    local t0=$(date +%s)
    if ! wait "$PREPARE_PID"; then
      PREPARE_PID=""
      echo "old-end: preparing its environment failed; its log ($LOGS/old-end-prepare.log):"
      tail -n 60 "$LOGS/old-end-prepare.log"
      return 1
    fi
    PREPARE_PID=""
    echo "old-end: environment ready (waited $(clock $(($(date +%s) - t0))) for it)"
  fi
  bash scripts/old_end.sh "${EXTRA[@]}"
}

if wants old-end; then
  # built while the main environment is set up and the other tiers run: pip's downloads and
  # unpacking overlap them (a machine that has built it before reuses it from the cache)
  bash scripts/old_end.sh --prepare > "$LOGS/old-end-prepare.log" 2>&1 &
  PREPARE_PID=$!
fi
tier setup bash scripts/setup.sh

# this machine's speed today, printed beside the tiers' times (machines vary ~2.5x by day):
# the wall time of two concurrent `import tensorflow, horovod.tensorflow`
import_pair() {
  local t0 t1 a b
  t0=$(date +%s%N)
  "$PY" -c 'import tensorflow, horovod.tensorflow' >/dev/null 2>&1 &
  a=$!
  "$PY" -c 'import tensorflow, horovod.tensorflow' >/dev/null 2>&1 &
  b=$!
  wait "$a" "$b"
  t1=$(date +%s%N)
  PAIR="$(( (t1 - t0) / 1000000 ))"
  printf 'two concurrent TensorFlow+Horovod imports: %d.%02d s\n' $((PAIR / 1000)) $((PAIR % 1000 / 10))
}
import_pair  # once warm (setup has imported them)
import_pair
SUMMARY+=("$(printf 'machine: two concurrent TensorFlow+Horovod imports %d.%02d s' $((PAIR / 1000)) $((PAIR % 1000 / 10)))")
wants static && tier static static
wants fast && tier fast pytest_tier fast "not slow and not spark and not ranks and not cluster"
wants main && tier main pytest_tier main "(slow or spark or ranks) and not cluster"
wants cluster && tier cluster pytest_tier cluster "cluster"
wants old-end && tier old-end old_end
TOTAL_STATUS="ok"

#!/usr/bin/env bash
# `make test`: every tier, cheapest first, so that a broken commit fails in minutes.
#
#   setup     .venv from the locks + Horovod (scripts/setup.sh)
#   static    ruff, lint-imports (layering), scripts/bars.py, mypy, mkdocs --strict:
#             beside the fast tier (mypy takes one core, pytest the other)
#   fast      pytest: no JVM, no rank that imports TensorFlow or PyTorch (checked)
#   beside    pytest -m beside: tests whose subject is an environment or process of their
#             own, sharing nothing with the session (the quickstart's fresh venv, a PyTorch
#             user's fresh pip-installed venv, horovodrun's check, a JVM of its own): in the
#             background beside main, reported after it
#   main      pytest: Horovod ranks, the shared local-cluster session, servers, browser
#   old-end   pytest -m old_end in the old end's environment (Python 3.12, TF 2.16, ...):
#             started first, in the background (scripts/end_tier.sh old), reported here
#   cluster   pytest: the two-node namespace cluster (one for the whole tier): in the
#             background beside main, once the old end's and the beside tier's tests are
#             done; reported after main
#   new-end   pytest -m new_end in the new end's environment (Python 3.13, TF 2.21, PyTorch
#             2.14's CUDA build, ...): its environment prepared from the start, in the
#             background (scripts/end_tier.sh new), its tests once the main or the cluster
#             tier is done, beside the other's tail; reported here
#             (its preparation also builds, installs and tests Horovod's NCCL build on
#             this GPU-less machine, then puts the CPU build back: tier new-end-gpu)
#
# Each tier's wall time is printed when it ends, and all of them at the end (also on
# failure), with this machine's speed (two concurrent TensorFlow+Horovod imports) and the
# 15 slowest tests of the run with their tier (scripts/slowest.py, from each tier's JUnit
# report). A tier that fails stops the run. PYTEST_ARGS are passed to every pytest tier;
# TIERS="fast main" runs only those (setup always runs).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
TIERS="${TIERS:-static fast beside main old-end new-end cluster}"
LOGS="${MLFLOW_HVD_TIER_LOGS:-$ROOT/test-output/tiers}"
mkdir -p "$LOGS"
read -r -a EXTRA <<< "${PYTEST_ARGS:-}"

SUMMARY=()
START=$(date +%s)
END_PIDS=()
BESIDE_PID=""
CLUSTER_PID=""
STATIC_PID=""
DISK_PID=""

clock() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }

# Disk: the run's peak use, printed in the summary (a cold run fills the cache with
# environments of several GB; a full disk once ended a run). Every 5 s, the bytes used and
# the least free over the file systems of the checkout, the cache and TMPDIR (each counted
# once): "<epoch> <used> <free>" lines in disk.txt.
DISK_LOG="$LOGS/disk.txt"
disk_sample() {
  local cache="${MLFLOW_HVD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlflow_hvd}"
  while [ ! -e "$cache" ]; do cache="$(dirname "$cache")"; done
  # each file system once, by its device (df reads each path separately: their figures can
  # differ by the bytes written meanwhile)
  df -B1 --output=source,used,avail "$ROOT" "$cache" "${TMPDIR:-/tmp}" | tail -n +2 \
    | awk '!seen[$1]++ {used += $2; if (free == "" || $3 < free) free = $3}
           END {printf "%.0f %.0f\n", used, free}'
}
disk_watch() {
  while :; do echo "$(date +%s) $(disk_sample)"; sleep 5; done
}
disk_summary() {
  [ -s "$DISK_LOG" ] || return 0
  awk -v start="$START" 'NR == 1 {base = $2; low = $3}
    $2 > peak {peak = $2; at = $1}
    $3 < low {low = $3}
    END {printf "disk: peak %.1f GB used, %+.1f GB over the start (at %d:%02d); least free %.1f GB\n",
         peak / 1e9, (peak - base) / 1e9, (at - start) / 60, (at - start) % 60, low / 1e9}' \
    "$DISK_LOG"
}

summary() {
  echo
  "$PY" "$ROOT/scripts/slowest.py" "$LOGS" 15 2>/dev/null || true
  echo
  echo "== tier wall times =="
  for line in "${SUMMARY[@]}"; do echo "  $line"; done
  echo "  $(disk_summary)"
  echo "  total ${TOTAL_STATUS:-interrupted} $(clock $(($(date +%s) - START)))"
}

finish() {
  # the background tiers, with their tests and their ranks (their own sessions)
  for pid in "${END_PIDS[@]}"; do [ -n "$pid" ] && kill -- "-$pid" 2>/dev/null; done
  [ -n "$BESIDE_PID" ] && kill -- "-$BESIDE_PID" 2>/dev/null
  [ -n "$CLUSTER_PID" ] && kill -- "-$CLUSTER_PID" 2>/dev/null
  [ -n "$STATIC_PID" ] && kill -- "-$STATIC_PID" 2>/dev/null
  [ -n "$DISK_PID" ] && kill "$DISK_PID" 2>/dev/null
  summary
}

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

FAST_EXPR="not slow and not spark and not ranks and not cluster and not beside"
MAIN_EXPR="(slow or spark or ranks) and not cluster and not beside"

static() {
  # mypy (the longest, one core) beside the others, its output printed after theirs
  local mypy_pid mypy_rc=0 rc=0
  "$VENV/bin/mypy" > "$LOGS/mypy.log" 2>&1 &
  mypy_pid=$!
  "$VENV/bin/ruff" check mlflow_hvd tests examples benchmarks scripts \
    && "$VENV/bin/lint-imports" \
    && "$PY" scripts/bars.py \
    && NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict \
    || rc=$?
  wait "$mypy_pid" || mypy_rc=$?
  cat "$LOGS/mypy.log"
  [ $rc -eq 0 ] && [ $mypy_rc -eq 0 ]
}

# the tiers partition the suite by markers (tests/conftest.py adds them from fixtures);
# each writes a JUnit report for the run's list of slowest tests
pytest_tier() {
  local name="$1" expr="$2"
  rm -f "$LOGS/$name.xml"
  MLFLOW_HVD_TIER="$name" "$PY" -m pytest -ra -m "$expr" --junitxml="$LOGS/$name.xml" \
    -o junit_duration_report=total "${EXTRA[@]}"
}

# a tier in the background, in a session of its own (this script again, `--tier NAME`): its
# output goes to its log, its exit code and start and end times (epoch seconds) to
# <log>.status; sets BG_PID. `background_wait` prints the log and notes its time.
background() {
  local name="$1"
  rm -f "$LOGS/$name.status"
  setsid bash "$ROOT/scripts/test_tiers.sh" --tier "$name" > "$LOGS/$name.log" 2>&1 &
  BG_PID=$!
}

background_wait() {
  local name="$1" pid="$2" rc=0 status t0 t1
  wait "$pid" || rc=$?
  cat "$LOGS/$name.log"
  if [ -f "$LOGS/$name.status" ]; then
    read -r status t0 t1 < "$LOGS/$name.status"
    BACKGROUND_NOTE="$(printf '         (it took %s from %s, beside the tiers before; exit %s)' \
      "$(clock $((t1 - t0)))" "$(date -u -d "@$t0" +%H:%M:%S)" "$status")"
  fi
  return $rc
}

# The ends' tiers run beside the others from the start: each environment is built (or found
# in the cache) while the main one is set up, at a lower priority (niceness 10: on a new
# machine three Horovod builds would otherwise share the cores equally, and the main one
# holds up every tier), then its tests run beside the static and fast
# tiers (its own interpreter, Spark sessions and servers; its rank checks see only its own
# interpreter's ranks). The cluster tier waits for it (the cores). Its wall time here is the
# wait; the time its tests took is printed below it.
declare -A END_PID=()
start_end() {  # start_end END [--after FILE]: its tests wait for FILE
  local end="$1" name="$1-end"
  shift
  rm -f "$LOGS/$name.status" "$LOGS/$name.xml"
  PREP_NICE=10 setsid bash scripts/end_tier.sh "$end" --status "$LOGS/$name.status" "$@" \
    --junitxml="$LOGS/$name.xml" -o junit_duration_report=total "${EXTRA[@]}" \
    > "$LOGS/$name.log" 2>&1 &
  END_PID[$end]=$!
  END_PIDS+=($!)
  echo "$name: its environment and tests run in the background (log: $LOGS/$name.log)"
}

end_wait() {
  local end="$1" name="$1-end" rc=0 status t0 t1
  wait "${END_PID[$end]}" || rc=$?
  cat "$LOGS/$name.log"
  END_NOTE=""
  if [ -f "$LOGS/$name.status" ]; then
    read -r status t0 t1 < "$LOGS/$name.status"
    END_NOTE="$(printf '         (its tests took %s from %s, beside the tiers before; exit %s)' \
      "$(clock $((t1 - t0)))" "$(date -u -d "@$t0" +%H:%M:%S)" "$status")"
  else
    echo "$name: its environment could not be prepared (above)"
  fi
  if [ $rc -ne 0 ] && [ -n "$END_NOTE" ]; then SUMMARY+=("$END_NOTE"); fi
  return $rc
}

# running PID: the process exists and has not exited (an exited child of another process
# stays a zombie until that process waits for it)
running() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  [ "${stat%% *}" != "Z" ]
}

# `--tier NAME`: one background tier (see `background`)
if [ "${1:-}" = "--tier" ]; then
  t0=$(date +%s)
  rc=0
  case "$2" in
    static) static || rc=$? ;;
    beside) pytest_tier beside "beside" || rc=$? ;;
    cluster)
      # after the tiers it must not share the cores with: the old end's tests and the
      # beside tier (its fresh venv and JVM take a core of their own); their processes are
      # named by AFTER_PIDS
      for pid in ${AFTER_PIDS:-}; do
        while running "$pid"; do sleep 2; done
      done
      echo "== cluster: its tests start at $(date -u +%H:%M:%S) =="
      pytest_tier cluster "cluster" || rc=$?
      ;;
    *) echo "test_tiers: no background tier $2" >&2; rc=2 ;;
  esac
  echo "$rc $t0 $(date +%s)" > "$LOGS/$2.status"
  exit $rc
fi
trap finish EXIT
rm -f "$DISK_LOG"
disk_watch > "$DISK_LOG" 2>/dev/null &
DISK_PID=$!

# the old end's tests run from the start (the cluster tier waits for them); the new end's
# wait for the main tier's end, and run beside the cluster tier's tail
NEW_END_GO="$LOGS/new-end.go"
rm -f "$NEW_END_GO"
wants old-end && start_end old
wants new-end && start_end new --after "$NEW_END_GO"

# this machine's speed today, printed beside the tiers' times (machines vary ~2.5x by day):
# the wall time of two concurrent `import tensorflow, horovod.tensorflow`, measured after the
# last tier, when nothing else runs
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
  printf 'two concurrent TensorFlow+Horovod imports: %d.%02d s\n' $((PAIR / 1000)) \
    $((PAIR % 1000 / 10))
}

tier setup bash scripts/setup.sh
# static beside fast: each mostly one process on one core; static's output after fast's
if wants static; then
  background static
  STATIC_PID=$BG_PID
fi
wants fast && tier fast pytest_tier fast "$FAST_EXPR"
if [ -n "$STATIC_PID" ]; then
  BACKGROUND_NOTE=""
  tier static background_wait static "$STATIC_PID"
  STATIC_PID=""
  SUMMARY+=("$BACKGROUND_NOTE")
fi
# the beside tier from here: the static and fast tiers and the old end keep both cores
# busy, the main tier's ranks and servers leave about a quarter of them idle
if wants beside; then
  background beside
  BESIDE_PID=$BG_PID
  echo "beside: its tests run in the background (log: $LOGS/beside.log)"
fi
# the cluster tier beside the main tier, once the old end's tests and the beside tier are
# done: each tier alone left a fifth of the two cores idle
# (ranks waiting on collectives, servers, JVMs starting); their tests keep to their own
# processes (tests/conftest.py's session mark), ports and, for the cluster, network
# namespaces
if wants cluster; then
  export AFTER_PIDS="${END_PID[old]:-} $BESIDE_PID"
  background cluster
  CLUSTER_PID=$BG_PID
  echo "cluster: its tests run in the background after the old end's and the beside tier's (log: $LOGS/cluster.log)"
  # the new end's tests go once the cluster tier or the main tier is done, whichever is
  # first: beside the other's tail, whose ranks and servers leave cores idle
  ( while running "$CLUSTER_PID"; do sleep 2; done; touch "$NEW_END_GO" ) &
fi
wants main && tier main pytest_tier main "$MAIN_EXPR"
if [ -n "$BESIDE_PID" ]; then
  BACKGROUND_NOTE=""
  tier beside background_wait beside "$BESIDE_PID"
  BESIDE_PID=""
  SUMMARY+=("$BACKGROUND_NOTE")
fi
if wants old-end; then
  tier old-end end_wait old
  SUMMARY+=("$END_NOTE")
fi
# the new end's tests, once the main tier is done (if the cluster tier was not done first)
touch "$NEW_END_GO"
if [ -n "$CLUSTER_PID" ]; then
  BACKGROUND_NOTE=""
  tier cluster background_wait cluster "$CLUSTER_PID"
  CLUSTER_PID=""
  SUMMARY+=("$BACKGROUND_NOTE")
fi
if wants new-end; then
  tier new-end end_wait new
  SUMMARY+=("$END_NOTE")
fi
import_pair  # the first warms the files
import_pair
SUMMARY+=("$(printf 'machine: two concurrent TensorFlow+Horovod imports took %d.%02d s' \
  $((PAIR / 1000)) $((PAIR % 1000 / 10)))")
TOTAL_STATUS="ok"

#!/usr/bin/env bash
# Creates .venv (when missing) and installs the tested environment: requirements/lock-py3.11.txt
# (what users run; hash-checked; PyTorch's CPU build among them, found where pip finds links)
# with requirements/lock-dev-py3.11.txt (test, lint, type, docs and browser tools), this project
# (editable), and a Horovod 0.28.1 wheel built from source with Gloo + TensorFlow + PyTorch and
# cached outside the repo.
# Idempotent: a second run with nothing changed finishes in seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
CACHE_ROOT="${MLFLOW_HVD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlflow_hvd}"

die() { echo "setup: $*" >&2; exit 1; }

# --- prerequisites -------------------------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
command -v "$PYTHON" >/dev/null 2>&1 || die "Python 3.11 not found. Install it (e.g. 'apt-get install python3.11 python3.11-venv python3.11-dev') or set PYTHON=/path/to/python3.11."
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$PYVER" = "3.11" ] || die "Python 3.11 is required (the tested environment: requirements/lock-py3.11.txt), found $PYVER at $(command -v "$PYTHON"). Set PYTHON=/path/to/python3.11."
for tool in cmake g++ make; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' is missing; Horovod compiles from source. Install it with 'apt-get install -y cmake g++ make'."
done
command -v java >/dev/null 2>&1 || die "Java is missing; Spark 4 needs Java 17. Install it with 'apt-get install -y openjdk-17-jre-headless'."
JAVA_MAJOR="$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1)"
[ "${JAVA_MAJOR:-0}" -ge 17 ] || die "Java 17 or newer is needed by Spark 4, found '${JAVA_MAJOR:-unknown}'. Install it with 'apt-get install -y openjdk-17-jre-headless'."

# Debian's chromium, for the MLflow UI test (tests/test_ui.py; Playwright drives it, nothing
# is downloaded); `make demo` does not need it, so a machine where it cannot be installed gets
# a warning, and the UI test then fails naming the command
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium (for the UI test)"
    (apt-get install -y -q chromium >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }) \
      || echo "setup: warning: 'apt-get install -y chromium' failed; the UI test needs it" >&2
  else
    echo "setup: warning: no chromium; the UI test needs it: 'sudo apt-get install -y chromium'" >&2
  fi
fi

# --- venv ----------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.mlflow_hvd-setup"
KEY="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" "$ROOT/requirements/lock-py3.11.txt" "$ROOT/requirements/lock-dev-py3.11.txt" | sha256sum | cut -c1-16)"
# Spark's driver JVM starts in about half the time with a class-data archive of its classes
# (mlflow_hvd/backends/spark/jvm.py); built once per Java + Spark, in the cache. Optional: a
# failure is reported and setup goes on.
jvm_archive() {
  "$PY" -m mlflow_hvd.cli.jvm_archive || echo "setup: warning: Spark's class-data archive was not built; Spark starts without it (slower)" >&2
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && "$PY" -c 'import mlflow_hvd' 2>/dev/null \
   && MLFLOW_HVD_CACHE="$CACHE_ROOT" "$PY" -m mlflow_hvd.cli.horovod; then
  echo "setup: $VENV is up to date"
  jvm_archive
  exit 0
fi

"$PY" -m pip install --quiet --upgrade "pip>=24"
# the exact tested set, every transitive version and its hashes (refresh: `make lock`),
# installed by uv (its own version from the dev lock, hash-checked like the rest): the same
# packages as pip installs, in a third of the time (46 s against pip's 2.5 min here). Byte-
# compiled as pip does: where PYTHONDONTWRITEBYTECODE is set (these machines), a module
# without its .pyc is compiled again by every process that imports it. uv reads no pip
# configuration: pip's find-links (where PyTorch's CPU build lies) and PIP_EXTRA_INDEX_URL
# are passed on.
UV_REQ="$VENV/.uv-requirement.txt"
awk '/^uv==/{f=1; print; next} f && /^    /{print; next} f{exit}' \
  "$ROOT/requirements/lock-dev-py3.11.txt" > "$UV_REQ"
[ -s "$UV_REQ" ] || die "requirements/lock-dev-py3.11.txt names no uv version"
"$PY" -m pip install --quiet --no-deps --require-hashes -r "$UV_REQ"
UV_ARGS=()
FIND_LINKS="${PIP_FIND_LINKS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}"
for link in $FIND_LINKS; do UV_ARGS+=(--find-links "$link"); done
if [ -n "${PIP_EXTRA_INDEX_URL:-}" ]; then
  # as pip does: the best match over every index (the hashes decide what is accepted)
  for url in $PIP_EXTRA_INDEX_URL; do UV_ARGS+=(--extra-index-url "$url"); done
  UV_ARGS+=(--index-strategy unsafe-best-match)
fi
# pyspark comes as an sdist only, which uv built again whenever it refreshed its cached copy
# (each CI run here: about 2 min of every setup). Its wheel is built once per sdist hash, by
# pip from the hash-checked sdist, into the cache; the lock's pyspark line is replaced by that
# wheel with the wheel's own hash.
PYSPARK_REQ="$VENV/.pyspark-requirement.txt"
awk '/^pyspark==/{f=1; print; next} f && /^    --hash/{print; next} f{exit}' \
  "$ROOT/requirements/lock-py3.11.txt" > "$PYSPARK_REQ"
PYSPARK_SDIST="$(sed -n 's/.*--hash=sha256:\([0-9a-f]*\).*/\1/p' "$PYSPARK_REQ" | head -n1)"
[ -n "$PYSPARK_SDIST" ] || die "requirements/lock-py3.11.txt names no hashed pyspark"
PYSPARK_WHEELS="$CACHE_ROOT/wheels/pyspark-$(head -n1 "$PYSPARK_REQ" | sed 's/^pyspark==\([^ ]*\).*/\1/')-${PYSPARK_SDIST:0:16}"
if ! ls "$PYSPARK_WHEELS"/pyspark-*.whl >/dev/null 2>&1; then
  mkdir -p "$CACHE_ROOT/wheels"
  building="$(mktemp -d "$CACHE_ROOT/wheels/.pyspark-XXXXXX")"
  "$PY" -m pip wheel --quiet --no-deps --require-hashes -r "$PYSPARK_REQ" -w "$building" \
    || { rm -rf "$building"; die "building pyspark's wheel from its sdist failed (above)"; }
  mv -T "$building" "$PYSPARK_WHEELS" 2>/dev/null || rm -rf "$building"  # another setup won
fi
PYSPARK_WHEEL="$(ls "$PYSPARK_WHEELS"/pyspark-*.whl | head -n1)"
RUNTIME_REQ="$VENV/.runtime-requirements.txt"
{ awk '/^pyspark==/{skip=1; next} skip && /^    /{next} {skip=0; print}' \
    "$ROOT/requirements/lock-py3.11.txt"
  echo "pyspark @ file://$PYSPARK_WHEEL --hash=sha256:$(sha256sum "$PYSPARK_WHEEL" | cut -d' ' -f1)"
} > "$RUNTIME_REQ"
"$VENV/bin/uv" pip install --quiet --python "$PY" --require-hashes --compile-bytecode \
  "${UV_ARGS[@]}" \
  -r "$RUNTIME_REQ" -r "$ROOT/requirements/lock-dev-py3.11.txt"
"$PY" -m pip install --quiet --no-deps -e "$ROOT"
# Spark's class-data archive (below) names and fits one set of jar paths, sizes and times:
# one fixed time for pyspark's jars keeps this venv's archive when pyspark is installed again
# (a new archive takes 2-4 min to build)
"$PY" - <<'PYEOF'
import os, pathlib, pyspark
for jar in (pathlib.Path(pyspark.__file__).parent / "jars").glob("*.jar"):
    os.utime(jar, (946684800, 946684800))  # 2000-01-01
PYEOF
# uv's cache grows with every install (24 GB seen on a machine that had run many locks):
# its dangling entries go (on a new machine, 478 MiB of build environments of the sdists it
# compiled); the wheels this lock installed stay, so the next clone installs in seconds.
# A cache another uv is using is left alone.
timeout 120 "$VENV/bin/uv" cache prune --quiet \
  || echo "setup: warning: 'uv cache prune' did not finish (another uv holds the cache); nothing was removed" >&2
# Horovod: built from its hash-checked sdist against the TensorFlow and PyTorch above, once
# per Horovod/TensorFlow/PyTorch/Python/CPU, and cached under $CACHE_ROOT/wheels
# (mlflow_hvd/cli/horovod.py)
MLFLOW_HVD_CACHE="$CACHE_ROOT" "$PY" -m mlflow_hvd.cli.horovod
echo "$KEY" > "$STAMP"
jvm_archive

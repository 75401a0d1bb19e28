#!/usr/bin/env bash
# Creates .venv (when missing) and installs everything mlflow_hvd needs, including a
# Horovod 0.28.1 wheel built from source with Gloo + TensorFlow and cached outside the repo.
# Idempotent: a second run with nothing changed finishes in seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
HOROVOD_VERSION=0.28.1
TF_VERSION=2.18.1
CACHE_ROOT="${MLFLOW_HVD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlflow_hvd}"

die() { echo "setup: $*" >&2; exit 1; }

# --- prerequisites -------------------------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
command -v "$PYTHON" >/dev/null 2>&1 || die "Python 3.11 not found. Install it (e.g. 'apt-get install python3.11 python3.11-venv python3.11-dev') or set PYTHON=/path/to/python3.11."
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$PYVER" = "3.11" ] || die "Python 3.11 is required (TensorFlow 2.18.1 + Horovod 0.28.1), found $PYVER at $(command -v "$PYTHON"). Set PYTHON=/path/to/python3.11."
for tool in cmake g++ make; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' is missing; Horovod compiles from source. Install it with 'apt-get install -y cmake g++ make'."
done
command -v java >/dev/null 2>&1 || die "Java is missing; Spark 4 needs Java 17. Install it with 'apt-get install -y openjdk-17-jre-headless'."
JAVA_MAJOR="$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1)"
[ "${JAVA_MAJOR:-0}" -ge 17 ] || die "Java 17 or newer is needed by Spark 4, found '${JAVA_MAJOR:-unknown}'. Install it with 'apt-get install -y openjdk-17-jre-headless'."

# --- venv ----------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.mlflow_hvd-setup"
KEY="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16)"
# Spark's driver JVM starts in about half the time with a class-data archive of its classes
# (mlflow_hvd/backends/spark/jvm.py); built once per Java + Spark, in the cache. Optional: a
# failure is reported and setup goes on.
jvm_archive() {
  "$PY" -m mlflow_hvd.cli.jvm_archive || echo "setup: warning: Spark's class-data archive was not built; Spark starts without it (slower)" >&2
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && "$PY" -c 'import horovod.tensorflow, mlflow_hvd' 2>/dev/null; then
  echo "setup: $VENV is up to date"
  jvm_archive
  exit 0
fi

"$PY" -m pip install --quiet --upgrade "pip>=24" setuptools wheel packaging
"$PY" -m pip install --quiet "tensorflow-cpu==$TF_VERSION"

# --- horovod wheel (cached by horovod, TF, Python and CPU) ---------------------------
CPU_ID="$(uname -m)-$( (grep -m1 'model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo) 2>/dev/null | sha256sum | cut -c1-12)"
WHEEL_DIR="$CACHE_ROOT/wheels/horovod-$HOROVOD_VERSION-tf$TF_VERSION-py$PYVER-$CPU_ID"
if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  echo "setup: building horovod $HOROVOD_VERSION against tensorflow-cpu $TF_VERSION (about 3-4 minutes on 2 cores)"
  mkdir -p "$WHEEL_DIR.tmp"
  HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_TENSORFLOW=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip wheel --no-deps --no-build-isolation --no-cache-dir \
      -w "$WHEEL_DIR.tmp" "horovod==$HOROVOD_VERSION"
  rm -rf "$WHEEL_DIR" && mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
else
  echo "setup: reusing cached wheel in $WHEEL_DIR"
fi
"$PY" -m pip install --quiet "$WHEEL_DIR"/horovod-*.whl

# --- the project ---------------------------------------------------------------------
"$PY" -m pip install --quiet -e "$ROOT[dev]"
"$PY" - <<'PYEOF'
import horovod.tensorflow as hvd
from horovod.common.util import gloo_built
if not gloo_built():
    raise SystemExit("setup: horovod was built without Gloo; delete the cached wheel and rerun")
print("setup: horovod", __import__("horovod").__version__, "with Gloo; tensorflow", __import__("tensorflow").__version__)
PYEOF
echo "$KEY" > "$STAMP"
jvm_archive

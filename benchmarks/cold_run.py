"""Cold ``mlflow run . -P np=2 -P epochs=1``: its time outside training, against the floor
that any MLflow project launching Horovod on a new embedded Spark pays, measured in the
same run.

* ours: ``mlflow run <repo> --env-manager local -P np=2 -P epochs=1`` into a SQLite store
  that already exists (as a user's second run). Outside training = wall -
  ``fit_evaluate_seconds`` (rank 0's ``model.fit`` + ``model.evaluate``, logged by the
  example).
* floor, the sum of three parts no launcher avoids: ``mlflow run`` of a project whose entry
  point does nothing (MLflow's CLI and run bookkeeping); a new ``local[2]`` SparkSession
  started and stopped in a new Python process, with the JVM start-up options mlflow_hvd
  uses (the class-data archive, when built, and the C1-only JIT; see
  ``mlflow_hvd/backends/spark/jvm.py``); two concurrent new processes importing TensorFlow
  and Horovod (the ranks' imports). The same SparkSession with Spark's default JVM options
  is printed beside it, for what those options save.
* the model's logging apart: the example logs ``log_model_seconds`` (rank 0's
  ``mlflow_hvd.tracking.log_model``: signature, input example, pip requirements); its peer is
  ``mlflow.tensorflow.log_model`` of the same model with the same arguments in a new process
  that has imported Keras and MLflow, as rank 0 has by then (``import mlflow.tensorflow``
  timed in both). Most of either is MLflow checking the model's requirements against every
  installed file (``importlib_metadata.packages_distributions``), once per process.

Rounds alternate the arms after one warm-up of each. Prints min/median/max per arm and per
floor part, and the ratio of medians.

    .venv/bin/python benchmarks/cold_run.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = os.path.dirname(sys.executable)


def _stats(name: str, values: list[float]) -> str:
    return (f"{name:<34} min {min(values):6.2f}  median {statistics.median(values):6.2f}  "
            f"max {max(values):6.2f} s   (n={len(values)})")


def _timed(cmd: list[str], env: dict[str, str], cwd: str) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return took


# The peer of rank 0's log_model: MLflow's own call, same model and arguments, new process.
LOG_MODEL = """
import sys, time
sys.path.insert(0, {repo!r})
import keras, mlflow
from examples.digits_keras import build_model, load_data
from mlflow_hvd.rank.tracking.requirements import installed
from mlflow_hvd.rank.tracking.signature import declared_signature
model = build_model()
model.compile(optimizer=keras.optimizers.Adam(0.001), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"], jit_compile=False)
x_test = load_data(0)[2]
with mlflow.start_run():
    t0 = time.monotonic()
    import mlflow.tensorflow
    mlflow.tensorflow.log_model(model, name="model", input_example=x_test[:4],
                                signature=declared_signature(model),
                                pip_requirements=installed())
    print("log_model_seconds", time.monotonic() - t0)
"""


def _log_model_seconds(env: dict[str, str], cwd: str) -> float:
    proc = subprocess.run([sys.executable, "-c", LOG_MODEL.format(repo=str(REPO))], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("log_model_seconds ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"logging the model with MLflow failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return float(lines[-1].split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import mlflow

    tmp = tempfile.mkdtemp()
    uri = f"sqlite:///{tmp}/bench.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "TF_CPP_MIN_LOG_LEVEL": "2",
           "PATH": BIN + os.pathsep + os.environ["PATH"]}
    noop = Path(tmp) / "noop"
    noop.mkdir()
    (noop / "MLproject").write_text(
        "name: noop\nentry_points:\n  main:\n    command: python -c pass\n"
    )
    client = mlflow.MlflowClient(tracking_uri=uri)
    mlflow_cmd = [os.path.join(BIN, "mlflow"), "run"]

    def ours() -> tuple[float, float, float]:
        before = {r.info.run_id for r in client.search_runs(["0"])}
        wall = _timed([*mlflow_cmd, str(REPO), "--env-manager", "local", "-P", "np=2",
                       "-P", "epochs=1"], env, tmp)
        (run,) = [r for r in client.search_runs(["0"]) if r.info.run_id not in before]
        metrics = run.data.metrics
        return wall, wall - metrics["fit_evaluate_seconds"], metrics["log_model_seconds"]

    def floor() -> tuple[float, float, float, float, float]:
        cli = _timed([*mlflow_cmd, str(noop), "--env-manager", "local"], env, tmp)
        jvm = _timed([sys.executable, "-c",
                      "from mlflow_hvd.backends.spark.session import new_session\n"
                      "new_session('local[2]').stop()"], env, tmp)
        plain = _timed([sys.executable, "-c",
                        "from pyspark.sql import SparkSession\n"
                        "s = SparkSession.builder.master('local[2]').getOrCreate()\n"
                        "s.stop()"], env, tmp)
        t0 = time.monotonic()
        imports = [subprocess.Popen([sys.executable, "-c",
                                     "import horovod.tensorflow, tensorflow"], env=env)
                   for _ in range(2)]
        if any(p.wait(timeout=300) for p in imports):
            raise SystemExit("importing TensorFlow and Horovod failed")
        imported = time.monotonic() - t0
        return cli, jvm, imported, plain, _log_model_seconds(env, tmp)

    ours()  # warm-up: creates the store, fills the OS caches
    floor()
    walls: list[float] = []
    outside: list[float] = []
    logged: list[float] = []
    parts: dict[str, list[float]] = {"mlflow run (no-op)": [], "SparkSession": [],
                                     "2 x import TF+Horovod": []}
    plains: list[float] = []
    floors: list[float] = []
    peer_logged: list[float] = []
    for _ in range(args.rounds):
        w, o, lm = ours()
        walls.append(w)
        outside.append(o)
        logged.append(lm)
        cli, jvm, imp, plain, peer_lm = floor()
        plains.append(plain)
        peer_logged.append(peer_lm)
        for key, value in zip(parts, (cli, jvm, imp), strict=True):
            parts[key].append(value)
        floors.append(cli + jvm + imp)
    launcher = [o - lm for o, lm in zip(outside, logged, strict=True)]
    with_model = [f + lm for f, lm in zip(floors, peer_logged, strict=True)]

    print(f"cold mlflow run . -P np=2 -P epochs=1; {args.rounds} alternated rounds")
    print(_stats("ours: wall", walls))
    print(_stats("ours: outside fit+evaluate", outside))
    # Rank 0 imports MLflow (about 4 s cold) at its first checkpoint, inside fit, since
    # params and metrics no longer need it: compare walls too, not only "outside".
    print(_stats("ours: fit+evaluate", [w - o for w, o in zip(walls, outside, strict=True)]))
    print(_stats("ours: log_model (rank 0)", logged))
    print(_stats("ours: outside fit+evaluate+log_model", launcher))
    for key, values in parts.items():
        print(_stats(f"floor part: {key}", values))
    print(_stats("floor: sum of the parts", floors))
    print(_stats("(SparkSession, Spark's JVM defaults)", plains))
    print(_stats("peer: mlflow.tensorflow.log_model", peer_logged))
    print(_stats("floor + peer log_model", with_model))

    def ratio(a: list[float], b: list[float]) -> str:
        return f"{statistics.median(a) / statistics.median(b):.2f}"

    print(f"ratios of medians: outside (with the model's logging) / (floor + MLflow's "
          f"log_model) = {ratio(outside, with_model)}; outside without it / floor = "
          f"{ratio(launcher, floors)}; log_model ours / MLflow's = {ratio(logged, peer_logged)};"
          f" wall / (floor + MLflow's log_model) = {ratio(walls, with_model)}")


if __name__ == "__main__":
    main()

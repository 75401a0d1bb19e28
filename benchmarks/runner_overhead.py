"""Wall time of one cold 2-rank job (new rank processes), against peers doing the same work.

Every arm runs the same trivial allreduce in 2 fresh Python processes that import
TensorFlow and Horovod; none logs to MLflow (``track=False``):

* Spark: ``HorovodRunner(np=2)`` vs ``horovod.spark.run(num_proc=2, use_gloo=True)``, on
  the same ``local-cluster[2,1,1024]`` SparkSession (its executors warm);
* local: ``HorovodRunner(np=-2)`` vs the floor of any launcher: two concurrent
  ``python -c "import horovod.tensorflow, tensorflow"`` processes.

Arms alternate in every round, after one warm-up each. Prints min/median/max per arm and
the ratios of medians.

    .venv/bin/python benchmarks/runner_overhead.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def trivial_allreduce() -> float:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    value = float(hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum).numpy())
    return value


def two_imports() -> float:
    procs = [
        subprocess.Popen([sys.executable, "-c", "import horovod.tensorflow, tensorflow"])
        for _ in range(2)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], codes
    return 3.0


def _line(name: str, values: list[float]) -> str:
    return (f"{name:<34} min {min(values):6.2f}  median {statistics.median(values):6.2f}  "
            f"max {max(values):6.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import horovod.spark
    from pyspark.sql import SparkSession

    from mlflow_hvd import HorovodRunner, TrackingConfig

    spark = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.TF_CPP_MIN_LOG_LEVEL", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")

    arms: dict[str, Callable[[], float]] = {
        "HorovodRunner(np=2) on Spark": lambda: float(
            HorovodRunner(np=2, spark=spark,
                tracking=TrackingConfig(track=False)).run(trivial_allreduce)
        ),
        "horovod.spark.run(num_proc=2)": lambda: float(
            horovod.spark.run(trivial_allreduce, num_proc=2, use_gloo=True, verbose=0)[0]
        ),
        "HorovodRunner(np=-2) local": lambda: float(
            HorovodRunner(np=-2, tracking=TrackingConfig(track=False)).run(trivial_allreduce)
        ),
        "two concurrent TF+Horovod imports": two_imports,
    }
    for name, fn in arms.items():
        assert fn() == 3.0, f"{name}: the warm-up returned a wrong allreduce"
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            assert fn() == 3.0
            times[name].append(time.perf_counter() - t0)
    print(f"one 2-rank job with new processes, {args.rounds} alternated rounds")
    for name, values in times.items():
        print(_line(name, values))
    med = {k: statistics.median(v) for k, v in times.items()}
    names = list(arms)
    print(f"ratio Spark: {med[names[0]] / med[names[1]]:.2f} (goal <= 0.45); "
          f"ratio local: {med[names[2]] / med[names[3]]:.2f} (goal <= 1.0)")
    spark.stop()


if __name__ == "__main__":
    main()

"""Wall time of a warm 2-rank job: HorovodRunner(np=2) vs horovod.spark.run(num_proc=2).

Both run the same trivial allreduce on the same local-cluster[2,1,1024] SparkSession, in
the same process, alternating, after one warm-up run each. Prints medians and their ratio.

    .venv/bin/python benchmarks/runner_overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def trivial_allreduce() -> float:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    value = float(hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum).numpy())
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import horovod.spark
    from pyspark.sql import SparkSession

    from mlflow_hvd import HorovodRunner

    spark = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.TF_CPP_MIN_LOG_LEVEL", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")

    def ours() -> float:
        return float(HorovodRunner(np=2, spark=spark).run(trivial_allreduce))

    def peer() -> float:
        results = horovod.spark.run(trivial_allreduce, num_proc=2, use_gloo=True, verbose=0)
        return float(results[0])

    for name, fn in (("mlflow_hvd", ours), ("horovod.spark", peer)):
        assert fn() == 3.0, f"{name} warm-up returned a wrong allreduce"
    times: dict[str, list[float]] = {"mlflow_hvd": [], "horovod.spark": []}
    for _ in range(args.repeats):
        for name, fn in (("mlflow_hvd", ours), ("horovod.spark", peer)):
            t0 = time.perf_counter()
            assert fn() == 3.0
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, values in times.items():
        runs = " ".join(f"{v:.2f}" for v in values)
        print(f"{name:14s} median {med[name]:6.2f} s  runs: {runs}")
    print(f"ratio mlflow_hvd / horovod.spark = {med['mlflow_hvd'] / med['horovod.spark']:.2f}")
    spark.stop()


if __name__ == "__main__":
    main()

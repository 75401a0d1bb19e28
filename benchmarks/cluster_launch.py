"""Warm launch of np=4 on the two-node namespace cluster: HorovodRunner vs horovod.spark.run.

Starts the test cluster of tests/cluster.py (root, Linux namespaces: node-a and node-b,
2 slots each), one SparkSession on it, then alternates the two arms on the same trivial
allreduce (np=4, two ranks per host, Gloo across hosts) after one warm-up run each.
horovod.spark.run is given ``nics`` (it matches interfaces by name and would otherwise pick
the driver's uplink); HorovodRunner finds the interface that routes to the driver itself.
Prints min/median/max per arm and the ratio of medians.

    sudo .venv/bin/python benchmarks/cluster_launch.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def trivial_allreduce() -> float:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    return float(hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum).numpy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from cluster import NODE_IFACE, two_node_cluster

    with two_node_cluster() as c:
        os.environ.update(c.driver_env())
        import horovod.spark
        from pyspark.sql import SparkSession

        from mlflow_hvd import HorovodRunner, TrackingConfig

        spark = SparkSession.builder.getOrCreate()  # master etc. from spark-defaults.conf
        spark.sparkContext.setLogLevel("ERROR")

        def ours() -> float:
            return float(HorovodRunner(np=4, spark=spark,
                tracking=TrackingConfig(track=False)).run(trivial_allreduce))

        def peer() -> float:
            # horovod.spark matches NICs by name; name the one that routes (ours finds it)
            results = horovod.spark.run(trivial_allreduce, num_proc=4, use_gloo=True, verbose=0,
                                        nics={NODE_IFACE})
            return float(results[0])

        arms = (("mlflow_hvd", ours), ("horovod.spark", peer))
        for name, fn in arms:
            if fn() != 10.0:
                raise SystemExit(f"{name} warm-up returned a wrong allreduce")
        times: dict[str, list[float]] = {name: [] for name, _ in arms}
        for _ in range(args.repeats):
            for name, fn in arms:
                t0 = time.perf_counter()
                if fn() != 10.0:
                    raise SystemExit(f"{name} returned a wrong allreduce")
                times[name].append(time.perf_counter() - t0)
        spark.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"np=4 on 2 hosts x 2 slots, {args.repeats} alternated rounds after a warm-up")
    for name, values in times.items():
        print(f"{name:14s} min {min(values):6.2f}  median {med[name]:6.2f}  "
              f"max {max(values):6.2f} s   runs: " + " ".join(f"{v:.2f}" for v in values))
    print(f"ratio mlflow_hvd / horovod.spark (medians) = "
          f"{med['mlflow_hvd'] / med['horovod.spark']:.2f}")


if __name__ == "__main__":
    main()

"""Recovery after a lost rank vs a cold start, np=2 on Spark ``local-cluster[2,1,1024]``.

Both arms train the same small Keras model with checkpoints in MLflow (a SQLite store):

* ``recovery``: ``HorovodRunner(np=2, max_failures=1)``; on the first attempt rank 1
  SIGKILLs itself half-way through epoch 2. Measured: from the moment rank 1 dies to the
  end of the first training step of the restarted attempt, which has resumed from the
  checkpoint of epoch 1 (detecting the loss, stopping rank 0, cancelling the Spark stage,
  relaunching both ranks, restoring the checkpoint).
* ``cold``: the same job without a failure. Measured: from ``run()`` to the end of its first
  training step (launching both ranks, building the model, no checkpoint to restore).

Rounds alternate the arms. Prints min/median/max per arm and the ratio of medians.

    .venv/bin/python benchmarks/retry_recovery.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def train(marks: str, kill: bool, epochs: int = 4) -> int:
    """Small CNN on scikit-learn's digits; writes timestamps into the ``marks`` directory."""
    import signal

    import horovod.tensorflow as hvd
    import keras
    from sklearn.datasets import load_digits

    import mlflow_hvd
    from mlflow_hvd import keras as hk

    hvd.init()
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None][hvd.rank() :: hvd.size()][:880]
    y = digits.target[hvd.rank() :: hvd.size()][:880]
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(hk.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size())),
                  "sparse_categorical_crossentropy")
    initial_epoch = hk.restore_from_checkpoint(model)
    attempt = mlflow_hvd.attempt()

    class Marks(keras.callbacks.Callback):
        epoch = 0
        first = True

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.epoch = epoch

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self.first and hvd.rank() == 0:
                self.first = False
                with open(os.path.join(marks, f"first_step_{attempt}"), "w") as f:
                    json.dump({"t": time.time(), "epoch": self.epoch}, f)
            if kill and attempt == 0 and self.epoch == 2 and batch == 10 and hvd.rank() == 1:
                with open(os.path.join(marks, "death"), "w") as f:
                    json.dump({"t": time.time()}, f)
                os.kill(os.getpid(), signal.SIGKILL)

    model.fit(x, y, batch_size=32, epochs=epochs, initial_epoch=initial_epoch, verbose=0,
              callbacks=[hk.BroadcastGlobalVariablesCallback(0), hk.MetricAverageCallback(),
                         hk.MlflowCallback(checkpoint=True), Marks()])
    return initial_epoch


def read(path: str) -> dict[str, float]:
    with open(path) as f:
        return dict(json.load(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import mlflow
    from pyspark.sql import SparkSession

    from mlflow_hvd import HorovodRunner, JobConfig

    work = tempfile.mkdtemp(prefix="retry-bench-")
    mlflow.set_tracking_uri(f"sqlite:///{work}/mlflow.db")
    spark = (SparkSession.builder.master("local-cluster[2,1,1024]")
             .config("spark.task.maxFailures", "1")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    def recovery() -> float:
        marks = tempfile.mkdtemp(dir=work)
        resumed = HorovodRunner(np=2, spark=spark, job=JobConfig(max_failures=1, stop_grace=2)).run(
            train, marks=marks, kill=True)
        first = read(os.path.join(marks, "first_step_1"))
        assert resumed == 2 and first["epoch"] == 2, (resumed, first)
        return first["t"] - read(os.path.join(marks, "death"))["t"]

    def cold() -> float:
        marks = tempfile.mkdtemp(dir=work)
        t0 = time.time()
        assert HorovodRunner(np=2, spark=spark).run(train, marks=marks, kill=False) == 0
        return read(os.path.join(marks, "first_step_0"))["t"] - t0

    cold()  # warm-up: the session's executors and Python workers exist from here on
    times: dict[str, list[float]] = {"recovery": [], "cold": []}
    for _ in range(args.rounds):
        times["recovery"].append(recovery())
        times["cold"].append(cold())
    for arm, values in times.items():
        print(f"{arm:9s} min {min(values):6.2f}s  median {statistics.median(values):6.2f}s  "
              f"max {max(values):6.2f}s  ({', '.join(f'{v:.2f}' for v in values)})")
    ratio = statistics.median(times["recovery"]) / statistics.median(times["cold"])
    print(f"recovery / cold start (medians): {ratio:.2f}")
    spark.stop()


if __name__ == "__main__":
    main()

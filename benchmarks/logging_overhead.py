"""Cost of logging metrics every training step, against the same training without it.

Inside one HorovodRunner(np=-1) job tracked to a SQLite MLflow store, trains the digits CNN
with ``model.fit`` alternately (a) with ``MlflowCallback(log_every_n_steps=1)`` (five
metrics queued per step, sent in background batches) and (b) with
``MlflowCallback(log_every_n_steps=None)`` (per-epoch metrics only), and prints the median
fit time of each and the overhead. Goal: overhead <= 3%.

    .venv/bin/python benchmarks/logging_overhead.py [--repeats 5] [--epochs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import digits_keras


def measure(repeats: int, epochs: int, batch_size: int) -> dict[str, Any]:
    import time

    import horovod.tensorflow as hvd
    import keras

    from mlflow_hvd import keras as hvd_keras
    from mlflow_hvd import tracking

    hvd.init()
    x, y, _, _ = digits_keras.load_data()
    times: dict[str, list[float]] = {"per_step": [], "per_epoch": []}
    steps = 0
    for i in range(repeats + 1):  # the first round warms up tf.function tracing
        for mode in ("per_step", "per_epoch"):
            keras.utils.set_random_seed(i)
            model = digits_keras.build_model()
            opt = hvd_keras.DistributedOptimizer(keras.optimizers.Adam(1e-3))
            model.compile(optimizer=opt, loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"], jit_compile=False)
            cb = hvd_keras.MlflowCallback(
                checkpoint=False, log_every_n_steps=1 if mode == "per_step" else None
            )
            t0 = time.perf_counter()
            history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
                                callbacks=[cb])
            tracking.flush()  # the logged values are in the store before the clock stops
            if i:
                times[mode].append(time.perf_counter() - t0)
            steps = len(history.history["loss"]) * -(-len(x) // batch_size)
    return {"times": times, "steps_per_fit": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    import mlflow

    from mlflow_hvd import HorovodRunner

    with tempfile.TemporaryDirectory() as tmp:
        mlflow.set_tracking_uri(f"sqlite:///{tmp}/bench.db")
        runner = HorovodRunner(np=-1)
        out = runner.run(measure, repeats=args.repeats, epochs=args.epochs,
                         batch_size=args.batch_size)
        client = mlflow.MlflowClient()
        logged = len(client.get_metric_history(runner.last_run_id, "step_loss"))
    med = {k: statistics.median(v) for k, v in out["times"].items()}
    steps = out["steps_per_fit"]
    for mode, values in out["times"].items():
        runs = " ".join(f"{v:.3f}" for v in values)
        print(f"{mode:9s} median fit {med[mode]:.3f} s "
              f"({1000 * med[mode] / steps:.2f} ms/step)  runs: {runs}")
    overhead = med["per_step"] / med["per_epoch"] - 1
    print(f"step_loss values in the run: {logged} "
          f"(expected {steps * (args.repeats + 1)})")
    print(f"ratio per_step / per_epoch = {med['per_step'] / med['per_epoch']:.3f} "
          f"(overhead {100 * overhead:+.1f}%, goal <= +3%)")


if __name__ == "__main__":
    main()

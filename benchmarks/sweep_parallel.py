"""Sweep wall time at ``parallelism=2`` against ``parallelism=1``, on a cluster with room
for two trials.

Both arms run the same sweep: ``--trials`` trials of np=2 Spark ranks on one
``local-cluster[2,2,1024]`` session (4 task slots: two trials fit), the same seed and
space, warm ranks. The default trial does not compete for the machine's cores: each epoch
its ranks sleep ``--seconds`` and log a synthetic loss ((x - 0.3)^2 + 1/epoch), as ranks
waiting on GPUs or I/O would, so the arms differ only in how the sweep schedules trials.
``--digits`` runs the digits Keras example instead (1 epoch per trial), where two trials at
once share the same two cores. Rounds alternate the arms; prints min/median/max per arm,
the ratio of medians, whether both arms sampled the same points (TPE's random start, the
first 20), and each arm's best value.

    .venv/bin/python benchmarks/sweep_parallel.py [--rounds 3] [--trials 6] [--digits]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "examples"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the executors' Python: this one


def paced(x: float, epochs: int = 4, seconds: float = 1.0) -> float:
    """A trial whose cost is waiting: np ranks sleep per epoch, then log a synthetic loss."""
    import horovod.torch as hvd
    import torch

    from mlflow_hvd import tracking

    hvd.init()
    mean_x = float(hvd.allreduce(torch.tensor(float(x)), op=hvd.Average))
    loss = 0.0
    for epoch in range(epochs):
        time.sleep(seconds)
        loss = (mean_x - 0.3) ** 2 + 1.0 / (epoch + 1)
        tracking.log_metrics({"val_loss": loss}, step=epoch)
    return loss


def _stats(name: str, values: list[float]) -> str:
    return (f"{name:<16} min {min(values):7.2f}  median {statistics.median(values):7.2f}  "
            f"max {max(values):7.2f} s   (n={len(values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=1.0, help="sleep per epoch")
    parser.add_argument("--digits", action="store_true",
                        help="the digits Keras example instead of sleeping ranks")
    args = parser.parse_args()

    import mlflow
    from hyperopt import hp
    from pyspark.sql import SparkSession

    from mlflow_hvd.sweep import sweep

    tmp = tempfile.mkdtemp()
    mlflow.set_tracking_uri(f"sqlite:///{tmp}/bench.db")
    spark = (SparkSession.builder.master("local-cluster[2,2,1024]")
             .config("spark.ui.enabled", "false")
             .config("spark.executorEnv.TF_CPP_MIN_LOG_LEVEL", "2").getOrCreate())
    if args.digits:
        import digits_keras

        train: Any = digits_keras.train
        space = {"learning_rate": hp.loguniform("learning_rate", -8, -4)}
        fixed: dict[str, Any] = {"epochs": 1, "log_model": False}
    else:
        train = paced
        space = {"x": hp.uniform("x", 0.0, 1.0)}
        fixed = {"epochs": args.epochs, "seconds": args.seconds}
    walls: dict[int, list[float]] = {1: [], 2: []}
    best: dict[int, list[float]] = {1: [], 2: []}
    points: dict[int, list[list[str]]] = {1: [], 2: []}
    client = mlflow.MlflowClient()
    for r in range(args.rounds):
        for k in ((1, 2) if r % 2 == 0 else (2, 1)):
            t0 = time.monotonic()
            result = sweep(train, space, max_evals=args.trials, np=2, seed=r, parallelism=k,
                           fixed_params=fixed, spark=spark)
            walls[k].append(time.monotonic() - t0)
            best[k].append(result.best_loss)
            children = client.search_runs(
                [client.get_run(result.parent_run_id).info.experiment_id],
                f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
            children.sort(key=lambda c: int(c.data.tags["mlflow_hvd.sweep.trial"]))
            points[k].append([sorted(c.data.params.items()).__repr__() for c in children])
            print(f"round {r} parallelism={k}: {walls[k][-1]:.2f} s, best {result.best_loss:.4f}",
                  flush=True)
    what = "digits (1 epoch)" if args.digits else f"{args.epochs} x {args.seconds:g} s sleep"
    print(f"\n{args.trials} trials of np=2, {what}, local-cluster[2,2,1024], "
          f"{args.rounds} rounds")
    print(_stats("parallelism=1", walls[1]))
    print(_stats("parallelism=2", walls[2]))
    ratios = [b / a for a, b in zip(walls[1], walls[2], strict=True)]
    print(f"wall ratio 2/1: {statistics.median(walls[2]) / statistics.median(walls[1]):.2f} "
          f"(per seed: min {min(ratios):.2f}, max {max(ratios):.2f})")
    same = all(a == b for a, b in zip(points[1], points[2], strict=True))
    print(f"same points sampled by both arms, every seed: {same}")
    for k in (1, 2):
        print(f"best (per seed) at parallelism={k}: "
              + ", ".join(f"{v:.4f}" for v in best[k]))


if __name__ == "__main__":
    main()

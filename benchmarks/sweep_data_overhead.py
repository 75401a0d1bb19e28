"""What a DataFrame argument costs a sweep's trials on warm ranks: the same sweep with and
without ``fixed_params={"data": df}``.

Each trial (np=2 Spark ranks on ``local[2]``) initialises Horovod, reads ``data.rows`` if
it has data (nothing else: the feed is what is measured) and logs ``val_loss``. With data,
the warm ranks are fed once, when the first trial starts them; every later trial reuses the
shards. Per trial: the ``trial_wall_seconds`` the sweep logs. Reported apart: the first
trial (ranks started, and fed) and the later ones (warm). Rounds alternate the arms; prints
min/median/max per arm and the ratio of medians.

    .venv/bin/python benchmarks/sweep_data_overhead.py [--rows 1000000] [--rounds 3] [--trials 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def trial(lr: float, data: Any = None) -> float:
    import horovod.tensorflow as hvd

    from mlflow_hvd import tracking

    hvd.init()
    rows = data.rows if data is not None else 0
    loss = (lr - 0.3) ** 2 + 0.0 * rows
    tracking.log_metrics({"val_loss": loss}, step=0)
    return loss


def one_sweep(spark: Any, trials: int, data: Any) -> list[float]:
    import mlflow
    from hyperopt import hp

    from mlflow_hvd.sweep import sweep

    fixed = {"data": data} if data is not None else {}
    result = sweep(trial, {"lr": hp.uniform("lr", 0.0, 1.0)}, max_evals=trials, np=2,
                   fixed_params=fixed, spark=spark)
    client = mlflow.MlflowClient()
    runs = client.search_runs([client.get_run(result.parent_run_id).info.experiment_id],
                              f"tags.mlflow.parentRunId = '{result.parent_run_id}'",
                              order_by=["attributes.start_time ASC"])
    return [r.data.metrics["trial_wall_seconds"] for r in runs]


def _line(name: str, values: list[float]) -> str:
    return (f"  {name:<30} min {min(values):6.2f}  median {statistics.median(values):6.2f}  "
            f"max {max(values):6.2f} s (n={len(values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=4)
    args = parser.parse_args()

    import mlflow
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    mlflow.set_tracking_uri(f"sqlite:///{tempfile.mkdtemp()}/bench.db")
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    df = spark.range(0, args.rows, 1, 8).select(
        F.array(*[F.rand(seed=i).cast("float") for i in range(64)]).alias("x"),
        (F.col("id") % 10).cast("int").alias("label"))
    walls: dict[str, list[list[float]]] = {"with data": [], "without data": []}
    for r in range(args.rounds):
        walls["with data"].append(one_sweep(spark, args.trials, df))
        walls["without data"].append(one_sweep(spark, args.trials, None))
        print(f"round {r + 1}: " + "; ".join(f"{k} {v[-1]}" for k, v in walls.items()),
              flush=True)
    print(f"\n{args.trials}-trial sweeps, np=2 on local[2], {args.rows:,} rows x float[64] + "
          f"label, {args.rounds} alternated rounds (trial_wall_seconds)")
    for kind, pick in (("first trial", lambda w: w[:1]), ("later trials", lambda w: w[1:])):
        print(kind + ":")
        for arm, rounds in walls.items():
            print(_line(arm, [x for w in rounds for x in pick(w)]))
        with_data = statistics.median(x for w in walls["with data"] for x in pick(w))
        without = statistics.median(x for w in walls["without data"] for x in pick(w))
        print(f"  with / without = {with_data / without:.2f} (+{with_data - without:.2f} s)")
    spark.stop()


if __name__ == "__main__":
    main()

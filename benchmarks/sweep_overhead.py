"""Per-trial overhead of mlflow_hvd.sweep (warm ranks) vs one ``mlflow run`` per trial.

Both arms run the same trial: the digits example, np=2 Spark ranks, 1 epoch, the same
params, the final model logged (``log_model`` as ``examples/sweep.py`` and the ``main``
entry point do).

* mlflow_hvd: ``sweep(...)`` of ``--trials`` trials in this process, on one SparkSession,
  each a nested MLflow run; the trials share one warm set of ranks. Its first trial
  starts the ranks (reported apart as "first"), the others reuse them ("warm").
* peer: one ``mlflow.projects.run(".", "main", env_manager="local")`` per trial, MLflow's
  ``examples/hyperparam`` pattern (each trial starts Python, Spark and MLflow anew).

Per-trial overhead = trial wall time - ``fit_evaluate_seconds`` (the time rank 0 spends in
``model.fit`` and ``model.evaluate``, logged by the example). A sweep trial's wall runs from
its child run's start to the next trial's (the last trial of a sweep, which has no next,
is not counted); a peer trial's is the whole ``mlflow.projects.run`` call. Rounds alternate the arms
(one sweep, then as many peer trials); prints min/median/max per arm and the ratio of
medians.

    .venv/bin/python benchmarks/sweep_overhead.py [--rounds 3] [--trials 5]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "examples"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]


def _stats(name: str, values: list[float]) -> str:
    return (f"{name:<28} min {min(values):6.2f}  median {statistics.median(values):6.2f}  "
            f"max {max(values):6.2f} s   (n={len(values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=5,
                        help="trials per round and arm (a sweep's last one is not timed)")
    args = parser.parse_args()

    import digits_keras
    import mlflow
    from hyperopt import hp
    from pyspark.sql import SparkSession

    from mlflow_hvd.sweep import sweep

    tmp = tempfile.mkdtemp()
    mlflow.set_tracking_uri(f"sqlite:///{tmp}/bench.db")
    os.environ["MLFLOW_TRACKING_URI"] = mlflow.get_tracking_uri()
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    client = mlflow.MlflowClient()
    space = {"learning_rate": hp.choice("learning_rate", [0.001])}
    fixed = {"epochs": 1}

    def our_round() -> tuple[list[float], list[float], list[float]]:
        result = sweep(digits_keras.train, space, max_evals=args.trials, np=2,
                       fixed_params=fixed)
        runs = client.search_runs(
            [client.get_run(result.parent_run_id).info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'",
        )
        runs.sort(key=lambda r: int(r.data.tags["mlflow_hvd.sweep.trial"]))
        # a trial's wall: from its child run's start to the next one's, so the sweep's own
        # bookkeeping (hyperopt, the child run, saving the trials) counts as overhead
        starts = [r.info.start_time / 1000 for r in runs]
        walls = [b - a for a, b in itertools.pairwise(starts)]
        overheads = [w - r.data.metrics["fit_evaluate_seconds"]
                     for w, r in zip(walls, runs, strict=False)]
        return overheads[:1], overheads[1:], walls[1:]

    def peer_round() -> tuple[list[float], list[float]]:
        overheads, walls = [], []
        for _ in range(args.trials):
            t0 = time.monotonic()
            submitted = mlflow.projects.run(
                REPO, "main", env_manager="local", synchronous=True,
                parameters={"np": 2, "epochs": 1, "learning_rate": 0.001},
            )
            wall = time.monotonic() - t0
            fit = client.get_run(submitted.run_id).data.metrics["fit_evaluate_seconds"]
            overheads.append(wall - fit)
            walls.append(wall)
        return overheads, walls

    our_round()  # warm-up: the SparkSession and the OS caches, for both arms
    first: list[float] = []
    warm: list[float] = []
    warm_wall: list[float] = []
    peer: list[float] = []
    peer_wall: list[float] = []
    for _ in range(args.rounds):
        f, w, ww = our_round()
        first += f
        warm += w
        warm_wall += ww
        p, pw = peer_round()
        peer += p
        peer_wall += pw

    print(f"per-trial overhead = trial wall - fit_evaluate_seconds; np=2, 1 epoch, model "
          f"logged; {args.rounds} alternated rounds of {args.trials} trials per arm")
    print(_stats("mlflow_hvd sweep, warm", warm))
    print(_stats("mlflow_hvd sweep, 1st trial", first))
    print(_stats("mlflow run per trial", peer))
    print(_stats("wall: sweep, warm trial", warm_wall))
    print(_stats("wall: mlflow run per trial", peer_wall))
    print(f"ratio of median overheads warm / peer = "
          f"{statistics.median(warm) / statistics.median(peer):.3f}; "
          f"speed-up of median trial wall = "
          f"{statistics.median(peer_wall) / statistics.median(warm_wall):.1f}x "
          "(goals: warm overhead <= 1.5 s; >= 5x)")
    spark.stop()


if __name__ == "__main__":
    main()

"""Per-trial overhead of mlflow_hvd.sweep vs MLflow's examples/hyperparam pattern.

Both run the same trials (the digits example, np=2 Spark ranks, 1 epoch, fixed params):

* mlflow_hvd: ``sweep(...)`` - trials one after another in this process, on one warm
  SparkSession, each a nested MLflow run;
* peer: one ``mlflow.projects.run(".", "main", env_manager="local")`` subprocess per
  trial, as MLflow's examples/hyperparam does (each starts Python, Spark and MLflow anew).

Overhead = trial wall time - training time, where training time is the ``train_seconds``
metric that the training function logs (from entering ``train`` on rank 0 to its end, TF
import included). Prints medians and the ratio.

    .venv/bin/python benchmarks/sweep_overhead.py [--trials 3]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=3)
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

    # warm-up: one trial, so both sides start with the session and caches warm
    space = {"learning_rate": hp.choice("learning_rate", [0.001])}
    fixed = {"epochs": 1, "log_model": False}
    sweep(digits_keras.train, space, max_evals=1, np=2, fixed_params=fixed)

    result = sweep(digits_keras.train, space, max_evals=args.trials, np=2, fixed_params=fixed)
    ours = []
    for run in mlflow.search_runs(
        search_all_experiments=True, output_format="list",
        filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'",
    ):
        ours.append(run.data.metrics["trial_wall_seconds"] - run.data.metrics["train_seconds"])

    peer = []
    for _ in range(args.trials):
        t0 = time.monotonic()
        submitted = mlflow.projects.run(
            REPO, "main", env_manager="local", synchronous=True,
            parameters={"np": 2, "epochs": 1, "learning_rate": 0.001},
        )
        wall = time.monotonic() - t0
        train = client.get_run(submitted.run_id).data.metrics["train_seconds"]
        peer.append(wall - train)

    m_ours, m_peer = statistics.median(ours), statistics.median(peer)
    print("per-trial overhead = trial wall time - train_seconds (median of "
          f"{args.trials} trials, np=2)")
    print(f"mlflow_hvd.sweep        {m_ours:6.2f} s   " + " ".join(f"{v:.2f}" for v in ours))
    print(f"mlflow run per trial    {m_peer:6.2f} s   " + " ".join(f"{v:.2f}" for v in peer))
    print(f"ratio mlflow_hvd / peer = {m_ours / m_peer:.2f} (goal: mlflow_hvd <= 3 s)")
    spark.stop()


if __name__ == "__main__":
    main()

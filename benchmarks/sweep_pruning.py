"""Pruning a sweep: the same digits sweep with ``prune="median"`` / ``"asha"`` against
``prune=None``, and what pruning costs per epoch.

Sweep arms: ``sweep(digits_keras.train, space, max_evals=--trials, np=--np,
fixed_params={"epochs": --epochs, "log_model": False}, seed=s)`` for each seed, the arms run
one after another with the seed's order rotated; the space is the MLproject's (learning
rate log-uniform e^-8..e^-4, batch size 16/32/64). Per arm and seed: the best val_loss of
the sweep (of trials that trained to their end), the test_loss of that trial's model (the
example's held-out test split, never used for selection), epochs trained (val_loss values
logged in the child runs), sweep wall time. Prints min/median/max over seeds per arm, and
per seed the pruned arm's ratio to the unpruned arm of the same seed.

Cost arm: one job of ``--cost-epochs`` empty epochs (rank 0 logs val_loss, every rank
calls ``should_prune``, an allreduce ends each epoch) with a judge that never prunes,
against the same job without pruning (``should_prune`` returns at once): the difference
per epoch is the report to the driver plus the broadcast of its answer. Rounds alternate.

    .venv/bin/python benchmarks/sweep_pruning.py [--seeds 5] [--trials 16] [--epochs 24]
        [--rules median,asha,asha:2]

(the defaults are docs/benchmarks.md's figures: about 40 minutes on a 2-core machine)
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


def _mmm(values: list[float], fmt: str = "{:.4f}") -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(lo)} / {fmt.format(mid)} / {fmt.format(hi)}"


def empty_epochs(epochs: int) -> float:
    """Rank 0's seconds per epoch of a loop that only logs, asks and allreduces."""
    import horovod.torch as hvd
    import torch

    from mlflow_hvd import tracking

    hvd.init()
    hvd.allreduce(torch.ones(1), name="warmup")
    t0 = time.perf_counter()
    for epoch in range(epochs):
        hvd.allreduce(torch.ones(1), name="epoch")
        tracking.log_metrics({"val_loss": 1.0 / (epoch + 1)}, step=epoch)
        if tracking.should_prune():
            break
    return (time.perf_counter() - t0) / epochs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rules", default="median,asha,asha:2",
                        help="pruned arms, comma-separated: median or asha, each with an "
                        "optional :grace_epochs (asha:2)")
    parser.add_argument("--cost-epochs", type=int, default=200)
    parser.add_argument("--cost-rounds", type=int, default=5)
    args = parser.parse_args()

    import digits_keras
    import mlflow
    from hyperopt import hp
    from pyspark.sql import SparkSession

    from mlflow_hvd import HorovodRunner
    from mlflow_hvd.runner import RunHooks
    from mlflow_hvd.sweep import sweep
    from mlflow_hvd.sweep.pruning import History, MedianRule, TrialJudge

    tmp = tempfile.mkdtemp()
    mlflow.set_tracking_uri(f"sqlite:///{tmp}/bench.db")
    os.environ["MLFLOW_TRACKING_URI"] = mlflow.get_tracking_uri()
    spark = None
    if args.np > 0:
        spark = SparkSession.builder.master(f"local[{args.np}]").getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
    client = mlflow.MlflowClient()
    space = {
        "learning_rate": hp.loguniform("learning_rate", -8.0, -4.0),
        "batch_size": hp.choice("batch_size", [16, 32, 64]),
    }
    fixed = {"epochs": args.epochs, "log_model": False}
    arms = ["none", *[r for r in args.rules.split(",") if r]]

    # --- what pruning costs per epoch -----------------------------------------------------
    on: list[float] = []
    off: list[float] = []
    with HorovodRunner(np=args.np, spark=spark) as runner:
        runner.run(empty_epochs, epochs=args.cost_epochs)  # warm-up: first-job costs
        for _ in range(args.cost_rounds):
            for judged in (True, False):
                judge = (TrialJudge(MedianRule(grace_epochs=10**9), History(), "val_loss",
                                    1.0, None) if judged else None)
                per_epoch = runner.run_with(RunHooks(epoch_judge=judge), empty_epochs,
                                            epochs=args.cost_epochs)
                (on if judged else off).append(per_epoch * 1000)
    print(f"per-epoch cost, {args.cost_rounds} alternated rounds of {args.cost_epochs} empty "
          f"epochs on np={args.np} (min / median / max, ms):")
    print(f"  judged (report + broadcast):  {_mmm(on, '{:.2f}')}")
    print(f"  not judged:                   {_mmm(off, '{:.2f}')}")
    print(f"  cost of pruning per epoch:    {statistics.median(on) - statistics.median(off):.2f}"
          " ms (difference of medians)")

    if args.seeds < 1:
        return
    # --- pruned against unpruned sweeps ------------------------------------------------------
    # warm-up: the OS caches and the first TensorFlow import, for every arm alike
    sweep(digits_keras.train, space, max_evals=1, np=args.np, fixed_params={**fixed, "epochs": 1},
          spark=spark)
    best: dict[str, list[float]] = {a: [] for a in arms}
    test: dict[str, list[float]] = {a: [] for a in arms}
    epochs: dict[str, list[float]] = {a: [] for a in arms}
    walls: dict[str, list[float]] = {a: [] for a in arms}
    pruned: dict[str, list[float]] = {a: [] for a in arms}
    for seed in range(args.seeds):
        order = arms[seed % len(arms):] + arms[:seed % len(arms)]
        for arm in order:
            t0 = time.monotonic()
            rule, _, grace = arm.partition(":")
            result = sweep(digits_keras.train, space, max_evals=args.trials, np=args.np,
                           seed=seed, fixed_params=fixed, spark=spark,
                           prune=None if arm == "none" else rule, grace_epochs=int(grace or 1))
            walls[arm].append(time.monotonic() - t0)
            children = client.search_runs(
                [client.get_run(result.parent_run_id).info.experiment_id],
                filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'",
                max_results=1000)
            epochs[arm].append(float(sum(
                len(client.get_metric_history(c.info.run_id, "val_loss")) for c in children)))
            best[arm].append(result.best_loss)
            test[arm].append(client.get_run(result.best_run_id).data.metrics["test_loss"])
            pruned[arm].append(float(result.pruned_trials))
            print(f"seed {seed} {arm:>8}: best val_loss {result.best_loss:.4f} (its test_loss "
                  f"{test[arm][-1]:.4f}), "
                  f"{epochs[arm][-1]:.0f} epochs, {result.pruned_trials} pruned, "
                  f"{walls[arm][-1]:.1f} s", flush=True)

    print(f"\n{args.trials} trials x {args.epochs} epochs, np={args.np}, seeds "
          f"0..{args.seeds - 1} (min / median / max over seeds)")
    for arm in arms:
        print(f"{arm:>8}: best val_loss {_mmm(best[arm])}   its test_loss {_mmm(test[arm])}   "
              f"epochs "
              f"{_mmm(epochs[arm], '{:.0f}')}   wall {_mmm(walls[arm], '{:.1f}')} s   pruned "
              f"{_mmm(pruned[arm], '{:.0f}')}")
    for arm in arms[1:]:
        e = [a / b for a, b in zip(epochs[arm], epochs["none"], strict=True)]
        w = [a / b for a, b in zip(walls[arm], walls["none"], strict=True)]
        print(f"{arm:>8} / none, per seed: epochs {_mmm(e, '{:.2f}')}   wall "
              f"{_mmm(w, '{:.2f}')}")
        for name, values in (("best val_loss", best), ("its test_loss", test)):
            lo, hi = min(values["none"]), max(values["none"])
            mid = statistics.median(values[arm])
            where = ("within" if lo <= mid <= hi else
                     "below (better than)" if mid < lo else "ABOVE (worse than)")
            print(f"        median {name} {mid:.4f}: {where} the unpruned spread "
                  f"[{lo:.4f}, {hi:.4f}]")
    print("goals: epochs and wall <= 0.50x; best val_loss within the unpruned arm's spread")
    if spark is not None:
        spark.stop()


if __name__ == "__main__":
    main()

"""Entry point of the MLproject ``sweep``: a Hyperopt search over the digits example.

    python examples/sweep.py --max-evals 8 --np 2 [--space space.json] [--epochs 3]

Every trial is a distributed HorovodRunner run and a nested MLflow run under the sweep's
run. ``--space`` is a JSON file like ``{"learning_rate": ["loguniform", -7, -3],
"batch_size": ["choice", [16, 32, 64]]}``; the default searches learning rate and batch
size. ``--parent-run-id`` resumes an interrupted sweep (under ``mlflow run`` the sweep
resumes its own run when restarted with ``--run-id``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from train import whole_number

DEFAULT_SPACE = {
    "learning_rate": ["loguniform", -8.0, -4.0],
    "batch_size": ["choice", [16, 32, 64]],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-evals", type=whole_number, default=8)
    p.add_argument("--np", type=whole_number, default=2)
    p.add_argument("--epochs", type=whole_number, default=3)
    p.add_argument("--space", default="default",
                   help="JSON file with the search space, or 'default'")
    p.add_argument("--metric", default="val_loss")
    p.add_argument("--seed", type=whole_number, default=0)
    p.add_argument("--early-stop-rounds", type=whole_number, default=0,
                   help="stop after N trials without a new best (0: never)")
    p.add_argument("--parent-run-id", default="")
    args = p.parse_args(argv)

    from mlflow_hvd.errors import ConfigurationError
    from mlflow_hvd.sweep import space_from_json, sweep

    try:
        if args.np == 0:
            raise ConfigurationError("np=0: use np=N (>0) Spark tasks or np=-N local processes")
        if args.epochs < 1:
            raise ConfigurationError(f"epochs={args.epochs}: must be at least 1")
        spec = DEFAULT_SPACE
        if args.space and args.space != "default":
            with open(args.space) as f:
                spec = json.load(f)
        space = space_from_json(spec)
    except (ConfigurationError, OSError, json.JSONDecodeError) as exc:
        print(f"invalid sweep parameters: {exc}", file=sys.stderr)
        return 2

    import digits_keras
    import mlflow

    if "MLFLOW_TRACKING_URI" not in os.environ:
        mlflow.set_tracking_uri("sqlite:///mlflow.db")
    result = sweep(
        digits_keras.train,
        space,
        max_evals=args.max_evals,
        np=args.np,
        metric=args.metric,
        seed=args.seed,
        early_stop_rounds=args.early_stop_rounds or None,
        parent_run_id=args.parent_run_id or None,
        fixed_params={"epochs": args.epochs},
    )
    print(f"\nsweep run {result.parent_run_id}: {result.trials} trials "
          f"({result.failed_trials} failed); best {args.metric} {result.best_loss:.4f} with "
          f"{result.best_params} (run {result.best_run_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

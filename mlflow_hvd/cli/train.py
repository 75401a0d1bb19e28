"""Entry point of the MLproject ``main`` and of ``make demo``: one distributed training run.

    python -m mlflow_hvd.cli.train --np 2 --epochs 5 [--train examples/digits_keras.py:train]

Validates every parameter before any Spark job starts, runs the training function on ``np``
ranks with HorovodRunner, and prints where the MLflow run is. Without MLFLOW_TRACKING_URI
it logs to ``sqlite:///mlflow.db`` in the current directory. The training function gets
``epochs``, ``batch_size``, ``learning_rate``, ``seed``, ``data`` and ``run_params`` (the
parameters to log) as keyword arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from mlflow_hvd.cli.common import (
    DEFAULT_TRAIN,
    add_runner_options,
    exit_now,
    exit_status,
    load_function,
    prepare_environment,
    runner_options,
    use_default_store,
    whole_number,
)
from mlflow_hvd.common.options import check_np
from mlflow_hvd.errors import ConfigurationError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--np",
        type=whole_number,
        default=2,
        help="ranks: N>0 Spark barrier tasks, -N local processes (default 2)",
    )
    p.add_argument("--epochs", type=whole_number, default=5)
    p.add_argument("--batch-size", type=whole_number, default=32, help="per rank")
    p.add_argument(
        "--learning-rate",
        type=float,
        default=0.001,
        help="single-process learning rate; scaled by np inside",
    )
    p.add_argument(
        "--data",
        default="digits",
        help="'digits' (scikit-learn's bundled set) or a Parquet dataset directory",
    )
    p.add_argument("--seed", type=whole_number, default=0)
    add_runner_options(p)
    p.add_argument(
        "--train",
        default=DEFAULT_TRAIN,
        help=f"training function, 'file.py:function' or 'module:function' "
        f"(default {DEFAULT_TRAIN})",
    )
    return p.parse_args(argv)


def validate(args: argparse.Namespace) -> list[str]:
    """Every problem with the parameters, each naming the parameter and what to do."""
    problems = []
    try:
        check_np(args.np)
    except ConfigurationError as exc:
        problems.append(str(exc))
    if args.epochs < 1:
        problems.append(f"epochs={args.epochs}: must be at least 1")
    if args.batch_size < 1:
        problems.append(f"batch_size={args.batch_size}: must be at least 1")
    if args.log_every_n_steps < 0:
        problems.append(f"log_every_n_steps={args.log_every_n_steps}: must be 0 (off) or more")
    if args.max_failures < 0:
        problems.append(f"max_failures={args.max_failures}: must be 0 (no restart) or more")
    if not args.learning_rate > 0:
        problems.append(f"learning_rate={args.learning_rate}: must be a positive number")
    if args.data != "digits" and not os.path.exists(args.data):
        problems.append(
            f"data={args.data!r}: no such file or directory; pass 'digits' or the "
            "path of a Parquet dataset"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problems = validate(args)
    try:
        train = load_function(args.train)
    except ConfigurationError as exc:
        problems.append(str(exc))
    if problems:
        print("invalid parameters:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    prepare_environment()
    from mlflow_hvd import HorovodRunner

    t0 = time.monotonic()
    runner = HorovodRunner(np=args.np, **runner_options(args))
    runner.prepare()  # Spark's JVM boots while MLflow is imported and the run set up
    uri = use_default_store()
    data = args.data if args.data == "digits" else os.path.abspath(args.data)
    params = {
        "np": args.np,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "data": args.data,
        "seed": args.seed,
    }
    result = runner.run(
        train,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        data=data,
        **({"log_every_n_steps": args.log_every_n_steps} if args.log_every_n_steps else {}),
        run_params=params,
    )
    elapsed = time.monotonic() - t0
    print(
        f"\nrun {runner.last_run_id} finished in {elapsed:.0f}s: "
        f"test accuracy {result['test_accuracy']:.3f}, test loss {result['test_loss']:.3f}"
    )
    print(f"tracking store: {uri}")
    print(f"open the UI with:  mlflow ui --backend-store-uri {uri}")
    return 0


if __name__ == "__main__":
    exit_now(exit_status(main))

"""Entry point of the MLproject ``main`` and of ``make demo``: one distributed training run.

    python -m mlflow_hvd.cli.train --np 2 --epochs 5 [--train examples/digits_keras.py:train]

Validates every parameter before any Spark job starts, runs the training function on ``np``
ranks with HorovodRunner, and prints where the MLflow run is. Without MLFLOW_TRACKING_URI
it logs to ``sqlite:///mlflow.db`` in the current directory. The training function gets
``epochs``, ``batch_size``, ``learning_rate``, ``seed``, ``data`` and ``run_params`` (the
parameters to log) as keyword arguments.

``--data`` other than ``digits`` is read with Spark: a Parquet directory or file, a Delta
table's directory, or a table name. 85% of its rows (``randomSplit``, seeded) go to the
training function as ``data``, 15% as ``val`` (when the function takes ``val``): each a
DataFrame that arrives on every rank as that rank's own shard.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

from mlflow_hvd.cli.common import (
    DEFAULT_TRAIN,
    add_runner_options,
    complete_environment,
    exit_now,
    exit_status,
    load_function,
    prepare_environment,
    runner_options,
    ship_choice,
    use_default_store,
    whole_number,
)
from mlflow_hvd.common.options import check_np
from mlflow_hvd.errors import ConfigurationError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mlflow_hvd.cli.train`` (``mlflow run .``)."""
    p = argparse.ArgumentParser(prog="python -m mlflow_hvd.cli.train", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--np",
        type=whole_number,
        default=2,
        help="ranks: N>0 Spark barrier tasks, -N local processes (default 2)",
    )
    p.add_argument("--epochs", type=whole_number, default=5,
                   help="passes over the training data (default 5)")
    p.add_argument("--batch-size", type=whole_number, default=32,
                   help="examples per rank per step (default 32)")
    p.add_argument(
        "--learning-rate",
        type=float,
        default=0.001,
        help="single-process learning rate; scaled by np inside",
    )
    p.add_argument(
        "--data",
        default="digits",
        help="'digits' (scikit-learn's bundled set), or read with Spark: a Parquet or Delta "
        "path, or a table name",
    )
    p.add_argument("--seed", type=whole_number, default=0,
                   help="seed of the data split and the model's initial weights (default 0)")
    add_runner_options(p)
    p.add_argument(
        "--train",
        default=DEFAULT_TRAIN,
        help=f"training function, 'file.py:function' or 'module:function' "
        f"(default {DEFAULT_TRAIN})",
    )
    return p


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
    try:
        ship_choice(args.ship_environment)
    except ConfigurationError as exc:
        problems.append(f"ship_environment={args.ship_environment!r}: {exc}")
    if args.data != "digits" and not os.path.exists(args.data) and (
            os.sep in args.data or "://" in args.data):
        problems.append(
            f"data={args.data!r}: no such file or directory; pass 'digits', the path of a "
            "Parquet or Delta data set, or a table name"
        )
    return problems


def read_frames(args: argparse.Namespace, train: Any) -> tuple[dict[str, Any], Any]:
    """``--data`` read with Spark, split 85/15 into ``data`` and ``val`` (``val`` only for a
    training function that takes it), and the session it was read on.

    Raises:
        ConfigurationError: Nothing can be read at that path, or no such table.
    """
    import inspect

    from mlflow_hvd.backends.spark.boot import SessionBoot

    options = runner_options(args)
    # the session the job will run on, shipping the environment as the runner would
    cluster = options.cluster if args.np > 0 else dataclasses.replace(
        options.cluster, ship_environment=False)
    boot = SessionBoot(max(args.np, 1), cluster, options.job.slot_timeout)
    spark = boot.session(timeout=120.0)
    source = args.data
    try:
        if os.path.exists(source):
            path = os.path.abspath(source)
            delta = os.path.isdir(os.path.join(path, "_delta_log"))
            frame = spark.read.format("delta" if delta else "parquet").load(path)
        else:
            frame = spark.table(source)
    except Exception as exc:
        raise ConfigurationError(
            f"data={source!r}: Spark cannot read it ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}); pass 'digits', a Parquet or Delta path, or the "
            "name of a table in the session's catalog") from exc
    parameters = inspect.signature(train).parameters
    if "val" not in parameters and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return {"data": frame}, spark
    data, val = frame.randomSplit([0.85, 0.15], seed=args.seed)
    return {"data": data, "val": val}, spark


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
    status = complete_environment()
    if status:
        return status
    prepare_environment()
    from mlflow_hvd import HorovodRunner

    t0 = time.monotonic()
    frames: dict[str, Any] = {}
    options = runner_options(args)
    spark = None
    if args.data != "digits":  # a DataFrame: each rank gets its own partition of it
        frames, session = read_frames(args, train)
        spark = session if args.np > 0 else None
    runner = HorovodRunner(np=args.np, spark=spark, job=options.job, cluster=options.cluster)
    runner.prepare()  # Spark's JVM boots while MLflow is imported and the run set up
    uri = use_default_store()
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
        **(frames or {"data": args.data}),
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

"""Entry point of the MLproject ``sweep``: a Hyperopt search over a training function.

    python -m mlflow_hvd.cli.sweep --max-evals 8 --np 2 [--space space.json] [--epochs 3]

Every trial is a distributed HorovodRunner run and a nested MLflow run under the sweep's
run. ``--space`` is a JSON file like ``{"learning_rate": ["loguniform", -7, -3],
"batch_size": ["choice", [16, 32, 64]]}``; the default searches learning rate and batch
size. ``--parent-run-id`` resumes an interrupted sweep (under ``mlflow run`` the sweep
resumes its own run when restarted with ``--run-id``).
"""

from __future__ import annotations

import argparse
import json
import sys

from mlflow_hvd.cli.common import (
    DEFAULT_TRAIN,
    add_runner_options,
    complete_environment,
    exit_now,
    exit_status,
    load_function,
    prepare_environment,
    runner_options,
    use_default_store,
    whole_number,
)
from mlflow_hvd.common.options import check_np, check_positive_int
from mlflow_hvd.errors import ConfigurationError

DEFAULT_SPACE = {
    "learning_rate": ["loguniform", -8.0, -4.0],
    "batch_size": ["choice", [16, 32, 64]],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mlflow_hvd.cli.sweep`` (``mlflow run . -e sweep``)."""
    p = argparse.ArgumentParser(prog="python -m mlflow_hvd.cli.sweep", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-evals", type=whole_number, default=8,
                   help="trials to run (default 8)")
    p.add_argument("--np", type=whole_number, default=2,
                   help="ranks of each trial: N>0 Spark barrier tasks, -N local processes "
                        "(default 2)")
    p.add_argument("--epochs", type=whole_number, default=3,
                   help="epochs of each trial (default 3)")
    p.add_argument(
        "--space", default="default", help="JSON file with the search space, or 'default'"
    )
    p.add_argument("--metric", default="val_loss",
                   help="the metric trials are compared by, as the training function logs "
                        "it (default val_loss)")
    p.add_argument(
        "--mode",
        choices=("auto", "min", "max"),
        default="auto",
        help="minimise or maximise the metric; 'auto': 'max' for accuracy-like names",
    )
    p.add_argument(
        "--prune",
        choices=("none", "median", "asha"),
        default="none",
        help="stop losing trials at an epoch boundary: median stopping or successive halving",
    )
    p.add_argument(
        "--grace-epochs",
        type=whole_number,
        default=1,
        help="epochs every trial trains before it can be pruned",
    )
    p.add_argument("--seed", type=whole_number, default=0,
                   help="seed of the search (TPE) and of every trial (default 0)")
    p.add_argument(
        "--early-stop-rounds",
        type=whole_number,
        default=0,
        help="stop after N trials without a new best (0: never)",
    )
    p.add_argument("--parent-run-id", default="",
                   help="the sweep's parent run ('': the active run, as mlflow run sets "
                        "it, else a new one)")
    p.add_argument(
        "--warm",
        choices=("true", "false"),
        default="true",
        help="trials share one set of ranks (default); 'false': fresh processes per trial",
    )
    p.add_argument(
        "--parallelism",
        default="1",
        help="trials at once, each its own barrier stage on its own warm ranks (default 1); "
             "'auto': as many as the cluster's task slots hold (slots // np)",
    )
    p.add_argument(
        "--register-model",
        default="",
        help="register the best trial's model as a new version of this registered model, "
             "alias 'champion' ('': do not register)",
    )
    add_runner_options(p)
    p.add_argument(
        "--train",
        default=DEFAULT_TRAIN,
        help="training function, 'file.py:function' or 'module:function'",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mlflow_hvd.sweep import space_from_json, sweep

    try:
        check_np(args.np)
        check_positive_int("epochs", args.epochs)
        check_positive_int("grace_epochs", args.grace_epochs)
        spec = DEFAULT_SPACE
        if args.space and args.space != "default":
            with open(args.space) as f:
                spec = json.load(f)
        space = space_from_json(spec)
        train = load_function(args.train)
        options = runner_options(args)
        parallelism = parallelism_choice(args.parallelism)
    except (ConfigurationError, OSError, json.JSONDecodeError) as exc:
        print(f"invalid sweep parameters: {exc}", file=sys.stderr)
        return 2
    status = complete_environment()
    if status:
        return status
    prepare_environment()
    use_default_store()
    result = sweep(
        train,
        space,
        max_evals=args.max_evals,
        np=args.np,
        metric=args.metric,
        seed=args.seed,
        early_stop_rounds=args.early_stop_rounds or None,
        parent_run_id=args.parent_run_id or None,
        fixed_params={
            "epochs": args.epochs,
            **({"log_every_n_steps": args.log_every_n_steps} if args.log_every_n_steps else {}),
        },
        job=options.job,
        cluster=options.cluster,
        warm=args.warm == "true",
        prune=None if args.prune == "none" else args.prune,
        grace_epochs=args.grace_epochs,
        mode=None if args.mode == "auto" else args.mode,
        register_model=args.register_model or None,
        parallelism=parallelism,
    )
    pruned = (f"; {result.pruned_trials} pruned, {result.epochs_trained} epochs trained, "
              f"{result.epochs_saved} saved" if args.prune != "none" else "")
    print(
        f"\nsweep run {result.parent_run_id}: {result.trials} trials "
        f"({result.failed_trials} failed{pruned}); best {args.metric} {result.best_loss:.4f} "
        f"with {result.best_params} (run {result.best_run_id})"
    )
    if result.registered_version is not None:
        print(f"registered as version {result.registered_version} of "
              f"{args.register_model!r}: {result.registered_uri}")
    return 0


def parallelism_choice(text: str) -> int | str:
    """``--parallelism``: a whole number (an MLproject float such as ``2.0`` too) or
    ``auto``.

    Raises:
        ConfigurationError: Anything else.
    """
    from mlflow_hvd.sweep.loop import check_parallelism

    if text.strip().lower() == "auto":
        return "auto"
    try:
        number = float(text)
    except ValueError:
        number = float("nan")
    if not number.is_integer():
        raise ConfigurationError(
            f"parallelism must be a whole number >= 1 (trials at once) or 'auto', got {text!r}")
    return check_parallelism(int(number))


if __name__ == "__main__":
    exit_now(exit_status(main))

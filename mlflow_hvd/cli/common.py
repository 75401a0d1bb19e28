"""What both entry points share: argument types, loading the training function, the store."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from mlflow_hvd.common.config import ClusterConfig, JobConfig, check_ship_environment
from mlflow_hvd.errors import ConfigurationError, MlflowHvdError, Terminated

DEFAULT_TRAIN = "examples/digits_keras.py:train"
DEFAULT_STORE = "sqlite:///mlflow.db"


def whole_number(text: str) -> int:
    """An int that may be written as a float ("2.0"), as MLproject float params are."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def load_function(spec: str) -> Callable[..., Any]:
    """The function named by ``path/to/file.py:name`` or ``package.module:name``.

    A file is imported as a module named after it, with its directory on ``sys.path`` (so
    its sibling imports work); HorovodRunner then ships it to the ranks by value.

    Raises:
        ConfigurationError: Malformed spec, missing file or module, or no such function.
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigurationError(
            f"--train {spec!r}: expected 'path/to/file.py:function' or 'module:function'"
        )
    if where.endswith(".py"):
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ConfigurationError(f"--train {spec!r}: no such file {path}")
        sys.path.insert(0, os.path.dirname(path))
        module = importlib.import_module(os.path.splitext(os.path.basename(path))[0])
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigurationError(f"--train {spec!r}: cannot import {where}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigurationError(f"--train {spec!r}: {where} has no function {name!r}")
    return fn


def use_default_store() -> str:
    """Without ``MLFLOW_TRACKING_URI``, log to ``sqlite:///mlflow.db`` in the working
    directory; returns the tracking URI in use."""
    import mlflow

    if "MLFLOW_TRACKING_URI" not in os.environ:
        mlflow.set_tracking_uri(DEFAULT_STORE)
    return str(mlflow.get_tracking_uri())


def complete_environment() -> int:
    """The MLproject's environment completed first (:func:`mlflow_hvd.cli.project_env.complete`:
    this project and Horovod installed where ``mlflow run`` made the environment, else
    checked): 0, or 1 having said why on stderr."""
    from mlflow_hvd.cli import project_env

    try:
        project_env.complete()
    except MlflowHvdError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def prepare_environment() -> None:
    """Quiet TensorFlow's C++ logs; Spark executors use this interpreter (the project's)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def exit_status(main: Callable[[], int]) -> int:
    """``main()``'s status; a job ended by SIGTERM exits 143 and by Ctrl-C 130, as a
    shell reports a process killed by those signals (the run is already marked KILLED)."""
    try:
        return main()
    except Terminated as exc:
        print(f"stopped: {exc}; the MLflow run was ended KILLED", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted; the MLflow run was ended KILLED", file=sys.stderr)
        return 130


def exit_now(status: int) -> NoReturn:
    """End an entry point's process with ``status`` at once, once its output is flushed.

    When ``main`` returns, the run is stored and ended (the runner does it within its
    deadlines); a normal interpreter exit with pyspark, py4j and MLflow loaded takes
    seconds more (docs/benchmarks.md), which ``mlflow run`` would wait for. ``atexit`` hooks
    do not run, as in the ranks; an embedded SparkSession's JVM stops by itself when its
    stdin closes. Errors other than a stop (``exit_status``) still leave the normal way,
    with their traceback.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def add_runner_options(p: argparse.ArgumentParser) -> None:
    """The HorovodRunner options both entry points take."""
    p.add_argument(
        "--spark-master",
        default="auto",
        help="Spark master for np>0, e.g. spark://host:7077; 'auto' (default): "
        "Spark's own settings (PYSPARK_SUBMIT_ARGS, spark-defaults.conf, "
        "MASTER), else an embedded local[N]",
    )
    p.add_argument(
        "--log-every-n-steps",
        type=whole_number,
        default=0,
        help="also log per-batch metrics (step_*) every N batches (0: per epoch only); passed "
        "to the training function as log_every_n_steps",
    )
    p.add_argument(
        "--max-failures",
        type=whole_number,
        default=JobConfig().max_failures,
        help="restart a failed job (each sweep trial) up to N times, resuming from its "
        "latest checkpoint (default 0)",
    )
    p.add_argument(
        "--min-np",
        type=whole_number,
        default=0,
        help="elastic: let an attempt run on as few as N ranks when a host is lost, growing "
        "back to np at a checkpoint when it returns (JobConfig.min_np; needs "
        "--max-failures >= 1; default 0: every attempt on np)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="end a job (each sweep trial) that runs longer than this many seconds "
        "(JobConfig.timeout; default 0: no limit)",
    )
    p.add_argument(
        "--ship-environment",
        default="auto",
        help="ship a Python environment to executors that lack it (spark.archives): "
        "'auto' (default) ships the environment `mlflow run` created, not a user's own; "
        "'true' packs this venv; 'false' ships nothing; or the path of an archive "
        "(python -m mlflow_hvd.cli.pack_env). Never applied on local[...] masters",
    )


@dataclass(frozen=True)
class RunnerGroups:
    """HorovodRunner's option groups made from :func:`add_runner_options`' flags (the
    groups the command line sets; the others keep their defaults)."""

    job: JobConfig
    cluster: ClusterConfig


def runner_options(args: argparse.Namespace) -> RunnerGroups:
    """The option groups from :func:`add_runner_options`' flags: ``--max-failures``,
    ``--min-np`` and ``--timeout`` into :class:`JobConfig`, ``--spark-master`` and
    ``--ship-environment`` into :class:`ClusterConfig`.

    Raises:
        ConfigurationError: A flag's value out of its range, naming the option.
    """
    if args.timeout < 0:
        raise ConfigurationError(
            f"timeout must be a number of seconds (0: no limit), got {args.timeout:g}")
    job = JobConfig(max_failures=args.max_failures, timeout=args.timeout or None,
                    min_np=args.min_np or None)
    cluster = ClusterConfig(spark_master=args.spark_master,
                            ship_environment=ship_choice(args.ship_environment))
    return RunnerGroups(job, cluster)


def ship_choice(text: str) -> bool | str:
    """``HorovodRunner(cluster=ClusterConfig(ship_environment=...))`` for ``--ship-environment``:
    ``auto`` ships
    an environment MLflow's environment manager created (the executors of a cluster cannot
    have it: it was made on the driver for this run), and leaves a user's own environment
    to the nodes' image; ``true``/``false``; anything else is an archive's path (checked by
    the runner).

    Raises:
        ConfigurationError: Neither of the words nor an existing archive.
    """
    lowered = text.strip().lower()
    if lowered == "auto":
        from mlflow_hvd.cli.project_env import mlflow_managed

        return mlflow_managed()
    if lowered in ("true", "false"):
        return lowered == "true"
    return check_ship_environment(text)

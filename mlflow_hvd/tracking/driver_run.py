"""Driver side of tracking: the one MLflow run a distributed job logs into.

``driver_run`` resolves the run (the active run, the run ``mlflow run`` created through
``MLFLOW_RUN_ID``, or a new one), tags it so runs are comparable, hands workers its id and
tracking URI explicitly, and ends a run it started with the truthful status: FINISHED,
FAILED (failing rank and root cause in tags and ``error.txt``) or KILLED (interrupted). A run
the caller started is tagged but left for the caller to end.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from mlflow_hvd.errors import WorkerFailedError
from mlflow_hvd.messages import TrackingTarget

TAG_PREFIX = "mlflow_hvd."
log = logging.getLogger(__name__)


def absolute_tracking_uri(uri: str, cwd: str | None = None) -> str:
    """Make a relative local store URI absolute, so that workers with another working
    directory (Spark executors) reach the same store.

    ``sqlite:///mlflow.db`` becomes ``sqlite:////abs/dir/mlflow.db``; a bare path becomes a
    ``file://`` URI; server URIs are unchanged.
    """
    base = cwd or os.getcwd()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        rel = uri[len("sqlite:///"):]
        return "sqlite:///" + os.path.abspath(os.path.join(base, rel))
    if "://" not in uri and not uri.startswith("databricks"):
        return "file://" + os.path.abspath(os.path.join(base, uri))
    if uri.startswith("file:") and not uri.startswith("file:///") and not uri.startswith(
        "file://"
    ):
        return "file://" + os.path.abspath(os.path.join(base, uri[len("file:"):]))
    return uri


def run_tags(np: int, backend: Mapping[str, str]) -> dict[str, str]:
    """Tags that make distributed runs comparable in the MLflow UI."""
    import horovod

    tags = {
        f"{TAG_PREFIX}np": str(np),
        f"{TAG_PREFIX}num_ranks": str(abs(np)),
        f"{TAG_PREFIX}backend": backend.get("backend", ""),
        f"{TAG_PREFIX}horovod_version": horovod.__version__,
        f"{TAG_PREFIX}tensorflow_version": _tensorflow_version(),
        f"{TAG_PREFIX}python_version": platform.python_version(),
    }
    if "spark_master" in backend:
        tags[f"{TAG_PREFIX}spark_master"] = backend["spark_master"]
    return tags


def _tensorflow_version() -> str:
    """Installed TensorFlow's version, from package metadata: the driver need not import it."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return ""


@contextmanager
def driver_run(
    np: int, backend: Mapping[str, str], system_metrics: bool = False
) -> Iterator[TrackingTarget]:
    """Resolve or start the job's MLflow run; end it with the right status if we started it.

    Yields:
        What workers need to log into the run.
    """
    import mlflow

    mlflow.set_tracking_uri(absolute_tracking_uri(mlflow.get_tracking_uri()))
    active = mlflow.active_run()
    owned = active is None
    run = active if active is not None else mlflow.start_run()  # honours MLFLOW_RUN_ID
    client = mlflow.MlflowClient()
    run_id = run.info.run_id
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in run_tags(np, backend).items()])
    target = TrackingTarget(
        tracking_uri=mlflow.get_tracking_uri(),
        run_id=run_id,
        experiment_id=run.info.experiment_id,
        system_metrics=system_metrics,
    )
    try:
        yield target
    except KeyboardInterrupt:
        client.set_tag(run_id, f"{TAG_PREFIX}status_reason", "interrupted by the user")
        if owned:
            mlflow.end_run("KILLED")
        raise
    except BaseException as exc:
        record_failure(client, run_id, exc)
        if owned:
            mlflow.end_run("FAILED")
        raise
    else:
        if owned:
            mlflow.end_run("FINISHED")


def record_failure(client: Any, run_id: str, exc: BaseException) -> None:
    """Tags naming the failing rank and root cause, and the full message as ``error.txt``."""
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    tags = {f"{TAG_PREFIX}error": f"{type(exc).__name__}: {first_line}"[:4000]}
    if isinstance(exc, WorkerFailedError):
        tags[f"{TAG_PREFIX}failed_rank"] = str(exc.rank)
        tags[f"{TAG_PREFIX}failed_host"] = exc.host
        tags[f"{TAG_PREFIX}root_cause"] = (exc.root_cause.error or exc.root_cause.describe_exit())[
            :4000
        ]
    from mlflow.entities import RunTag

    # The job's own error is what the caller sees; a bookkeeping failure is only warned
    # about, naming what did not reach the run.
    try:
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    except Exception as err:
        log.warning("could not tag run %s with the failure (%s not recorded): %s", run_id,
                    ", ".join(sorted(tags)), err)
    try:
        client.log_text(run_id, f"{type(exc).__name__}: {exc}\n", "error.txt")
    except Exception as err:
        log.warning("could not store error.txt in run %s: %s", run_id, err)

"""Driver side of tracking: the one MLflow run a distributed job logs into.

``driver_run`` resolves the run (the active run, the run ``mlflow run`` created through
``MLFLOW_RUN_ID``, or a new one), tags it so runs are comparable, hands workers its id and
tracking URI explicitly, and ends a run it started with the truthful status: FINISHED,
FAILED (failing rank and root cause in tags and ``error.txt``) or KILLED (interrupted). A run
the caller started is tagged but left for the caller to end.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from mlflow_hvd.deadline import DeadlineExceeded, call_within
from mlflow_hvd.errors import Terminated, WorkerFailedError
from mlflow_hvd.messages import TrackingTarget
from mlflow_hvd.tracking.rank_logger import check_server_reachable

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
        rel = uri[len("sqlite:///") :]
        return "sqlite:///" + os.path.abspath(os.path.join(base, rel))
    if "://" not in uri and not uri.startswith("databricks"):
        return "file://" + os.path.abspath(os.path.join(base, uri))
    if uri.startswith("file:") and not uri.startswith("file:///") and not uri.startswith("file://"):
        return "file://" + os.path.abspath(os.path.join(base, uri[len("file:") :]))
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
def store_lock(uri: str) -> Iterator[None]:
    """Serialise first use of a local SQLite store across processes on this host.

    MLflow creates and migrates a new SQLite store's schema on first use, and two processes
    doing it at once can fail. Other stores need no lock.
    """
    if not uri.startswith("sqlite:///"):
        yield
        return
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"mlflow-hvd-store-{digest}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
        yield
    finally:
        os.close(fd)


@contextmanager
def driver_run(
    np: int,
    backend: Mapping[str, str],
    system_metrics: bool = False,
    bookkeeping_timeout: float = 30.0,
) -> Iterator[TrackingTarget]:
    """Resolve or start the job's MLflow run; end it with the right status if we started it.

    Ending the run (status, failure tags, ``error.txt``) has one deadline,
    ``bookkeeping_timeout`` seconds: against an unreachable tracking server the job's own
    outcome is returned or raised after at most that long, with a warning naming what was
    not recorded. A bookkeeping error never replaces the job's error.

    Raises:
        TrackingError: The tracking server cannot be reached before the job starts.

    Yields:
        What workers need to log into the run.
    """
    import mlflow
    from mlflow.entities import RunTag

    uri = absolute_tracking_uri(mlflow.get_tracking_uri())
    mlflow.set_tracking_uri(uri)
    check_server_reachable(uri, "the driver")
    with store_lock(uri):
        active = mlflow.active_run()
        owned = active is None
        run = active if active is not None else mlflow.start_run()  # honours MLFLOW_RUN_ID
        client = mlflow.MlflowClient()
        run_id = run.info.run_id
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in run_tags(np, backend).items()])
    target = TrackingTarget(
        tracking_uri=uri,
        run_id=run_id,
        experiment_id=run.info.experiment_id,
        system_metrics=system_metrics,
    )
    ending = _Ending(client, run_id, owned, bookkeeping_timeout)
    try:
        yield target
    except KeyboardInterrupt as exc:
        reason = (
            "terminated by SIGTERM" if isinstance(exc, Terminated) else "interrupted by the user"
        )
        ending.close("KILLED", {f"{TAG_PREFIX}status_reason": reason})
        raise
    except BaseException as exc:
        ending.close("FAILED", failure_tags(exc), f"{type(exc).__name__}: {exc}\n")
        raise
    else:
        ending.close("FINISHED", {})


class _Ending:
    """Ends the driver's run: tags, ``error.txt`` and status, all within one deadline."""

    def __init__(self, client: Any, run_id: str, owned: bool, timeout: float) -> None:
        self.client, self.run_id, self.owned, self.timeout = client, run_id, owned, timeout
        self.done: list[str] = []

    def close(self, status: str, tags: Mapping[str, str], error_text: str = "") -> None:
        todo = [
            *(["tags " + ", ".join(sorted(tags))] if tags else []),
            *(["error.txt"] if error_text else []),
            *([f"status {status}"] if self.owned else []),
        ]
        try:
            call_within(
                self.timeout, "ending the MLflow run", self._write, status, tags, error_text
            )
        except DeadlineExceeded:
            missing = [t for t in todo if t not in self.done]
            log.warning(
                "mlflow_hvd: the tracking server did not answer within %gs while ending run "
                "%s; not recorded: %s%s",
                self.timeout,
                self.run_id,
                "; ".join(missing),
                " (the run stays RUNNING in MLflow)" if self.owned else "",
            )
        except Exception as err:
            log.warning(
                "mlflow_hvd: could not set the status of run %s to %s: %s", self.run_id, status, err
            )
        finally:
            if self.owned:
                _forget_active_run(self.run_id)

    def _write(self, status: str, tags: Mapping[str, str], error_text: str) -> None:
        if tags:
            record_failure_tags(self.client, self.run_id, tags)
            self.done.append("tags " + ", ".join(sorted(tags)))
        if error_text:
            try:
                self.client.log_text(self.run_id, error_text, "error.txt")
            except Exception as err:
                log.warning("could not store error.txt in run %s: %s", self.run_id, err)
            self.done.append("error.txt")
        if self.owned:
            self.client.set_terminated(self.run_id, status)
            self.done.append(f"status {status}")


def _forget_active_run(run_id: str) -> None:
    """Pop our run off MLflow's active-run stack without another server call (what
    ``mlflow.end_run`` does besides ``set_terminated``, which :class:`_Ending` has made)."""
    from mlflow.tracking import fluent

    os.environ.pop("MLFLOW_RUN_ID", None)
    stack = fluent._active_run_stack.get()
    if stack and stack[-1].info.run_id == run_id:
        stack.pop()


def failure_tags(exc: BaseException) -> dict[str, str]:
    """Tags naming the failing rank and root cause."""
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    tags = {f"{TAG_PREFIX}error": f"{type(exc).__name__}: {first_line}"[:4000]}
    if isinstance(exc, WorkerFailedError):
        tags[f"{TAG_PREFIX}failed_rank"] = str(exc.rank)
        tags[f"{TAG_PREFIX}failed_host"] = exc.host
        tags[f"{TAG_PREFIX}root_cause"] = (exc.root_cause.error or exc.root_cause.describe_exit())[
            :4000
        ]
    return tags


def record_failure_tags(client: Any, run_id: str, tags: Mapping[str, str]) -> None:
    """Write ``tags``; a failure is warned about, naming what did not reach the run."""
    from mlflow.entities import RunTag

    try:
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    except Exception as err:
        log.warning(
            "could not tag run %s with the failure (%s not recorded): %s",
            run_id,
            ", ".join(sorted(tags)),
            err,
        )


def record_failure(client: Any, run_id: str, exc: BaseException) -> None:
    """Tags naming the failing rank and root cause, and the full message as ``error.txt``
    (for runs the caller owns, e.g. a sweep's trials). Warns instead of raising."""
    record_failure_tags(client, run_id, failure_tags(exc))
    try:
        client.log_text(run_id, f"{type(exc).__name__}: {exc}\n", "error.txt")
    except Exception as err:
        log.warning("could not store error.txt in run %s: %s", run_id, err)

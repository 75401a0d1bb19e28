"""Driver side of tracking: the one MLflow run a distributed job logs into.

``driver_run`` resolves the run (the active run, the run ``mlflow run`` created through
``MLFLOW_RUN_ID``, or a new one), tags it so runs are comparable, hands workers its id and
tracking URI explicitly, and ends a run it started with the truthful status: FINISHED,
FAILED (failing rank and root cause in tags and ``error.txt``) or KILLED (interrupted). A run
the caller started is tagged but left for the caller to end.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from mlflow_hvd.common import compat, mlflow_private
from mlflow_hvd.common.config import TrackingConfig
from mlflow_hvd.common.deadline import call_within
from mlflow_hvd.common.tracking_server import (
    check_authorized,
    check_server_reachable,
    is_http,
    make_local_artifact_dir,
    refusal,
    run_facts,
)
from mlflow_hvd.driver.tracking import undelivered
from mlflow_hvd.errors import JobStopped, RetriesExhaustedError, Terminated, WorkerFailedError
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.messages import TrackingTarget

TAG_PREFIX = "mlflow_hvd."


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
    """Tags that make distributed runs comparable in the MLflow UI: the versions of the
    driver's Horovod, TensorFlow and PyTorch ("" where one is not installed) are read from
    package metadata, nothing imported."""
    tags = {
        f"{TAG_PREFIX}np": str(np),
        f"{TAG_PREFIX}num_ranks": str(abs(np)),
        f"{TAG_PREFIX}backend": backend.get("backend", ""),
        f"{TAG_PREFIX}horovod_version": compat.HOROVOD.installed() or "",
        f"{TAG_PREFIX}tensorflow_version": compat.TENSORFLOW.installed() or "",
        f"{TAG_PREFIX}torch_version": compat.TORCH.installed() or "",
        f"{TAG_PREFIX}python_version": platform.python_version(),
    }
    for fact in ("spark_master", "spark_connect"):  # the Connect server's host, if any
        if fact in backend:
            tags[f"{TAG_PREFIX}{fact}"] = backend[fact]
    return tags


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Serialise first use of a local SQLite store across processes on this host.

    MLflow creates and migrates a new SQLite store's schema on first use, and two processes
    doing it at once can fail. Other stores need no lock.
    """
    if not uri.startswith("sqlite:///"):
        yield
        return
    folder = os.path.dirname(uri[len("sqlite:///"):]) or "."
    try:  # lock the store's directory: no lock file is left behind
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # no such directory: MLflow itself will say so
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
        yield
    finally:
        os.close(fd)


@contextmanager
def driver_run(
    np: int,
    backend: Mapping[str, str],
    tracking: TrackingConfig,
) -> Iterator[TrackingTarget]:
    """Resolve or start the job's MLflow run; end it with the right status if we started it.

    Ending the run (status, failure tags, ``error.txt``) has one deadline,
    ``tracking.tracking_timeout`` seconds: against an unreachable tracking server the job's
    own outcome is returned or raised after at most that long, with a warning naming what was
    not recorded. A bookkeeping error never replaces the job's error.

    Raises:
        TrackingError: The tracking server cannot be reached before the job starts.

    Yields:
        What workers need to log into the run.
    """
    import mlflow
    from mlflow.entities import RunTag

    uri = absolute_tracking_uri(mlflow.get_tracking_uri())
    _say_where_once(uri)
    mlflow.set_tracking_uri(uri)
    check_server_reachable(uri, "the driver")
    with store_lock(uri):
        active = mlflow.active_run()
        owned = active is None
        try:
            run = active if active is not None else mlflow.start_run()  # MLFLOW_RUN_ID
            client = mlflow.MlflowClient()
            run_id = run.info.run_id
            # the caller's run may have been logged to since it started: read it again
            facts = run_facts(run if owned else client.get_run(run_id))
            client.log_batch(run_id,
                             tags=[RunTag(k, v) for k, v in run_tags(np, backend).items()])
            if is_http(uri):  # and its artifacts, before any rank starts
                check_authorized(client, run_id, "the driver", uri)
        except Exception as exc:
            refused = refusal(exc, "the driver", uri)
            if refused is None:
                raise
            if owned and mlflow.active_run() is not None:
                with contextlib.suppress(Exception):
                    mlflow.end_run("FAILED")
            raise refused from exc
    target = TrackingTarget(
        tracking_uri=uri,
        run_id=run_id,
        experiment_id=run.info.experiment_id,
        system_metrics=tracking.log_system_metrics,
        tracking_timeout=tracking.tracking_timeout,
        facts=facts,
        local_artifacts=make_local_artifact_dir(run.info.artifact_uri),
        registry_uri=absolute_tracking_uri(mlflow.get_registry_uri()),
        run_name=run.info.run_name or "",
        user_id=run.info.user_id or "",
        start_time=int(run.info.start_time or 0),
        artifact_uri=run.info.artifact_uri or "",
    )
    ending = _Ending(client, target, owned, tracking.tracking_timeout,
                     tracking.undelivered_dir or undelivered.default_root())
    try:
        yield target
    except KeyboardInterrupt as exc:
        reason = (
            "terminated by SIGTERM" if isinstance(exc, Terminated)
            else "stopped by HorovodRunner.stop()" if isinstance(exc, JobStopped)
            else "interrupted by the user"
        )
        ending.close("KILLED", {f"{TAG_PREFIX}status_reason": reason})
        raise
    except BaseException as exc:
        ending.close("FAILED", failure_tags(exc), f"{type(exc).__name__}: {exc}\n")
        raise
    else:
        ending.close("FINISHED", {})


class _Ending:
    """Ends the driver's run: tags, ``error.txt`` and status, all within one deadline.

    What the server did not take in time is saved for replay (:mod:`.undelivered`)."""

    def __init__(
        self, client: Any, target: TrackingTarget, owned: bool, timeout: float, root: str
    ) -> None:
        self.client, self.target, self.owned = client, target, owned
        self.timeout, self.root = timeout, root
        self.done: list[str] = []

    def close(self, status: str, tags: Mapping[str, str], error_text: str = "") -> None:
        run_id = self.target.run_id
        steps: dict[str, list[rec.Record]] = {
            **({"tags " + ", ".join(sorted(tags)): [rec.Tag(k, v) for k, v in tags.items()]}
               if tags else {}),
            **({"error.txt": [rec.Artifact("error.txt", "")]} if error_text else {}),
            **({f"status {status}": [rec.Status(status)]} if self.owned else {}),
        }
        try:
            call_within(self.timeout, "ending the MLflow run", self._write, status, tags,
                        error_text)
        except Exception as err:
            missing = [name for name in steps if name not in self.done]
            undelivered.keep_or_warn(
                err, self.root, self.target, f"ending run {run_id}", "; ".join(missing),
                [r for name in missing for r in steps[name]],
                [("error.txt", error_text.encode())] if "error.txt" in missing else [],
                timeout=self.timeout,
                consequence=" (the run stays RUNNING in MLflow until then)" if self.owned
                else "",
            )
        finally:
            if self.owned:
                _forget_active_run(run_id)

    def _write(self, status: str, tags: Mapping[str, str], error_text: str) -> None:
        from mlflow.entities import RunTag

        run_id = self.target.run_id
        if tags:
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            self.done.append("tags " + ", ".join(sorted(tags)))
        if error_text:
            self.client.log_text(run_id, error_text, "error.txt")
            self.done.append("error.txt")
        if self.owned:
            self.client.set_terminated(run_id, status)
            self.done.append(f"status {status}")


_told: set[str] = set()


def _say_where_once(uri: str) -> None:
    """When nobody chose a tracking store, MLflow's default is created in the working
    directory: say where, once per process, with the command that opens it."""
    if mlflow_private.tracking_uri_was_set() or uri in _told:
        return
    _told.add(uri)
    print(
        f"mlflow_hvd: no MLflow tracking URI set (MLFLOW_TRACKING_URI or "
        f"mlflow.set_tracking_uri): logging to MLflow's default store {uri}; open it with: "
        f"mlflow ui --backend-store-uri {uri}",
        file=sys.stderr,
        flush=True,
    )


def _forget_active_run(run_id: str) -> None:
    """Pop our run off MLflow's active-run stack without another server call (what
    ``mlflow.end_run`` does besides ``set_terminated``, which :class:`_Ending` has made)."""
    os.environ.pop("MLFLOW_RUN_ID", None)
    mlflow_private.forget_active_run(run_id)


def failure_tags(exc: BaseException) -> dict[str, str]:
    """Tags naming the failing rank and root cause."""
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    tags = {f"{TAG_PREFIX}error": f"{type(exc).__name__}: {first_line}"[:4000]}
    if isinstance(exc, RetriesExhaustedError):
        tags[f"{TAG_PREFIX}failed_attempts"] = str(len(exc.failures))
        exc = exc.last
    if isinstance(exc, WorkerFailedError):
        tags[f"{TAG_PREFIX}failed_rank"] = str(exc.rank)
        tags[f"{TAG_PREFIX}failed_host"] = exc.host
        tags[f"{TAG_PREFIX}root_cause"] = (exc.root_cause.error or exc.root_cause.describe_exit())[
            :4000
        ]
    return tags

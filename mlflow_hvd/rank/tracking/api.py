"""Rank side of tracking: rank 0 writes to the driver's run, other ranks do nothing.

Every function goes through one gate, :func:`is_logging_rank`. On rank 0 they write to the
driver's MLflow run (its id and tracking URI travel with the job), never starting or ending
a run on the worker: metrics, params and tags through the driver, which makes the MLflow
calls (:mod:`.sender`), artifacts and models with :class:`mlflow.MlflowClient`.

Training never waits for MLflow: params, metrics, tags, artifacts (copied first, so the
caller may delete its file) and checkpoints become ordered records that a background thread
delivers (:mod:`.delivery`), buffering them through a tracking-server outage. :func:`flush`
waits for what was queued; the worker delivers what is left before it exits, within the
job's ``tracking_timeout``, and hands anything undelivered to the driver, which saves it for
replay (:mod:`mlflow_hvd.driver.tracking.replay`). Only :func:`log_model` talks to the
server synchronously.

Outside a HorovodRunner job (no tracking target) every function is a no-op.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from mlflow_hvd.common.tracking_server import (
    is_outage,
)
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.messages import TrackingTarget, UndeliveredTracking
from mlflow_hvd.rank.tracking import pruning, writes
from mlflow_hvd.rank.tracking.session import SESSION, RankLogger


def configure(target: TrackingTarget | None, rank: int, local_rank: int, host: str) -> None:
    """Called by the worker entry point before the user's function (not for user code).

    Raises:
        TrackingError: On rank 0, a tracking server that does not accept connections from
            this host (checked before training, not after it).
    """
    pruning.reset(target, rank)
    SESSION.configure(target, rank, local_rank, host)


def shutdown(timeout: float | None = None) -> tuple[UndeliveredTracking | None, str]:
    """Deliver what is queued within ``timeout`` (default: the job's ``tracking_timeout``)
    and stop. Called by the worker entry point after the user's function, on every path.

    Returns:
        (what could not be delivered, or None; a refusal message, or "").
    """
    pruning.close()
    return SESSION.shutdown(timeout)


def is_logging_rank() -> bool:
    """The one gate: True only on rank 0 of a job that tracks to an MLflow run."""
    return SESSION.is_logging_rank()


def run_id() -> str | None:
    """The driver's MLflow run id (on every rank), or None when not tracking."""
    target = SESSION.target
    return target.run_id if target is not None else None


def server_uri() -> str | None:
    """The tracking server's URI (on every rank), or None when not tracking.

    Inside a job, MLflow's own tracking URI names the job's store (``mlflow-hvd://<run
    id>``), which answers reads of the job's run as this rank logged it. For the server's
    own view on rank 0 (which holds the credentials), ask it directly:
    ``mlflow.MlflowClient(tracking_uri=mlflow_hvd.tracking.server_uri())``.
    """
    target = SESSION.target
    return target.tracking_uri if target is not None else None


def tracking_target() -> TrackingTarget | None:
    """The driver's run as workers see it (on every rank), or None."""
    return SESSION.target


def _require() -> RankLogger | None:
    """The logger on the logging rank (created on first use: a job that never logs does
    not pay for importing MLflow in its workers), None elsewhere."""
    return SESSION.logger()


def log_param(key: str, value: Any) -> None:
    """Log a param once (rank 0 only). Re-logging the same value is a no-op."""
    log_params({key: value})


def log_params(params: Mapping[str, Any], keep_existing: bool = False) -> None:
    """Log params once each (rank 0 only).

    MLflow refuses to change a param: a different value for a key the run already has
    raises :class:`ConfigurationError`, or is skipped with ``keep_existing=True`` (what a
    resumed run wants for values it logged the first time).
    """
    logger = _require()
    if logger is None:
        return
    for record in writes.params(logger, params, keep_existing):
        logger.put(record)


def log_metric(key: str, value: float, step: int | None = None) -> None:
    """Queue one metric value (rank 0 only)."""
    log_metrics({key: value}, step)


def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
    """Queue metric values at ``step`` (rank 0 only). Values may be tensors: they are
    converted off the training thread."""
    logger = _require()
    if logger is None:
        return
    ts = int(time.time() * 1000)
    records = writes.unrepeated(logger, [rec.Metric(key, value, ts, int(step or 0))
                                         for key, value in metrics.items()])
    for record in records:
        logger.put(record)
    writes.metrics_logged(logger, records, report=step is not None)


def log_batch_metrics(metrics: Mapping[str, float], step: int) -> None:
    """Like :func:`log_metrics`, for per-batch series whose step is a global batch count:
    they do not move the step a logged model is linked to (the epoch)."""
    logger = _require()
    if logger is None:
        return
    ts = int(time.time() * 1000)
    records = writes.unrepeated(logger, [rec.Metric(key, value, ts, int(step))
                                         for key, value in metrics.items()])
    for record in records:
        logger.put(record)
    writes.metrics_logged(logger, records, per_batch=True)


def skip_repeated_steps() -> dict[str, int]:
    """Rank 0, as a retried attempt resumes from a snapshot taken before the failure: from
    now on a metric value at a step the run already has for its key (the latest one logged,
    read from the server now) is not logged again, through any API. Returns those latest
    steps; empty elsewhere, or when the server cannot be read (then nothing is skipped)."""
    logger = _require()
    if logger is None:
        return {}
    try:
        run = logger.client.get_run(logger.target.run_id)
    except Exception as exc:
        if not is_outage(exc):
            raise
        return {}
    # the proto of the run's metrics: their latest values with their steps (public API)
    latest = {m.key: int(m.step) for m in run.data.to_proto().metrics
              if not m.key.startswith(("system/", "mlflow_hvd."))}
    logger.repeated_through = latest
    return latest


def set_tag(key: str, value: Any) -> None:
    """Set a run tag (rank 0 only)."""
    set_tags({key: value})


def set_tags(tags: Mapping[str, Any]) -> None:
    """Set run tags (rank 0 only)."""
    logger = _require()
    if logger is None:
        return
    for key, value in tags.items():
        logger.put(rec.Tag(key, str(value)))


def log_artifact(local_path: str, artifact_path: str | None = None) -> None:
    """Upload a file to the run's artifacts (rank 0 only). The file is copied at once and
    uploaded in order with the other records."""
    logger = _require()
    if logger is not None:
        staged = logger.delivery.stage_file(local_path)
        logger.put_artifact(staged, artifact_path or "")


def log_artifacts(local_dir: str, artifact_path: str | None = None) -> None:
    """Upload a directory's files to the run's artifacts, keeping its layout (rank 0 only)."""
    logger = _require()
    if logger is None:
        return
    for root, _, files in sorted(os.walk(local_dir)):
        rel = os.path.relpath(root, local_dir)
        parts = [p for p in (artifact_path, None if rel == "." else rel) if p]
        for name in sorted(files):
            staged = logger.delivery.stage_file(os.path.join(root, name))
            logger.put_artifact(staged, "/".join(parts))


def log_dict(data: Mapping[str, Any], artifact_file: str) -> None:
    """Write ``data`` as JSON to ``artifact_file`` in the run (rank 0 only)."""
    logger = _require()
    if logger is None:
        return
    folder = scratch_file_dir(logger)
    path = os.path.join(folder, os.path.basename(artifact_file))
    with open(path, "w") as f:
        json.dump(dict(data), f, indent=2, default=str)
    logger.put_artifact(path, os.path.dirname(artifact_file))


def scratch_file_dir(logger: RankLogger) -> str:
    """A new folder in the spool for a file to upload (removed once uploaded)."""
    return tempfile.mkdtemp(dir=logger.spool)


def log_model(model: Any, name: str = "model", **kwargs: Any) -> Any:
    """Log a Keras model as an MLflow model (a LoggedModel linked to the run), rank 0 only.

    Synchronous: the model's id comes from the tracking server and its files go straight to
    the artifact store; against an unreachable server it raises :class:`TrackingError`
    after MLflow's HTTP retries (the job's other records stay queued). The model
    is linked to the run's metrics at the latest step logged (``step=`` overrides) and
    names the driver's program as its source (not the worker). Its pip requirements are
    the installed versions of TensorFlow, Keras, NumPy and cloudpickle (pass
    ``pip_requirements``, ``extra_pip_requirements`` or ``conda_env`` to choose). Its
    signature is the model's declared tensors unless ``signature`` is passed
    (:mod:`mlflow_hvd.rank.tracking.signature`; nothing is predicted for it). Pass an
    ``input_example`` (a few input rows, e.g. ``x_test[:4]``) as MLflow recommends: it is
    saved beside the signature (the MLflow UI shows it, ``mlflow models serve`` documents
    its requests with it), and MLflow checks it by running the model on it once.

    Returns:
        ``mlflow.models.model.ModelInfo`` on rank 0, None elsewhere.
    """
    from mlflow_hvd.rank.tracking import requirements

    return log_flavor_model("mlflow.tensorflow", model, name, requirements.MODEL_PACKAGES,
                            True, kwargs)


def log_flavor_model(flavor: str, model: Any, name: str, packages: tuple[str, ...],
                     declared_signature: bool, kwargs: dict[str, Any]) -> Any:
    """Rank 0: ``<flavor>.log_model(model, name=name, run_id=<the job's run>, **kwargs)``
    after everything queued, linked to the latest step logged, its pip requirements the
    installed versions of ``packages`` (no inference subprocess) and, with
    ``declared_signature``, the Keras model's declared tensors as its signature (an
    ``input_example`` is then saved beside it, not used to infer it). None on other
    ranks."""
    logger = _require()
    if logger is None:
        return None
    import importlib

    log = importlib.import_module(flavor).log_model
    logger.check_artifacts()
    kwargs.setdefault("step", logger.last_step)
    kwargs["tags"] = {**logger.source_tags, **(kwargs.get("tags") or {})}
    from mlflow_hvd.rank.tracking import requirements  # reads package metadata: only here

    kwargs = requirements.with_known_requirements(kwargs, packages)
    if declared_signature and "signature" not in kwargs:
        from mlflow_hvd.rank.tracking.signature import declared_signature as signature

        kwargs["signature"] = signature(model)
    return log(model, name=name, run_id=logger.target.run_id, **kwargs)


def commit(metrics: Mapping[str, float], step: int, tags: Mapping[str, Any],
           epoch: int | None = None, last: bool | None = None) -> None:
    """Rank 0: write ``metrics`` at ``step`` and ``tags`` in one ``log_batch`` call (one
    transaction on a SQL store, one request to a server), after everything queued before.

    Used to move the latest-checkpoint tag together with the epoch's metrics: a crash leaves
    both or neither, so a resumed run neither repeats nor skips a step. ``epoch``: the
    checkpoint this commit makes resumable (the driver is told once it is written), and
    ``last`` whether the training loop said it is its last (None: it did not say).
    """
    logger = _require()
    if logger is None:
        return
    ts = int(time.time() * 1000)
    commit = rec.Commit(
        tuple(rec.Metric(k, float(v), ts, int(step)) for k, v in metrics.items()),
        tuple(rec.Tag(k, str(v)) for k, v in tags.items()),
        epoch, last,
    )
    logger.put(commit)
    logger.last_step = max(logger.last_step, int(step))  # a checkpoint without metrics too
    writes.metrics_logged(logger, commit.metrics)


def max_logged_step(prefix: str) -> int:
    """Rank 0: the highest step the run already has for metrics named ``prefix*`` (-1 if
    none), so that a restarted attempt does not log a step twice. -1 on other ranks.

    During a tracking-server outage the server cannot say: -1 then, and rank 0 says on
    stderr that steps logged before may be logged again (training goes on, as through any
    outage)."""
    logger = _require()
    if logger is None:
        return -1
    try:
        run = logger.client.get_run(logger.target.run_id)
        keys = [k for k in run.data.metrics if k.startswith(prefix)]
        steps = [m.step for k in keys for m in logger.client.get_metric_history(run.info.run_id, k)]
    except Exception as exc:
        if not is_outage(exc):
            raise
        print(f"mlflow_hvd: the tracking server cannot say which steps of the run's "
              f"{prefix}* metrics are logged ({type(exc).__name__}: {exc}): this attempt "
              "logs them from its first step, and a step logged before may be logged again",
              file=sys.stderr)
        return -1
    return max(steps, default=-1)


def flush(timeout: float | None = None) -> None:
    """Wait until everything queued so far is in the tracking store (rank 0 only).

    Raises:
        TrackingError: Not delivered within ``timeout`` (default: the job's
            ``tracking_timeout``; the records stay queued), or refused by the store.
    """
    logger = _require()
    if logger is not None:
        logger.flush(timeout)

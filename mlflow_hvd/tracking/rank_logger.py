"""Rank side of tracking: rank 0 writes to the driver's run, other ranks do nothing.

Every function goes through one gate, :func:`is_logging_rank`. On rank 0 they write to the
driver's MLflow run (its id and tracking URI travel with the job) through
:class:`mlflow.MlflowClient`, never starting or ending a run on the worker.

Params, metrics and tags are queued and sent by a background thread in batches
(``log_batch``), so per-step logging does not stall training; :func:`flush` waits for
everything queued, and the worker flushes before it exits, even when ``main`` raised. An
error in the background thread is raised by the next :func:`flush`, never swallowed.
Artifacts and models are written synchronously.

Outside a HorovodRunner job (no tracking target) every function is a no-op.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from mlflow_hvd.errors import ConfigurationError, TrackingError
from mlflow_hvd.messages import TrackingTarget

_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
_FLUSH_INTERVAL = 2.0  # seconds between background sends; flush() sends at once
SERVER_CONNECT_TIMEOUT = 10.0  # seconds rank 0 gives the tracking server to accept


class _AsyncLogger:
    """Batches metrics/params/tags and sends them with ``log_batch`` from one thread."""

    def __init__(self, target: TrackingTarget) -> None:
        from mlflow import MlflowClient

        self.target = target
        self.client = MlflowClient(tracking_uri=target.tracking_uri)
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        # Params already in the run (e.g. logged by `mlflow run`): same value is a no-op,
        # a different one is refused here rather than failing later in the background.
        self._params: dict[str, str] = dict(self.client.get_run(target.run_id).data.params)
        self._thread = threading.Thread(target=self._loop, name="mlflow-hvd-logger", daemon=True)
        self._thread.start()

    def put(self, kind: str, item: Any) -> None:
        self._queue.put((kind, item))

    def check_param(self, key: str, value: str, keep_existing: bool = False) -> bool:
        """True if the param must be sent; False if already logged (with this value, or with
        any value when ``keep_existing``)."""
        old = self._params.get(key)
        if old is None:
            self._params[key] = value
            return True
        if old != value and not keep_existing:
            raise ConfigurationError(
                f"param {key!r} was already logged as {old!r}; MLflow refuses to change it to "
                f"{value!r}. Log changing values as metrics or tags instead"
            )
        return False

    def flush(self, timeout: float = 120.0) -> None:
        done = threading.Event()
        self._queue.put(("flush", done))
        if not done.wait(timeout):
            raise TrackingError(
                f"MLflow logging did not drain within {timeout:g}s; is the tracking server "
                f"at {self.target.tracking_uri} reachable?"
            )
        if self._error is not None:
            error, self._error = self._error, None
            raise TrackingError(f"logging to MLflow run {self.target.run_id} failed: {error}")

    def _loop(self) -> None:
        from mlflow.entities import Metric, Param, RunTag

        metrics: list[Metric] = []
        params: list[Param] = []
        tags: list[RunTag] = []
        last_send = time.monotonic()
        while True:
            try:
                kind, item = self._queue.get(timeout=_FLUSH_INTERVAL)
            except queue.Empty:
                kind, item = "tick", None
            if kind == "metric":
                key, value, ts, step = item
                # float() here, off the training thread: it may have to wait for a tensor
                metrics.append(Metric(key, float(value), ts, step))
            elif kind == "param":
                params.append(Param(*item))
            elif kind == "tag":
                tags.append(RunTag(*item))
            full = (
                len(metrics) >= _MAX_METRICS
                or len(params) >= _MAX_PARAMS
                or (len(tags) >= _MAX_TAGS)
            )
            due = time.monotonic() - last_send >= _FLUSH_INTERVAL
            if kind == "flush" or full or (due and (metrics or params or tags)):
                try:
                    self._send(metrics, params, tags)
                except Exception as exc:  # reported by the next flush()
                    self._error = self._error or exc
                metrics, params, tags = [], [], []
                last_send = time.monotonic()
            if kind == "flush":
                item.set()

    def _send(self, metrics: list[Any], params: list[Any], tags: list[Any]) -> None:
        run_id = self.target.run_id
        while metrics or params or tags:
            self.client.log_batch(
                run_id,
                metrics=metrics[:_MAX_METRICS],
                params=params[:_MAX_PARAMS],
                tags=tags[:_MAX_TAGS],
                synchronous=True,
            )
            metrics, params, tags = (
                metrics[_MAX_METRICS:],
                params[_MAX_PARAMS:],
                tags[_MAX_TAGS:],
            )


_lock = threading.Lock()
_logger: _AsyncLogger | None = None
_target: TrackingTarget | None = None
_rank = 0
_monitor: Any = None


def configure(target: TrackingTarget | None, rank: int, local_rank: int, host: str) -> None:
    """Called by the worker entry point before the user's function (not for user code).

    Raises:
        TrackingError: On rank 0, a tracking server that does not accept connections from
            this host (checked before training, not after it).
    """
    global _target, _rank, _logger, _monitor
    if target is not None and rank == 0:
        check_server_reachable(target.tracking_uri, host)
    with _lock:
        _target, _rank, _logger = target, rank, None
        if target is not None and target.system_metrics and local_rank == 0:
            _monitor = _start_system_metrics(target, host)


def check_server_reachable(uri: str, host: str, timeout: float = SERVER_CONNECT_TIMEOUT) -> None:
    """Fail fast when an HTTP tracking server cannot be reached from this host (MLflow's
    own client would retry with backoff for minutes)."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout).close()
    except OSError as exc:
        raise TrackingError(
            f"rank 0 on host {host} cannot reach the MLflow tracking server {uri} within "
            f"{timeout:g}s: {exc}. Executors must reach MLFLOW_TRACKING_URI: use an address "
            "of the server that every node can connect to (not localhost), and open its port"
        ) from exc


def shutdown(timeout: float = 120.0) -> None:
    """Flush and stop (called by the worker entry point after the user's function)."""
    global _logger, _monitor
    with _lock:
        logger, monitor = _logger, _monitor
        _logger = _monitor = None
    if monitor is not None:
        with contextlib.suppress(Exception):
            monitor.finish()
    if logger is not None:
        logger.flush(timeout)


def _start_system_metrics(target: TrackingTarget, host: str) -> Any:
    """One system-metrics monitor per node (local rank 0), its series named by host."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        target.run_id, sampling_interval=2, node_id=host, tracking_uri=target.tracking_uri
    )
    monitor.start()
    return monitor


def is_logging_rank() -> bool:
    """The one gate: True only on rank 0 of a job that tracks to an MLflow run."""
    return _target is not None and _rank == 0


def run_id() -> str | None:
    """The driver's MLflow run id (on every rank), or None when not tracking."""
    return _target.run_id if _target is not None else None


def tracking_target() -> TrackingTarget | None:
    """The driver's run as workers see it (on every rank), or None."""
    return _target


def _require() -> _AsyncLogger | None:
    """The logger on the logging rank (created on first use: a job that never logs does
    not pay for importing MLflow in its workers), None elsewhere."""
    global _logger
    if not is_logging_rank():
        return None
    if _logger is not None:  # per-step calls: no lock once the logger exists
        return _logger
    with _lock:
        if _logger is None and _target is not None:
            _logger = _AsyncLogger(_target)
        return _logger


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
    for key, value in params.items():
        text = str(value)
        if logger.check_param(key, text, keep_existing):
            logger.put("param", (key, text))


def log_metric(key: str, value: float, step: int | None = None) -> None:
    """Queue one metric value (rank 0 only)."""
    log_metrics({key: value}, step)


def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
    """Queue metric values at ``step`` (rank 0 only); sent asynchronously in batches."""
    logger = _require()
    if logger is None:
        return
    ts = int(time.time() * 1000)
    for key, value in metrics.items():
        logger.put("metric", (key, value, ts, int(step or 0)))


def set_tag(key: str, value: Any) -> None:
    """Set a run tag (rank 0 only)."""
    set_tags({key: value})


def set_tags(tags: Mapping[str, Any]) -> None:
    """Set run tags (rank 0 only)."""
    logger = _require()
    if logger is None:
        return
    for key, value in tags.items():
        logger.put("tag", (key, str(value)))


def log_artifact(local_path: str, artifact_path: str | None = None) -> None:
    """Upload a file to the run's artifacts (rank 0 only, synchronous)."""
    logger = _require()
    if logger is not None:
        logger.client.log_artifact(logger.target.run_id, local_path, artifact_path)


def log_artifacts(local_dir: str, artifact_path: str | None = None) -> None:
    """Upload a directory to the run's artifacts (rank 0 only, synchronous)."""
    logger = _require()
    if logger is not None:
        logger.client.log_artifacts(logger.target.run_id, local_dir, artifact_path)


def log_dict(data: Mapping[str, Any], artifact_file: str) -> None:
    """Write ``data`` as JSON to ``artifact_file`` in the run (rank 0 only)."""
    logger = _require()
    if logger is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, os.path.basename(artifact_file))
        with open(path, "w") as f:
            json.dump(dict(data), f, indent=2, default=str)
        parent = os.path.dirname(artifact_file) or None
        logger.client.log_artifact(logger.target.run_id, path, parent)


def log_model(model: Any, name: str = "model", **kwargs: Any) -> Any:
    """Log a Keras model as an MLflow model (a LoggedModel linked to the run), rank 0 only.

    Returns:
        ``mlflow.models.model.ModelInfo`` on rank 0, None elsewhere.
    """
    logger = _require()
    if logger is None:
        return None
    import mlflow
    import mlflow.tensorflow

    logger.flush()  # the model is linked to the run's metrics as of now
    mlflow.set_tracking_uri(logger.target.tracking_uri)
    return mlflow.tensorflow.log_model(model, name=name, run_id=logger.target.run_id, **kwargs)


def commit(metrics: Mapping[str, float], step: int, tags: Mapping[str, Any]) -> None:
    """Rank 0: write ``metrics`` at ``step`` and ``tags`` in one ``log_batch`` call (one
    transaction on a SQL store, one request to a server), after everything queued before.

    Used to move the latest-checkpoint tag together with the epoch's metrics: a crash leaves
    both or neither, so a resumed run neither repeats nor skips a step.
    """
    logger = _require()
    if logger is None:
        return
    from mlflow.entities import Metric, RunTag

    logger.flush()
    ts = int(time.time() * 1000)
    logger.client.log_batch(
        logger.target.run_id,
        metrics=[Metric(k, float(v), ts, int(step)) for k, v in metrics.items()],
        tags=[RunTag(k, str(v)) for k, v in tags.items()],
        synchronous=True,
    )


def flush() -> None:
    """Wait until everything queued so far is in the tracking store (rank 0 only)."""
    logger = _require()
    if logger is not None:
        logger.flush()

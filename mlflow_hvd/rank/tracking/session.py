"""Rank side: this process's tracking session for the current job, as one object with
explicit states, and rank 0's logger (the delivery thread, its spool, the params it knows).

The worker entry point configures the session before the user's function and shuts it down
after it, on every path (:func:`configure`, :func:`shutdown`); :mod:`.api` and MLflow's
store for the job (:mod:`.store`) ask it for the logger and the job's run as this rank
logged it (:class:`~.job_run.JobRun`, on every rank). One job at a time runs in a process,
so there is one session per process.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import sys
import threading
from typing import Any

from mlflow_hvd.common import scratch
from mlflow_hvd.common.tracking_server import (
    check_authorized,
    check_local_artifacts,
    check_server_reachable,
    is_http,
    is_outage,
    run_facts,
)
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.credentials import ALL_VARS as CREDENTIAL_VARS
from mlflow_hvd.protocol.messages import TrackingTarget, UndeliveredTracking
from mlflow_hvd.rank import context
from mlflow_hvd.rank.tracking.delivery import Delivery
from mlflow_hvd.rank.tracking.job_run import JobRun
from mlflow_hvd.rank.tracking.sender import Sender

log = logging.getLogger(__name__)

# MLflow's HTTP client retries for minutes by default; rank 0 retries by itself (with no
# limit on time while training) so each call is kept short. Set them to override.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


class SessionState(enum.Enum):
    """``OFF -> READY -> LOGGING -> CLOSING -> OFF``. OFF: no job, or one that does not track
    (every call is a no-op); READY: configured, rank 0's logger not made yet (a job that
    never logs never imports MLflow); LOGGING: rank 0's logger runs; CLOSING: delivering
    what is left (a SIGTERM then finishes that delivery, sooner)."""

    OFF = "off"
    READY = "ready"
    LOGGING = "logging"
    CLOSING = "closing"


class RankLogger:
    """Rank 0's logging state: the delivery thread, its spool and the params it knows."""

    def __init__(self, target: TrackingTarget, host: str, job_run: JobRun) -> None:
        self.target, self.host, self.job_run = target, host, job_run
        # metric/param/tag batches go through the driver (no MLflow client on rank 0 for
        # them); the client is created only for artifacts, models and restarts
        self.sender = Sender(target, context.connector())
        if not self.sender.relayed:  # no driver to write: import MLflow here (see Sender)
            _ = self.sender.client
        # Params already in the run (e.g. logged by `mlflow run`): same value is a no-op,
        # a different one is refused here rather than failing later in the background.
        # During an outage they are unknown; the store then refuses a conflict itself.
        self._params: dict[str, str] = {}
        self.source_tags: dict[str, str] = {}  # the driver's program, for log_model
        self.last_step = 0  # the latest step logged: a model is linked to its metrics
        # after a resume from a snapshot: per metric key, the latest step the run has (the
        # steps since the snapshot run again; their values are not logged twice)
        self.repeated_through: dict[str, int] = {}
        self._artifacts_checked = False
        facts = target.facts
        if facts is None:  # a restarted attempt: ask the server what the run has now
            try:
                run = self.client.get_run(target.run_id)
            except Exception as exc:
                if not is_outage(exc):
                    raise
            else:
                facts = run_facts(run)
        if facts is not None:
            self._params = dict(facts.params)
            self.source_tags = dict(facts.source_tags)
        self.spool = scratch.new_dir("spool")
        self.delivery = Delivery(target, self.sender, self.spool)

    @property
    def client(self) -> Any:
        """An ``MlflowClient`` for the run's store (imports MLflow on first use)."""
        return self.sender.client

    def put(self, record: rec.Record) -> None:
        """Queue a record for delivery, and keep it in the job's run as this rank sees it."""
        self.job_run.add((record,))
        self.delivery.put(record)

    def put_artifact(self, path: str, artifact_dir: str) -> None:
        """Queue a staged file for upload from rank 0.

        MLflow is imported here, on the caller's thread, before the delivery thread needs
        it: MLflow's package imports itself in cycles that break when two threads import
        it at once (the training code may be importing ``mlflow.models`` right then)."""
        self.check_artifacts()
        _ = self.sender.artifacts
        self.put(rec.Artifact(path, artifact_dir))

    def check_artifacts(self) -> None:
        """Raise :class:`TrackingError` if the run's artifacts are on the driver's disk and
        this host does not see it (checked once)."""
        if not self._artifacts_checked:
            check_local_artifacts(self.target.local_artifacts, f"rank 0 on host {self.host}")
            self._artifacts_checked = True

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

    def flush(self, timeout: float | None = None) -> None:
        self.delivery.flush(self.target.tracking_timeout if timeout is None else timeout)

    def close(self, timeout: float, host: str) -> tuple[UndeliveredTracking | None, str]:
        try:
            return self.delivery.close(timeout, host)
        finally:
            self.sender.close()
            shutil.rmtree(self.spool, ignore_errors=True)


class Session:
    """The tracking session of this process (see the module docstring). ``state`` changes
    only in :meth:`configure`, :meth:`logger` and :meth:`shutdown`, under a re-entrant lock
    (the SIGTERM handler may interrupt a holder)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.state = SessionState.OFF
        self.target: TrackingTarget | None = None  # every rank knows the run
        self.job_run: JobRun | None = None  # the run as this rank logged it (every rank)
        self._said = False  # a rank other than 0 said that its MLflow writes are dropped
        self.rank = 0
        self.host = ""
        self._logger: RankLogger | None = None
        self._monitor: Any = None

    def configure(self, target: TrackingTarget | None, rank: int, local_rank: int,
                  host: str) -> None:
        """-> READY (a job that tracks) or OFF.

        Raises:
            TrackingError: On rank 0, a tracking server that does not accept connections
                from this host (checked before training, not after it).
        """
        if target is not None and rank == 0:
            for key, value in HTTP_DEFAULTS.items():
                os.environ.setdefault(key, value)
            check_server_reachable(target.tracking_uri, f"rank 0 on host {host}")
            _check_authorized(target, host)
        with self._lock:
            self.target, self.rank, self.host, self._logger = target, rank, host, None
            self.job_run = JobRun(target, rank) if target is not None else None
            self._said = False
            self._move(SessionState.OFF if target is None else SessionState.READY)
            if target is not None and target.system_metrics and local_rank == 0:
                if rank == 0 or not target.authenticated:
                    self._monitor = _start_system_metrics(target, host)
                else:  # the credentials are rank 0's alone
                    sys.stderr.write(
                        f"mlflow_hvd: no system metrics from {host}: the tracking server "
                        "takes credentials, which only rank 0 receives\n")

    def is_logging_rank(self) -> bool:
        """The one gate: rank 0 of a job that tracks, before its shutdown."""
        return self.rank == 0 and self.state in (SessionState.READY, SessionState.LOGGING)

    def drop(self, what: str) -> None:
        """A rank other than 0 was asked to write ``what``: say once per job that its
        writes go nowhere."""
        if not self._said and self.target is not None:
            self._said = True
            sys.stderr.write(
                f"mlflow_hvd: rank {self.rank}: MLflow calls on this rank write nothing (only "
                f"rank 0 logs, into the job's run {self.target.run_id}); the first wrote "
                f"{what}\n")

    def logger(self) -> RankLogger | None:
        """Rank 0's logger (made on first use: READY -> LOGGING), None elsewhere."""
        logger = self._logger
        if logger is not None or not self.is_logging_rank():  # per-step calls: no lock
            return logger if self.state is SessionState.LOGGING else None
        with self._lock:
            if (self.state is SessionState.READY and self.target is not None
                    and self.job_run is not None):
                self._logger = RankLogger(self.target, self.host, self.job_run)
                self._move(SessionState.LOGGING)
            return self._logger

    def shutdown(self, timeout: float | None) -> tuple[UndeliveredTracking | None, str]:
        """-> CLOSING: deliver what is queued within ``timeout`` (default: the job's
        ``tracking_timeout``), then -> OFF. Called again while CLOSING (a SIGTERM during the
        shutdown), it finishes the same delivery with the new, shorter deadline.

        Returns:
            (what could not be delivered, or None; a refusal message, or "").
        """
        with self._lock:
            logger, monitor = self._logger, self._monitor
            self._monitor = None
            if self.state is not SessionState.OFF:
                self._move(SessionState.CLOSING)
        if monitor is not None:
            try:
                monitor.finish()
            except Exception as exc:  # system metrics are samples, not the job's data: say so
                sys.stderr.write(f"mlflow_hvd: the system-metrics monitor did not stop cleanly "
                                 f"(its last samples may be missing): {exc}\n")
        if logger is None:
            with self._lock:
                self._move(SessionState.OFF)
            return None, ""
        try:
            return logger.close(logger.target.tracking_timeout if timeout is None else timeout,
                                self.host)
        finally:
            with self._lock:
                self._logger = None
                self._move(SessionState.OFF)

    def _move(self, state: SessionState) -> None:
        if state is not self.state:
            log.debug("rank %d: tracking %s -> %s", self.rank, self.state.value, state.value)
            self.state = state


def _check_authorized(target: TrackingTarget, host: str) -> None:
    """Rank 0, before training, against a server that checks who calls (credentials from
    the driver, or TLS): may it read and write the run and reach its artifacts? A wrong
    password, an expired token or an unverifiable certificate fails the job here, not when
    the first checkpoint is uploaded."""
    uri = target.tracking_uri
    if not is_http(uri) or not (uri.startswith("https:")
                                or any(os.environ.get(v) for v in CREDENTIAL_VARS)):
        return
    from mlflow import MlflowClient

    check_authorized(MlflowClient(tracking_uri=uri), target.run_id, f"rank 0 on host {host}",
                     uri, tag=("mlflow_hvd.rank0_host", host))


def _start_system_metrics(target: TrackingTarget, host: str) -> Any:
    """One system-metrics monitor per node (local rank 0), its series named by host."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        target.run_id, sampling_interval=2, node_id=host, tracking_uri=target.tracking_uri
    )
    monitor.start()
    return monitor


SESSION = Session()

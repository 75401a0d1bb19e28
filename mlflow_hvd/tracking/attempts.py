"""Driver side: each attempt of a restarted job, visible in its MLflow run.

``HorovodRunner(max_failures=N)`` runs all attempts in one run. Each start logs metric
``mlflow_hvd.attempt`` (value and step = the attempt, 0 first), each failure its error in
full as ``attempts/attempt_<k>_error.txt``. Every call has a deadline; a failure to record
is warned about and never replaces the job's own outcome.
"""

from __future__ import annotations

import logging
import time

from mlflow_hvd.deadline import call_within
from mlflow_hvd.messages import TrackingTarget

ATTEMPT_METRIC = "mlflow_hvd.attempt"
log = logging.getLogger(__name__)


def error_file(attempt: int) -> str:
    return f"attempts/attempt_{attempt}_error.txt"


def started(target: TrackingTarget, attempt: int, timeout: float) -> None:
    """Record that ``attempt`` starts."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=target.tracking_uri)
    now = int(time.time() * 1000)
    try:
        call_within(timeout, "recording an attempt", client.log_metric, target.run_id,
                    ATTEMPT_METRIC, float(attempt), now, attempt)
    except Exception as exc:
        log.warning("mlflow_hvd: could not record the start of attempt %d in run %s: %s",
                    attempt, target.run_id, exc)


def failed(target: TrackingTarget, attempt: int, error: BaseException, timeout: float) -> None:
    """Keep ``attempt``'s error in full as an artifact of the run."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=target.tracking_uri)
    text = f"{type(error).__name__}: {error}\n"
    try:
        call_within(timeout, "recording a failed attempt", client.log_text, target.run_id,
                    text, error_file(attempt))
    except Exception as exc:
        log.warning("mlflow_hvd: could not store %s in run %s: %s", error_file(attempt),
                    target.run_id, exc)

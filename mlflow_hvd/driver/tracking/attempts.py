"""Driver side: each attempt of a restarted job, visible in its MLflow run.

``HorovodRunner(job=JobConfig(max_failures=N))`` runs all attempts in one run. Each start logs
metrics ``mlflow_hvd.attempt`` (value and step = the attempt, 0 first) and
``mlflow_hvd.world_size`` (its number of ranks, step = the attempt), each failure its error
in full as ``attempts/attempt_<k>_error.txt``. An elastic attempt below ``np`` logs
``mlflow_hvd.slots_back`` (step = the attempt) each time a look for its missing slots
answers otherwise than the one before: 1 once they are back, 0 when they are gone again.
Every call has a deadline and never replaces the job's own outcome: what an unreachable
server did not take is saved in the run's undelivered bundle (:mod:`.undelivered`, sent
later with the replay command), what a store refused is warned about.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mlflow_hvd.common.deadline import call_within
from mlflow_hvd.driver.tracking import undelivered
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.messages import TrackingTarget

ATTEMPT_METRIC = "mlflow_hvd.attempt"
WORLD_SIZE_METRIC = "mlflow_hvd.world_size"
SLOTS_BACK_METRIC = "mlflow_hvd.slots_back"


def error_file(attempt: int) -> str:
    return f"attempts/attempt_{attempt}_error.txt"


def started(target: TrackingTarget, attempt: int, world_size: int, timeout: float,
            root: str) -> None:
    """Record that ``attempt`` starts on ``world_size`` ranks."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    values = {ATTEMPT_METRIC: float(attempt), WORLD_SIZE_METRIC: float(world_size)}
    _record(target, timeout, root, f"recording the start of attempt {attempt}",
            ", ".join(f"metric {k}={v:g}" for k, v in values.items()),
            [rec.Metric(k, v, now, attempt) for k, v in values.items()], [],
            lambda client: client.log_batch(
                target.run_id, metrics=[Metric(k, v, now, attempt) for k, v in values.items()]))


def slots_seen(target: TrackingTarget, attempt: int, back: bool, timeout: float,
               root: str) -> None:
    """Record that a look during ``attempt`` found its missing slots ``back`` (or gone)."""
    from mlflow.entities import Metric

    now, value = int(time.time() * 1000), float(back)
    _record(target, timeout, root, f"recording the slots seen during attempt {attempt}",
            f"metric {SLOTS_BACK_METRIC}={value:g}",
            [rec.Metric(SLOTS_BACK_METRIC, value, now, attempt)], [],
            lambda client: client.log_batch(
                target.run_id, metrics=[Metric(SLOTS_BACK_METRIC, value, now, attempt)]))


def failed(
    target: TrackingTarget, attempt: int, error: BaseException, timeout: float, root: str
) -> None:
    """Keep ``attempt``'s error in full as an artifact of the run."""
    text = f"{type(error).__name__}: {error}\n"
    folder, name = error_file(attempt).split("/")
    _record(target, timeout, root, f"recording the failure of attempt {attempt}",
            error_file(attempt), [rec.Artifact(name, folder)], [(name, text.encode())],
            lambda client: client.log_text(target.run_id, text, error_file(attempt)))


def _record(
    target: TrackingTarget,
    timeout: float,
    root: str,
    doing: str,
    missing: str,
    records: Sequence[rec.Record],
    files: Sequence[tuple[str, bytes]],
    write: Callable[[Any], object],
) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=target.tracking_uri)
    try:
        call_within(timeout, doing, write, client)
    except Exception as exc:
        undelivered.keep_or_warn(exc, root, target, f"{doing} in run {target.run_id}",
                                 missing, records, files, timeout=timeout)

"""Rank 0: checkpoints as MLflow artifacts, in the layout of MLflow's own Keras checkpointing.

Layout (as ``mlflow.tensorflow.autolog(checkpoint=True)`` writes it, so
``mlflow.tensorflow.load_checkpoint(run_id=..., epoch=...)`` reads ours too)::

    checkpoints/epoch_<N>/checkpoint.keras          model + optimizer state
    checkpoints/epoch_<N>/checkpoint_metrics.json   metrics, "epoch", "global_step"
    tag mlflow.latest_checkpoint_artifact = checkpoints/epoch_<N>/checkpoint.keras

Epochs are Keras' 0-based epoch indices. The tag is written last, after the files are
uploaded and in one ``log_batch`` with the epoch's metrics, so it always points at a
complete checkpoint whose metrics are logged.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from mlflow_hvd import scratch
from mlflow_hvd.tracking import rank_logger as tracking

CHECKPOINT_DIR = "checkpoints"
MODEL_FILE = "checkpoint.keras"
METRICS_FILE = "checkpoint_metrics.json"
LATEST_TAG = "mlflow.latest_checkpoint_artifact"
_EPOCH_RE = re.compile(rf"^{CHECKPOINT_DIR}/epoch_(\d+)/")


@dataclass(frozen=True)
class CheckpointRef:
    """A checkpoint of a run: which epoch, and the artifact path of its model file."""

    run_id: str
    epoch: int
    artifact_path: str


def epoch_dir(epoch: int) -> str:
    return f"{CHECKPOINT_DIR}/epoch_{epoch}"


def save(
    model: Any,
    epoch: int,
    global_step: int,
    metrics: dict[str, float],
    log_metrics: bool = False,
) -> None:
    """Rank 0: upload model+optimizer and metrics for ``epoch``, then move the latest tag.

    With ``log_metrics``, the epoch's metrics (step = epoch) are written in the same
    ``log_batch`` as the tag, so metrics and the resume point always agree. A no-op on
    other ranks (the :mod:`mlflow_hvd.tracking` gate).
    """
    if not tracking.is_logging_rank():
        return
    with scratch.owned_dir("ckpt") as tmp:
        model_path = os.path.join(tmp, MODEL_FILE)
        model.save(model_path)
        metrics_path = os.path.join(tmp, METRICS_FILE)
        with open(metrics_path, "w") as f:
            json.dump({**metrics, "epoch": epoch, "global_step": global_step}, f)
        tracking.log_artifact(model_path, epoch_dir(epoch))
        tracking.log_artifact(metrics_path, epoch_dir(epoch))
    tracking.commit(
        metrics if log_metrics else {}, epoch, {LATEST_TAG: f"{epoch_dir(epoch)}/{MODEL_FILE}"}
    )


def latest(run_id: str, tracking_uri: str | None = None) -> CheckpointRef | None:
    """The run's latest complete checkpoint, or None if it has none."""
    from mlflow import MlflowClient

    run = MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
    path = run.data.tags.get(LATEST_TAG)
    if not path:
        return None
    m = _EPOCH_RE.match(path)
    if m is None:
        return None  # a best-only checkpoint of MLflow autolog: no epoch to resume from
    return CheckpointRef(run_id, int(m.group(1)), path)


def download(ref: CheckpointRef, dst: str, tracking_uri: str | None = None) -> str:
    """Download the checkpoint's model file into ``dst``; returns the local path."""
    from mlflow import MlflowClient

    return str(
        MlflowClient(tracking_uri=tracking_uri).download_artifacts(
            ref.run_id, ref.artifact_path, dst
        )
    )

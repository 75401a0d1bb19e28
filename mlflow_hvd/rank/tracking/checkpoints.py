"""Rank 0: checkpoints as MLflow artifacts, in the layout of MLflow's own Keras checkpointing
(:mod:`mlflow_hvd.protocol.checkpoint_layout`).

Epochs are Keras' 0-based epoch indices. The tag is written last, after the files are
uploaded and in one ``log_batch`` with the epoch's metrics, so it always points at a
complete checkpoint whose metrics are logged.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mlflow_hvd.common import scratch
from mlflow_hvd.protocol.checkpoint_layout import (
    LATEST_TAG,
    METRICS_FILE,
    MODEL_FILE,
    CheckpointRef,
    epoch_dir,
    model_path,
    parse,
)
from mlflow_hvd.rank.tracking import api as tracking_api

__all__ = ["LATEST_TAG", "CheckpointRef", "download", "latest", "save"]


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
    if not tracking_api.is_logging_rank():
        return
    with scratch.owned_dir("ckpt") as tmp:
        local_model = os.path.join(tmp, MODEL_FILE)
        model.save(local_model)
        metrics_path = os.path.join(tmp, METRICS_FILE)
        with open(metrics_path, "w") as f:
            json.dump({**metrics, "epoch": epoch, "global_step": global_step}, f)
        tracking_api.log_artifact(local_model, epoch_dir(epoch))
        tracking_api.log_artifact(metrics_path, epoch_dir(epoch))
    tracking_api.commit(metrics if log_metrics else {}, epoch, {LATEST_TAG: model_path(epoch)})


def latest(run_id: str, tracking_uri: str | None = None) -> CheckpointRef | None:
    """The run's latest complete checkpoint, or None if it has none."""
    from mlflow import MlflowClient

    run = MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
    return parse(run_id, run.data.tags.get(LATEST_TAG))


def download(ref: CheckpointRef, dst: str, tracking_uri: str | None = None) -> str:
    """Download the checkpoint's model file into ``dst``; returns the local path."""
    from mlflow import MlflowClient

    return str(
        MlflowClient(tracking_uri=tracking_uri).download_artifacts(
            ref.run_id, ref.artifact_path, dst
        )
    )

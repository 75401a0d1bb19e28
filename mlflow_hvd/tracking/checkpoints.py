"""Rank side (rank 0, inside the training function): checkpoints as MLflow artifacts, for
custom training loops (public path):
``save(model, epoch, global_step, metrics)``, ``latest(run_id)``, ``download(ref, dst)``.
The code is :mod:`mlflow_hvd.rank.tracking.checkpoints`; the layout
:mod:`mlflow_hvd.protocol.checkpoint_layout`."""

from mlflow_hvd.rank.tracking.checkpoints import (
    LATEST_TAG,
    CheckpointRef,
    download,
    latest,
    save,
)

__all__ = ["LATEST_TAG", "CheckpointRef", "download", "latest", "save"]

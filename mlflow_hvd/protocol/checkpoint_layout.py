"""Where a run keeps its checkpoints: the layout of MLflow's own Keras checkpointing.

As ``mlflow.tensorflow.autolog(checkpoint=True)`` writes it, so
``mlflow.tensorflow.load_checkpoint(run_id=..., epoch=...)`` reads ours too::

    checkpoints/epoch_<N>/checkpoint.keras          model + optimizer state
    checkpoints/epoch_<N>/checkpoint_metrics.json   metrics, "epoch", "global_step"
    tag mlflow.latest_checkpoint_artifact = checkpoints/epoch_<N>/checkpoint.keras

A PyTorch job's model file is ``checkpoint.pt`` instead (``torch.save`` of the model's and
the optimizer's ``state_dict``), in the same place; a sharded one (``torch.distributed
.checkpoint``, each rank's part in a file of its own) is the directory ``checkpoint.dcp``,
which the tag then names.

Rank 0 writes it (:mod:`mlflow_hvd.rank.tracking.checkpoints`); the driver reads the tag to
tell rank 0 whether there is a checkpoint to resume from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CHECKPOINT_DIR = "checkpoints"
MODEL_FILE = "checkpoint.keras"
TORCH_FILE = "checkpoint.pt"
TORCH_SHARDED_DIR = "checkpoint.dcp"  # torch.distributed.checkpoint's files
METRICS_FILE = "checkpoint_metrics.json"
LATEST_TAG = "mlflow.latest_checkpoint_artifact"
_EPOCH_RE = re.compile(rf"^{CHECKPOINT_DIR}/epoch_(\d+)/")


@dataclass(frozen=True)
class CheckpointRef:
    """A checkpoint of a run: which epoch, and the artifact path of its model file (or
    directory)."""

    run_id: str
    epoch: int
    artifact_path: str


def epoch_dir(epoch: int) -> str:
    """The artifact directory of ``epoch``'s checkpoint."""
    return f"{CHECKPOINT_DIR}/epoch_{epoch}"


def model_path(epoch: int, file_name: str = MODEL_FILE) -> str:
    """The artifact path of ``epoch``'s model file (the value of :data:`LATEST_TAG`)."""
    return f"{epoch_dir(epoch)}/{file_name}"


def parse(run_id: str, latest_tag: str | None) -> CheckpointRef | None:
    """The checkpoint a run's :data:`LATEST_TAG` names, or None: no tag, or a best-only
    checkpoint of MLflow's autolog (no epoch to resume from)."""
    if not latest_tag:
        return None
    m = _EPOCH_RE.match(latest_tag)
    return None if m is None else CheckpointRef(run_id, int(m.group(1)), latest_tag)

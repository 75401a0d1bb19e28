"""Rank 0: checkpoints as MLflow artifacts, in the layout of MLflow's own Keras checkpointing
(:mod:`mlflow_hvd.protocol.checkpoint_layout`).

Epochs are Keras' 0-based epoch indices. The tag is written last, after the files are
uploaded and in one ``log_batch`` with the epoch's metrics, so it always points at a
complete checkpoint whose metrics are logged.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
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
from mlflow_hvd.rank import identity
from mlflow_hvd.rank.tracking import api as tracking_api

__all__ = ["LATEST_TAG", "WORLD_SIZE", "CheckpointRef", "download", "latest", "lr_rescale",
           "save", "save_files", "save_with", "to_resume"]


def save(
    model: Any,
    epoch: int,
    global_step: int,
    metrics: dict[str, float],
    log_metrics: bool = False,
    epochs: int | None = None,
) -> None:
    """Rank 0: upload model+optimizer and metrics for ``epoch``, then move the latest tag.

    With ``log_metrics``, the epoch's metrics (step = epoch) are written in the same
    ``log_batch`` as the tag, so metrics and the resume point always agree. ``epochs``:
    how many epochs the loop runs, if it knows (an elastic job that runs on fewer ranks
    then grows back at this checkpoint unless it is the last; without it, at the next
    one). A no-op on other ranks (the :mod:`mlflow_hvd.tracking` gate).
    """
    save_with(model.save, MODEL_FILE, epoch, global_step, metrics, log_metrics, epochs)


def save_with(
    write: Callable[[str], object],
    file_name: str,
    epoch: int,
    global_step: int,
    metrics: dict[str, float],
    log_metrics: bool = False,
    epochs: int | None = None,
) -> None:
    """:func:`save` for any framework: ``write(path)`` writes the model file, named
    ``file_name`` in the checkpoint's directory. A no-op on other ranks."""
    if not tracking_api.is_logging_rank():
        return
    with scratch.owned_dir("ckpt") as tmp:
        local_model = os.path.join(tmp, file_name)
        write(local_model)
        tracking_api.log_artifact(local_model, epoch_dir(epoch))
    _commit(epoch, global_step, metrics, log_metrics, model_path(epoch, file_name), epochs)


def save_files(
    deliver: Callable[[Callable[[str], None]], object],
    dir_name: str,
    epoch: int,
    global_step: int,
    metrics: dict[str, float],
    log_metrics: bool = False,
    epochs: int | None = None,
) -> None:
    """:func:`save` of a checkpoint made of several files, which arrive one at a time:
    ``deliver(upload)`` calls ``upload(path)`` for each (the file is copied into the upload
    queue at once: the caller may delete it then), and they go into the directory
    ``dir_name`` of the checkpoint, which the latest tag then names. A no-op on other
    ranks."""
    if not tracking_api.is_logging_rank():
        return
    folder = f"{epoch_dir(epoch)}/{dir_name}"
    deliver(lambda path: tracking_api.log_artifact(path, folder))
    _commit(epoch, global_step, metrics, log_metrics, folder, epochs)


def _commit(epoch: int, global_step: int, metrics: dict[str, float], log_metrics: bool,
            latest: str, epochs: int | None) -> None:
    """The checkpoint's metrics file, then the tag naming ``latest`` with the epoch's
    metrics (if ``log_metrics``) in one write, after the checkpoint's files; the commit
    says whether ``epoch`` is the loop's last of ``epochs`` (None: not known)."""
    with scratch.owned_dir("ckpt") as tmp:
        metrics_path = os.path.join(tmp, METRICS_FILE)
        with open(metrics_path, "w") as f:
            # the job's size: a resume on another number of ranks (an elastic job) rescales
            # the learning rate the optimizer's state brings back (:func:`lr_rescale`)
            me = identity.current()
            size = me.size if me.in_worker else 0
            json.dump({**metrics, "epoch": epoch, "global_step": global_step,
                       **({WORLD_SIZE: size} if size else {})}, f)
        tracking_api.log_artifact(metrics_path, epoch_dir(epoch))
    last = None if epochs is None else epoch + 1 >= epochs
    tracking_api.commit(metrics if log_metrics else {}, epoch, {LATEST_TAG: latest},
                        epoch=epoch, last=last)


def latest(run_id: str, tracking_uri: str | None = None) -> CheckpointRef | None:
    """The run's latest complete checkpoint, or None if it has none."""
    from mlflow import MlflowClient

    run = MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
    return parse(run_id, run.data.tags.get(LATEST_TAG))


def download(ref: CheckpointRef, dst: str, tracking_uri: str | None = None) -> str:
    """Download the checkpoint's model file (or directory) into ``dst``; returns the local
    path.

    From the run's artifact repository itself: in a rank, ``MlflowClient``'s per-run cache
    of repositories holds the job's own (:mod:`.artifacts`)."""
    from mlflow import MlflowClient
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    root = MlflowClient(tracking_uri=tracking_uri).get_run(ref.run_id).info.artifact_uri
    repo = get_artifact_repository(root, tracking_uri=tracking_uri)
    return str(repo.download_artifacts(ref.artifact_path, dst))


WORLD_SIZE = "world_size"  # in a checkpoint's metrics file: the ranks that wrote it


def lr_rescale(ref: CheckpointRef, dst: str, size: int,
               tracking_uri: str | None = None) -> float:
    """The factor that turns the learning rate restored with ``ref``'s optimizer state
    into this job's: ``size`` over the number of ranks that wrote it (1.0 when they were as
    many). Learning rates scaled by the number of workers (``scale_learning_rate``,
    Horovod's step 4) follow a resized elastic job so.

    A checkpoint that does not say how many ranks wrote it (no metrics file, or one without
    the count: written by MLflow's own autolog, or by hand) restores its rate as saved,
    and rank 0 says so on stderr.

    Raises:
        TrackingError: The metrics file is there but could not be read (the server failed
            while restoring): restoring the old size's rate instead would change training
            silently.
    """
    from mlflow import MlflowClient
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    from mlflow_hvd.errors import TrackingError

    root = MlflowClient(tracking_uri=tracking_uri).get_run(ref.run_id).info.artifact_uri
    repo = get_artifact_repository(root, tracking_uri=tracking_uri)
    folder = epoch_dir(ref.epoch)
    path = f"{folder}/{METRICS_FILE}"
    saved = 0
    try:
        if any(f.path == path for f in repo.list_artifacts(folder)):
            with open(repo.download_artifacts(path, dst)) as f:
                saved = int(json.load(f).get(WORLD_SIZE) or 0)
    except Exception as exc:
        raise TrackingError(
            f"could not read {path} of run {ref.run_id}, which says how many ranks wrote the "
            f"checkpoint (to rescale its learning rate for {size}): {type(exc).__name__}: "
            f"{exc}") from exc
    if not saved:
        print(f"mlflow_hvd: the checkpoint of epoch {ref.epoch} does not say how many ranks "
              "wrote it: its learning rate is restored as it was saved", file=sys.stderr)
        return 1.0
    return size / saved


def to_resume(run_id: str | None = None) -> tuple[CheckpointRef | None, str | None]:
    """The checkpoint to resume from: the latest of ``run_id`` (default: the job's own run),
    or None; and the tracking URI to download it from. Asks the server only when the driver
    did not already find the job's run without a checkpoint."""
    target = tracking_api.tracking_target()
    source = run_id or (target.run_id if target else None)
    known_empty = (  # the driver read the job's run just before: no checkpoint in it
        target is not None and source == target.run_id and target.facts is not None
        and not target.facts.has_checkpoint
    )
    uri = target.tracking_uri if target else None
    if source is None or known_empty:
        return None, uri
    return latest(source, uri), uri

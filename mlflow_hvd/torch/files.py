"""Rank side: a framework's own checkpoint (Lightning's ``.ckpt`` file, the directory
Hugging Face's ``Trainer`` saves each ``save_strategy`` step) as a checkpoint of the job's
run, and back on every rank of a retried attempt, on whichever hosts it runs.

A checkpoint directory may hold files that each rank wrote on its own host (``Trainer``
saves the RNG state of every process beside the model): they are gathered to rank 0, which
uploads the whole directory. Files travel between ranks over the job's process group
(:mod:`.sharded`), one chunk at a time.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from mlflow_hvd.common import scratch
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.rank.tracking import api as tracking_api
from mlflow_hvd.rank.tracking import checkpoints
from mlflow_hvd.torch import sharded as sharded_files
from mlflow_hvd.torch import world

__all__ = ["restore_checkpoint_files", "save_checkpoint_files"]


def save_checkpoint_files(path: str, epoch: int, global_step: int,
                          metrics: dict[str, float] | None = None, log_metrics: bool = False,
                          epochs: int | None = None) -> None:
    """Every rank: the checkpoint a framework saved at ``path`` after ``epoch`` (0-based)
    goes into the job's run as ``checkpoints/epoch_<N>/<name of path>``, and the run's
    latest-checkpoint tag names it (with ``metrics`` at step ``epoch`` in the same write if
    ``log_metrics``). Returns once the checkpoint is complete in the run's queue, on every
    rank: a failure after it resumes from it.

    ``path`` is a file rank 0 holds (Lightning's ``trainer.save_checkpoint(path)``), or a
    directory of files: each rank's files in its own ``path`` (a rank may have none there;
    ranks of one host given the same directory send its files once; other names must not
    repeat between ranks) are gathered into it. Under ``torch.distributed`` this is a
    collective; under ``horovod.torch`` only rank 0's files are kept.

    Raises:
        ConfigurationError: No collective is initialised, or rank 0 has nothing at
            ``path``.
    """
    ranks = world.current()
    logging = ranks.broadcast(tracking_api.is_logging_rank()) if ranks.size > 1 else (
        tracking_api.is_logging_rank())
    if not logging:  # tracking off: nothing to keep
        return
    is_dir = os.path.isdir(path)
    if ranks.rank == 0 and not is_dir and not os.path.isfile(path):
        raise ConfigurationError(
            f"save_checkpoint_files({path!r}): rank 0 has no file or directory there: pass "
            "the path the framework saved its checkpoint to, after it saved it")
    if ranks.size > 1:
        is_dir = bool(ranks.broadcast(is_dir))
    name = os.path.basename(os.path.normpath(path))
    gather = is_dir and ranks.kind == "torch.distributed" and ranks.size > 1
    if gather and not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)  # this rank wrote nothing there: it sends nothing
    shared = gather and _shared_with_a_lower_rank(path)  # a collective
    if ranks.rank == 0:
        if not is_dir:
            checkpoints.save_with(lambda dst: shutil.copyfile(path, dst), name, epoch,
                                  global_step, metrics or {}, log_metrics, epochs)
        else:
            checkpoints.save_files(
                lambda upload: sharded_files.to_rank0(path, upload) if gather
                else _each_file(path, upload),
                name, epoch, global_step, metrics or {}, log_metrics, epochs)
    elif shared:  # its files go with the lower rank's: it sends an empty directory
        with scratch.owned_dir("nothing") as empty:
            sharded_files.to_rank0(empty, None)
    elif gather:
        sharded_files.to_rank0(path, None)
    if ranks.size > 1:
        ranks.broadcast(None)  # rank 0 queued the commit: a failure from here resumes here


def _shared_with_a_lower_rank(path: str) -> bool:
    """Whether a lower rank has the same directory ``path`` (ranks on one host given one
    output directory: its files go once). Every rank calls it."""
    import socket

    import torch.distributed as dist

    where = (socket.gethostname(), os.path.realpath(path))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, where)
    return where in every[:dist.get_rank()]


def _each_file(directory: str, upload: Any) -> None:
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full):
            upload(full)


def restore_checkpoint_files(directory: str | None = None,
                             run_id: str | None = None) -> tuple[str | None, int]:
    """Every rank: the latest checkpoint of ``run_id`` (default: the job's run) that
    :func:`save_checkpoint_files` put there, as a local path on this rank, and the epoch to
    continue from; ``(None, 0)`` when the run has no checkpoint (a first attempt). Rank 0
    downloads it and sends it to the others (``torch.distributed``; under ``horovod.torch``
    every rank downloads it). The files go into ``directory`` (default: a private
    directory removed when the rank's process ends).

    Raises:
        ConfigurationError: No collective is initialised.
    """
    ranks = world.current()
    target = directory or scratch.new_dir("resume")
    os.makedirs(target, exist_ok=True)
    found: tuple[str, int, bool] | None = None  # the path under target, epoch, a directory
    if ranks.rank == 0 or ranks.kind != "torch.distributed":
        ref, uri = checkpoints.to_resume(run_id)
        if ref is not None:
            local = checkpoints.download(ref, target, uri)  # keeps the artifact's path
            found = (os.path.relpath(local, target), ref.epoch + 1, os.path.isdir(local))
            if ranks.rank == 0:
                tracking_api.set_tag("mlflow_hvd.resumed_from",
                                     f"{ref.run_id}@epoch_{ref.epoch}")
    if ranks.size > 1 and ranks.kind == "torch.distributed":
        found = ranks.broadcast(found)  # type: ignore[assignment]
        if found is not None:
            relative, _, is_dir = found
            # a directory's files, or the folder of the one file rank 0 downloaded
            folder = os.path.join(target, relative if is_dir else os.path.dirname(relative))
            os.makedirs(folder, exist_ok=True)
            sharded_files.from_rank0(folder)
    if found is None:
        return None, 0
    return os.path.join(target, found[0]), found[1]

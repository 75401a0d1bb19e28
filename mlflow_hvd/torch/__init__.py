"""Rank side (inside the training function): PyTorch training functions under
HorovodRunner, on ``horovod.torch`` or ``torch.distributed`` (DistributedDataParallel, FSDP).

Training code uses ``horovod.torch`` exactly as Horovod documents it, or ``torch.distributed``
as PyTorch documents it. What both leave to the user, this module does for MLflow:

* :func:`save_checkpoint` - rank 0 saves the model's and the optimizer's ``state_dict`` as an
  MLflow artifact of the job's run, with the epoch's metrics in the same write as the
  latest-checkpoint tag (the layout of :mod:`mlflow_hvd.protocol.checkpoint_layout`); an
  FSDP model's full state is gathered to rank 0 first (:mod:`.state`), or with
  ``sharded=True`` each rank's part is saved as it is, for a model too big for one host
  (:mod:`.sharded`);
* :func:`restore_from_checkpoint` - after a failure
  (``HorovodRunner(job=JobConfig(max_failures=...))``), rank 0 loads the run's latest
  checkpoint and every rank learns the epoch to continue from (Horovod's broadcasts then give
  every rank rank 0's state; under torch.distributed every rank is given it);
* :func:`save_checkpoint_files` and :func:`restore_checkpoint_files` - a framework's own
  checkpoint (Lightning's ``.ckpt``, Hugging Face ``Trainer``'s directory) into the job's
  run, and back on every rank of a retried attempt (:mod:`.files`);
* :class:`Snapshots` - the loop's state every N steps on the job's own hosts (never the
  tracking server), and resume from the newest of them or the run's latest checkpoint,
  mid-epoch included (:class:`Position`; :mod:`.snapshots`);
* :func:`log_model` - ``mlflow.pytorch.log_model`` of the trained module into the job's
  run, loadable by another process (the module's class travels by value when it is the
  training code's own, not an installed package's);
* :func:`scale_learning_rate`.

Every function is a no-op (or returns what every rank needs) on ranks other than 0, apart
from the collectives named.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from typing import Any

from mlflow_hvd.common import scratch
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.protocol.checkpoint_layout import TORCH_FILE, TORCH_SHARDED_DIR
from mlflow_hvd.rank.tracking import api as tracking_api
from mlflow_hvd.rank.tracking import checkpoints, requirements
from mlflow_hvd.torch import sharded as sharded_files
from mlflow_hvd.torch import state, world
from mlflow_hvd.torch.files import restore_checkpoint_files, save_checkpoint_files
from mlflow_hvd.torch.snapshots import Position, Snapshots

__all__ = ["Position", "Snapshots", "log_model", "restore_checkpoint_files",
           "restore_from_checkpoint", "save_checkpoint", "save_checkpoint_files",
           "scale_learning_rate"]

CHECKPOINT_KEYS = ("model", "optimizer", "epoch", "global_step")


def scale_learning_rate(learning_rate: float) -> float:
    """``learning_rate`` times the number of ranks: step 4 of Horovod's migration (the
    effective batch is that many times larger), under ``horovod.torch`` or
    ``torch.distributed`` alike.

    Raises:
        ConfigurationError: Neither ``hvd.init()`` nor ``dist.init_process_group()`` ran.
    """
    return learning_rate * world.current().size


def save_checkpoint(model: Any, optimizer: Any, epoch: int, global_step: int,
                    metrics: dict[str, float], log_metrics: bool = True,
                    sharded: bool = False, epochs: int | None = None) -> None:
    """Rank 0: checkpoint ``model`` and ``optimizer`` after ``epoch`` (0-based) into the
    job's run (``checkpoints/epoch_<N>/checkpoint.pt``, a ``torch.save`` of their
    ``state_dict``) and move the latest-checkpoint tag; with ``log_metrics`` (default) the
    epoch's metrics go in the same write at step ``epoch``, so a resumed run repeats and
    skips no step. Call it on every rank: a no-op on other ranks, except that an FSDP
    model's full state is first gathered to rank 0's CPU (a collective). A
    DistributedDataParallel model is saved as its inner module (loadable into a plain
    one).

    ``sharded=True`` (torch.distributed only) is for a model whose whole state does not fit
    one host: each rank saves its own part with ``torch.distributed.checkpoint``
    (``checkpoints/epoch_<N>/checkpoint.dcp/``, a file per rank), and the files reach the
    run through rank 0 one chunk at a time, so no rank holds more than its part (rank 0's
    disk keeps a file until it is uploaded). :func:`restore_from_checkpoint` reads it on
    any number of ranks; ``torch.distributed.checkpoint.load`` reads the downloaded
    directory too.

    ``epochs``: how many epochs the loop runs, if it knows. An elastic job running on
    fewer ranks than ``np`` (``JobConfig(min_np=...)``) grows back at a checkpoint once
    its missing slots are back: with ``epochs`` at this one unless it is the last, without
    it at the next one (the driver cannot tell whether this one is the last).

    Raises:
        ConfigurationError: ``sharded=True`` without ``dist.init_process_group()``.
    """
    if sharded:
        _save_sharded(model, optimizer, epoch, global_step, metrics, log_metrics, epochs)
        return
    is_sharded = state.is_sharded(model)
    if not is_sharded and not tracking_api.is_logging_rank():
        return
    gathered = state.gather(model, optimizer)
    if gathered is None or not tracking_api.is_logging_rank():
        return
    import torch

    gathered.update(epoch=epoch, global_step=global_step)
    checkpoints.save_with(lambda path: torch.save(gathered, path), TORCH_FILE, epoch,
                          global_step, metrics, log_metrics, epochs)


def _save_sharded(model: Any, optimizer: Any, epoch: int, global_step: int,
                  metrics: dict[str, float], log_metrics: bool, epochs: int | None) -> None:
    ranks = world.current()
    if ranks.kind != "torch.distributed":
        raise ConfigurationError(
            "save_checkpoint(sharded=True) saves with torch.distributed.checkpoint: call "
            "dist.init_process_group(...) first. A horovod.torch model is whole on every "
            "rank: save it with sharded=False")
    if not ranks.broadcast(tracking_api.is_logging_rank()):  # tracking off: nothing to keep
        return
    with scratch.owned_dir("dcp") as tmp:
        sharded_files.write(model, optimizer, tmp)
        if ranks.rank == 0:
            checkpoints.save_files(lambda upload: sharded_files.to_rank0(tmp, upload),
                                   TORCH_SHARDED_DIR, epoch, global_step, metrics,
                                   log_metrics, epochs)
        else:
            sharded_files.to_rank0(tmp, None)


def restore_from_checkpoint(model: Any, optimizer: Any, run_id: str | None = None) -> int:
    """Resume: rank 0 loads the latest checkpoint of ``run_id`` (default: the job's own run);
    returns the epoch to continue from (0 without a checkpoint), the same on every rank.
    Call it on every rank.

    Under ``horovod.torch`` rank 0 loads it into ``model`` and ``optimizer``: call it before
    broadcasting the initial state (``hvd.broadcast_parameters`` /
    ``hvd.broadcast_optimizer_state`` from rank 0), which then gives every rank the
    restored state. Under ``torch.distributed`` every rank ends with it: rank 0 sends it to
    the others (a DistributedDataParallel model already broadcast its initial state when it
    was wrapped), and an FSDP model loads each rank's shard of it. A checkpoint written by
    another number of ranks (an elastic job that shrank or grew) is resharded for this
    one's FSDP model; a sharded checkpoint (``save_checkpoint(sharded=True)``, readable
    under torch.distributed only) reaches each rank as rank 0 downloaded it, one chunk at a
    time, and each loads its own part. A checkpoint written by another number of ranks has
    each parameter group's
    restored ``lr`` multiplied by the number of ranks over that number, as
    ``scale_learning_rate`` scales it.

    Raises:
        ConfigurationError: The run's latest checkpoint is not a PyTorch one (a Keras job's),
            or neither collective is initialised.
    """
    ranks = world.current()
    with contextlib.ExitStack() as cleanup:
        start, factor, loaded, files = 0, 1.0, None, ""
        if ranks.rank == 0:
            ref, uri = checkpoints.to_resume(run_id)
            if ref is not None:
                is_dir = ref.artifact_path.endswith("/" + TORCH_SHARDED_DIR)
                if not is_dir and not ref.artifact_path.endswith("/" + TORCH_FILE):
                    raise ConfigurationError(
                        f"the latest checkpoint of run {ref.run_id} is {ref.artifact_path}, "
                        f"not a PyTorch checkpoint ({TORCH_FILE} or {TORCH_SHARDED_DIR}); "
                        "resume it with the framework that wrote it")
                if is_dir and ranks.kind != "torch.distributed":
                    raise ConfigurationError(
                        f"the latest checkpoint of run {ref.run_id} is {ref.artifact_path}, "
                        "a sharded one (torch.distributed.checkpoint): resume it in a job "
                        "that calls dist.init_process_group(...), as the one that wrote it "
                        "did, not under horovod.torch")
                tmp = cleanup.enter_context(scratch.owned_dir("restore"))
                local = checkpoints.download(ref, tmp, uri)
                if is_dir:
                    files = local
                else:
                    import torch

                    loaded = torch.load(local, map_location="cpu", weights_only=True)
                factor = checkpoints.lr_rescale(ref, tmp, ranks.size, uri)
                if factor != 1.0:  # written by another number of ranks: the rate follows
                    print(f"mlflow_hvd: the checkpoint of epoch {ref.epoch} was written by "
                          f"{round(ranks.size / factor)} ranks; the learning rate it "
                          f"restored is scaled by {factor:g} for {ranks.size}",
                          file=sys.stderr)
                start = ref.epoch + 1
                tracking_api.set_tag("mlflow_hvd.resumed_from",
                                     f"{ref.run_id}@epoch_{ref.epoch}")
        if ranks.size > 1:
            start, factor, files = ranks.broadcast((start, factor, files))  # type: ignore[misc]
        if start == 0:
            return 0
        if files:  # a sharded checkpoint: every rank reads its part of its files
            if ranks.rank != 0:
                files = cleanup.enter_context(scratch.owned_dir("restore"))
            sharded_files.from_rank0(files)
            sharded_files.read(model, optimizer, files)
        elif state.is_sharded(model):
            state.load(model, optimizer, loaded)  # every rank: its shard, from rank 0's
        elif ranks.kind == "torch.distributed" and ranks.size > 1:
            state.load(model, optimizer, ranks.broadcast(loaded))  # type: ignore[arg-type]
        elif ranks.rank == 0:  # Horovod: the user's broadcasts give the others rank 0's
            state.load(model, optimizer, loaded)
        else:
            return int(start)
    if factor != 1.0:
        for group in optimizer.param_groups:
            group["lr"] *= factor
    return int(start)


def log_model(model: Any, name: str = "model", **kwargs: Any) -> Any:
    """Rank 0: ``mlflow.pytorch.log_model(model, name=name, ...)`` into the job's run, after
    everything queued and linked to the latest step logged; its pip requirements are the
    installed torch, NumPy and cloudpickle (pass ``pip_requirements``,
    ``extra_pip_requirements`` or ``conda_env`` to choose).

    With an ``input_example`` the format is MLflow's default, ``pt2`` (``torch.export``: a
    traced graph, no code to unpickle when loading). Without one, where MLflow would refuse
    ``pt2``, it is ``pickle`` (MLflow's default on Databricks): the module's class (and what
    its module defines) is then pickled by value when it comes from the training code rather
    than an installed package, so ``mlflow.pytorch.load_model`` works in a process that has
    no copy of that code. ``serialization_format=`` chooses explicitly.

    Returns:
        ``mlflow.models.model.ModelInfo`` on rank 0, None elsewhere.
    """
    if not tracking_api.is_logging_rank():
        return None
    if state.is_sharded(model):
        raise ConfigurationError(
            "log_model of a model sharded with fully_shard: rank 0 holds only its shard. "
            "Log the trained model from its gathered state instead: save_checkpoint gathers "
            "it into the run, and mlflow.pytorch.log_model of an unsharded module loaded "
            "from it")
    model = state.unwrapped(model)  # DistributedDataParallel: the module it trains
    import cloudpickle

    if kwargs.get("input_example") is None:
        kwargs.setdefault("serialization_format", "pickle")
    module = sys.modules.get(type(model).__module__)
    by_value = module is not None and _is_training_code(module)
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return tracking_api.log_flavor_model("mlflow.pytorch", model, name,
                                             requirements.TORCH_PACKAGES, False, kwargs)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def _is_training_code(module: Any) -> bool:
    """Whether ``module`` is the user's own code: a file outside the installed packages
    (``__main__`` is pickled by value anyway)."""
    path = getattr(module, "__file__", None)
    if not path or module.__name__ == "__main__":
        return False
    installed = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    real = os.path.realpath(path)
    return not any(real.startswith(root + os.sep) for root in installed)

"""Rank side (inside the training function): PyTorch training functions under
HorovodRunner.

Training code uses ``horovod.torch`` exactly as Horovod documents it (``hvd.init()``,
``hvd.DistributedOptimizer(opt, named_parameters=...)``, ``hvd.broadcast_parameters``,
``hvd.broadcast_optimizer_state``, a ``DistributedSampler`` per rank). What Horovod leaves to
the user, this module does for MLflow:

* :func:`save_checkpoint` - rank 0 saves the model's and the optimizer's ``state_dict`` as an
  MLflow artifact of the job's run, with the epoch's metrics in the same write as the
  latest-checkpoint tag (the layout of :mod:`mlflow_hvd.protocol.checkpoint_layout`);
* :func:`restore_from_checkpoint` - after a failure
(``HorovodRunner(job=JobConfig(max_failures=...))``),
  rank 0 loads the run's latest checkpoint and every rank learns the epoch to continue from;
  the usual broadcasts then give every rank rank 0's state;
* :func:`log_model` - ``mlflow.pytorch.log_model`` of the trained module into the job's
  run, loadable by another process (the module's class travels by value when it is the
  training code's own, not an installed package's);
* :func:`scale_learning_rate`.

Every function is a no-op (or returns what every rank needs) on ranks other than 0.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Any

from mlflow_hvd.common import scratch
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.protocol.checkpoint_layout import TORCH_FILE
from mlflow_hvd.rank.tracking import api as tracking_api
from mlflow_hvd.rank.tracking import checkpoints, requirements

__all__ = ["log_model", "restore_from_checkpoint", "save_checkpoint", "scale_learning_rate"]

CHECKPOINT_KEYS = ("model", "optimizer", "epoch", "global_step")


def scale_learning_rate(learning_rate: float) -> float:
    """``learning_rate * hvd.size()``: step 4 of Horovod's migration (the effective batch
    is ``size`` times larger)."""
    import horovod.torch as hvd

    return learning_rate * hvd.size()


def save_checkpoint(model: Any, optimizer: Any, epoch: int, global_step: int,
                    metrics: dict[str, float], log_metrics: bool = True) -> None:
    """Rank 0: checkpoint ``model`` and ``optimizer`` after ``epoch`` (0-based) into the
    job's run (``checkpoints/epoch_<N>/checkpoint.pt``, a ``torch.save`` of their
    ``state_dict``) and move the latest-checkpoint tag; with ``log_metrics`` (default) the
    epoch's ``metrics`` go in the same write at step ``epoch``, so a resumed run repeats and
    skips no step. A no-op on other ranks: call it on every rank."""
    if not tracking_api.is_logging_rank():
        return
    import torch

    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "epoch": epoch, "global_step": global_step}
    checkpoints.save_with(lambda path: torch.save(state, path), TORCH_FILE, epoch,
                          global_step, metrics, log_metrics)


def restore_from_checkpoint(model: Any, optimizer: Any, run_id: str | None = None) -> int:
    """Resume: rank 0 loads the latest checkpoint of ``run_id`` (default: the job's own run)
    into ``model`` and ``optimizer``; returns the epoch to continue from (0 without a
    checkpoint), the same on every rank.

    Call on every rank before broadcasting the initial state
    (``hvd.broadcast_parameters`` / ``hvd.broadcast_optimizer_state`` from rank 0), which then
    gives every rank the restored state. A checkpoint written by another number of ranks
    (an elastic job that shrank or grew) has each parameter group's restored ``lr``
    multiplied by ``hvd.size()`` over that number, as ``scale_learning_rate`` scales it.

    Raises:
        ConfigurationError: The run's latest checkpoint is not a PyTorch one (a Keras job's).
    """
    import horovod.torch as hvd

    start = 0
    if hvd.rank() == 0:
        ref, uri = checkpoints.to_resume(run_id)
        if ref is not None:
            if not ref.artifact_path.endswith("/" + TORCH_FILE):
                raise ConfigurationError(
                    f"the latest checkpoint of run {ref.run_id} is {ref.artifact_path}, not a "
                    f"PyTorch checkpoint ({TORCH_FILE}); resume it with the framework that "
                    "wrote it"
                )
            import torch

            with scratch.owned_dir("restore") as tmp:
                state = torch.load(checkpoints.download(ref, tmp, uri), map_location="cpu",
                                   weights_only=True)
                factor = checkpoints.lr_rescale(ref, tmp, hvd.size(), uri)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if factor != 1.0:  # written by another number of ranks: the rate follows size
                for group in optimizer.param_groups:
                    group["lr"] *= factor
                print(f"mlflow_hvd: the checkpoint of epoch {ref.epoch} was written by "
                      f"{round(hvd.size() / factor)} ranks; the learning rate it restored is "
                      f"scaled by {factor:g} for {hvd.size()}", file=sys.stderr)
            start = ref.epoch + 1
            tracking_api.set_tag("mlflow_hvd.resumed_from", f"{ref.run_id}@epoch_{ref.epoch}")
    if hvd.size() > 1:
        start = int(hvd.broadcast_object(start, root_rank=0))
    return start


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

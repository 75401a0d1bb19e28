"""Rank side, Keras 3: the callback and resume helper that log through the rank-0 gate."""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import keras

from mlflow_hvd.common import scratch
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.rank.context import attempt
from mlflow_hvd.rank.tracking import api as tracking_api
from mlflow_hvd.rank.tracking import checkpoints, job_env, pruning


class MlflowCallback(keras.callbacks.Callback):
    """Rank 0 logs params once, metrics per epoch (step = epoch) and a checkpoint per epoch.

    In a sweep that prunes (``sweep(prune=...)``) every rank also asks, after each epoch,
    whether the sweep stops this trial, and ``fit`` ends there on every rank alike.

    Place it after :class:`~mlflow_hvd.keras.MetricAverageCallback` so the logged metrics
    are global averages. On other ranks it logs nothing.

    Args:
        checkpoint: Save model + optimizer every epoch (MLflow's checkpoint layout).
        log_every_n_steps: Also log ``step_<metric>`` every N batches (global step); the
            values are queued and sent in the background.
        params: Extra params to log once at the start.
    """

    def __init__(
        self,
        checkpoint: bool = True,
        log_every_n_steps: int | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ConfigurationError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        self.checkpoint = checkpoint
        self.log_every_n_steps = log_every_n_steps
        self.extra_params = dict(params or {})
        self._global_step = 0
        self._steps_per_epoch = 0
        self._logged_up_to = -1  # a restarted attempt skips steps its predecessor logged

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not tracking_api.is_logging_rank():
            return
        p = self.params or {}
        opt = self.model.optimizer
        params: dict[str, Any] = {
            "hvd_size": hvd.size(),
            "fit_epochs": p.get("epochs"),
            "fit_steps_per_epoch": p.get("steps"),
        }
        if opt is not None:
            params["opt_name"] = type(opt).__name__
            params["opt_learning_rate"] = float(keras.ops.convert_to_numpy(opt.learning_rate))
        params.update(self.extra_params)
        if self.log_every_n_steps and attempt() > 0:  # a restart: its predecessor logged
            self._logged_up_to = tracking_api.max_logged_step("step_")
        # keep_existing: a resumed run keeps the values of its first attempt
        tracking_api.log_params({k: v for k, v in params.items() if v is not None},
                                keep_existing=True)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._steps_per_epoch = int((self.params or {}).get("steps") or 0)
        self._global_step = epoch * self._steps_per_epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._global_step += 1
        n = self.log_every_n_steps
        if (
            n
            and logs
            and self._global_step % n == 0
            and self._global_step > self._logged_up_to
            and tracking_api.is_logging_rank()
        ):
            # values go to the queue as they are; the logging thread converts them
            tracking_api.log_batch_metrics(
                {f"step_{k}": v for k, v in logs.items()}, step=self._global_step
            )

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if tracking_api.is_logging_rank():
            self._log_epoch(epoch, {k: float(v) for k, v in (logs or {}).items()})
        # in a sweep that prunes, every rank leaves fit after the same epoch (a collective)
        if pruning.should_prune():
            self.model.stop_training = True

    def _log_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        # with MLflow's autolog on, autolog logs the epoch's metrics (same keys, step =
        # epoch): logging them here too would put every value in the run twice
        log_metrics = not job_env.autologging(("tensorflow", "keras"))
        if self.checkpoint:
            # metrics and the resume point in one write: a resume repeats and skips nothing
            # fit knows how many epochs it runs: an elastic job grows back at this
            # checkpoint unless it is the last
            checkpoints.save(self.model, epoch, self._global_step, metrics,
                             log_metrics=log_metrics, epochs=self.params.get("epochs"))
        elif log_metrics:
            tracking_api.log_metrics(metrics, step=epoch)
        # else autolog writes them, through the job's store, which tells the sweep's pruning


def restore_from_checkpoint(model: keras.Model, run_id: str | None = None) -> int:
    """Resume: load the latest checkpoint of ``run_id`` (default: the job's own run) into
    ``model`` on rank 0 and return the epoch to continue from, identical on every rank.

    Call on every rank after ``model.compile`` and before ``model.fit(initial_epoch=...)``;
    :class:`~mlflow_hvd.keras.BroadcastGlobalVariablesCallback` then gives every rank rank
    0's restored weights and optimizer state. Returns 0 when there is no checkpoint. A
    checkpoint written by another number of ranks (an elastic job that shrank or grew) has
    its restored learning rate multiplied by ``hvd.size()`` over that number, as
    ``scale_learning_rate`` scales it (a ``LearningRateSchedule`` is left as it is, said on
    stderr).
    """
    if getattr(model, "optimizer", None) is None:  # on every rank, before any collective
        raise ConfigurationError(
            "compile the model before restore_from_checkpoint: the checkpoint restores the "
            "optimizer's state too"
        )
    initial_epoch = 0
    if hvd.rank() == 0:
        ref, uri = checkpoints.to_resume(run_id)
        if ref is not None:
            model.optimizer.build(model.trainable_variables)
            with scratch.owned_dir("restore") as tmp:
                model.load_weights(checkpoints.download(ref, tmp, uri))
                factor = checkpoints.lr_rescale(ref, tmp, hvd.size(), uri)
            if factor != 1.0:
                _rescale_learning_rate(model.optimizer, factor, ref.epoch)
            initial_epoch = ref.epoch + 1
            tracking_api.set_tag("mlflow_hvd.resumed_from", f"{ref.run_id}@epoch_{ref.epoch}")
    if hvd.size() > 1:
        initial_epoch = int(hvd.broadcast_object(initial_epoch, root_rank=0))
    return initial_epoch


def _rescale_learning_rate(optimizer: Any, factor: float, epoch: int) -> None:
    """The restored learning rate times ``factor`` (see :func:`restore_from_checkpoint`)."""
    import sys

    if isinstance(getattr(optimizer, "_learning_rate", None),
                  keras.optimizers.schedules.LearningRateSchedule):
        print(f"mlflow_hvd: the checkpoint of epoch {epoch} was written by another number of "
              "ranks; its learning rate schedule is left as it is (scale it yourself)",
              file=sys.stderr)
        return
    optimizer.learning_rate = float(optimizer.learning_rate.numpy()) * factor
    print(f"mlflow_hvd: the checkpoint of epoch {epoch} was written by "
          f"{round(hvd.size() / factor)} ranks; the learning rate it restored is scaled by "
          f"{factor:g} for {hvd.size()}", file=sys.stderr)

"""Rank side, Keras 3: Horovod's callbacks (broadcast, metric averaging, warmup, schedule),
with Horovod's signatures; ``mlflow_hvd.keras.callbacks`` is the drop-in for
``horovod.tensorflow.keras.callbacks``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.keras.optimizer import broadcast_variables

# The rate the optimizer applied (scaled by the number of ranks, warmed up, scheduled):
# named apart from the ``learning_rate`` param, which is the single-process base rate.
LR_METRIC = "effective_learning_rate"


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast model weights and optimizer state from ``root_rank`` when training starts.

    Runs in ``on_train_begin``, after Keras has built the optimizer, so optimizer slots (and
    a restored checkpoint's state on rank 0) reach every rank. Also checks that the model
    was not compiled with XLA, whose kernels Horovod does not provide here.
    """

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        if getattr(model, "jit_compile", False):
            raise ConfigurationError(
                "the model was compiled with jit_compile=True (XLA); Horovod's allreduce has "
                "no XLA kernel in this build: compile with jit_compile=False"
            )
        # Layer weights, not model.variables: metric state may already be built on one rank
        # (e.g. by restoring a checkpoint) and not on the others.
        variables = list(model.weights)
        optimizer = model.optimizer
        if optimizer is not None:
            if not optimizer.built:  # Keras builds it lazily at the first step otherwise
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        if hvd.size() > 1:
            counts = hvd.allgather_object(len(variables))
            if len(set(counts)) != 1:
                raise ConfigurationError(
                    f"ranks hold different numbers of variables to broadcast (by rank: "
                    f"{counts}); build the model and optimizer the same way on every rank"
                )
        broadcast_variables(variables, self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch metric in ``logs`` by its average over all ranks.

    Put it before callbacks that read the metrics (logging, checkpoints, early stopping) so
    that rank 0 acts on global values.
    """

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs or hvd.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, int | float))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        averaged = hvd.allreduce(values, op=hvd.Average, name=f"mlflow_hvd.metrics.{epoch}")
        for k, v in zip(keys, averaged.numpy().tolist(), strict=True):
            logs[k] = v


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Horovod's warmup: ramp the learning rate linearly from ``initial_lr / size`` to
    ``initial_lr`` over ``warmup_epochs`` (per batch).

    Large scaled learning rates can diverge in the first steps ("Accurate, Large Minibatch
    SGD", Goyal et al.). ``initial_lr`` is the scaled rate, e.g.
    ``scale_learning_rate(base_lr)``. Same signature as Horovod's; ``momentum_correction``
    and ``verbose`` are accepted for compatibility and have no effect.

    Args:
        initial_lr: Learning rate reached at the end of the warmup.
        warmup_epochs: Length of the warmup, in epochs.
        steps_per_epoch: Batches per epoch on each rank (default: what ``fit`` reports).
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        if warmup_epochs < 0 or (steps_per_epoch is not None and steps_per_epoch < 1):
            raise ConfigurationError(
                f"warmup_epochs must be >= 0 and steps_per_epoch >= 1, got {warmup_epochs} "
                f"and {steps_per_epoch}"
            )
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    @property
    def warmup_steps(self) -> int:
        return self.warmup_epochs * (self.steps_per_epoch or 0)

    def lr_at(self, step: int) -> float:
        if self.warmup_steps == 0 or step >= self.warmup_steps:
            return self.initial_lr
        start = self.initial_lr / hvd.size()
        return start + (self.initial_lr - start) * step / self.warmup_steps

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.steps_per_epoch = _steps_per_epoch(self, self.steps_per_epoch)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch
        if epoch * (self.steps_per_epoch or 0) >= self.warmup_steps:
            # Past the warmup (also after resuming from a checkpoint): the target rate.
            self.model.optimizer.learning_rate.assign(self.initial_lr)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = self._epoch * (self.steps_per_epoch or 0) + batch
        if step <= self.warmup_steps:
            self.model.optimizer.learning_rate.assign(self.lr_at(step))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs[LR_METRIC] = float(self.model.optimizer.learning_rate.numpy())


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's schedule: ``lr = initial_lr * multiplier(epoch)`` from ``start_epoch`` to
    ``end_epoch`` (exclusive); per epoch with ``staircase``, else per batch with a
    fractional epoch. ``multiplier`` is a number or a function of the epoch. Same signature
    as Horovod's; ``momentum_correction`` is accepted and has no effect."""

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        self.initial_lr = float(initial_lr)
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor
            staircase = True
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate.assign(self.initial_lr * self.multiplier(epoch))

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase:
            self.steps_per_epoch = _steps_per_epoch(self, self.steps_per_epoch)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch
        if self.staircase and self._active(epoch):
            self._set(epoch)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and self._active(self._epoch):
            self._set(self._epoch + batch / float(self.steps_per_epoch or 1))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs[LR_METRIC] = float(self.model.optimizer.learning_rate.numpy())


def _steps_per_epoch(callback: keras.callbacks.Callback, given: int | None) -> int:
    steps = given or (callback.params or {}).get("steps")
    if not steps:
        raise ConfigurationError(
            f"{type(callback).__name__} needs steps_per_epoch: fit did not report its number "
            "of steps (a dataset of unknown length); pass steps_per_epoch=..."
        )
    return int(steps)

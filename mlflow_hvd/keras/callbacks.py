"""Rank side, Keras 3: Horovod's callbacks (broadcast, metric averaging, warmup)."""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.keras.optimizer import broadcast_variables


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
    """Ramp the learning rate linearly from ``target_lr / size`` to ``target_lr``.

    Large scaled learning rates can diverge in the first steps ("Accurate, Large Minibatch
    SGD", Goyal et al.); warming up over ``warmup_epochs`` avoids it. ``target_lr`` is
    usually ``scale_learning_rate(base_lr)``.

    Args:
        target_lr: Learning rate reached at the end of the warmup.
        warmup_epochs: Length of the warmup, in epochs.
        steps_per_epoch: Batches per epoch on each rank.
    """

    def __init__(self, target_lr: float, warmup_epochs: int, steps_per_epoch: int) -> None:
        super().__init__()
        if warmup_epochs < 0 or steps_per_epoch < 1:
            raise ConfigurationError(
                f"warmup_epochs must be >= 0 and steps_per_epoch >= 1, got {warmup_epochs} "
                f"and {steps_per_epoch}"
            )
        self.target_lr = float(target_lr)
        self.warmup_steps = warmup_epochs * steps_per_epoch
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def lr_at(self, step: int) -> float:
        if self.warmup_steps == 0 or step >= self.warmup_steps:
            return self.target_lr
        start = self.target_lr / hvd.size()
        return start + (self.target_lr - start) * step / self.warmup_steps

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch
        if epoch * self.steps_per_epoch >= self.warmup_steps:
            # Past the warmup (also after resuming from a checkpoint): the target rate.
            self.model.optimizer.learning_rate.assign(self.target_lr)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = self._epoch * self.steps_per_epoch + batch
        if step <= self.warmup_steps:
            self.model.optimizer.learning_rate.assign(self.lr_at(step))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(self.model.optimizer.learning_rate.numpy())

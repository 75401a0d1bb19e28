"""Rank side, Keras 3: the distributed optimizer, variable broadcast and learning-rate
scaling, on ``horovod.tensorflow`` collectives."""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from mlflow_hvd.errors import ConfigurationError

_WRAPPED = "_mlflow_hvd_distributed"


def scale_learning_rate(learning_rate: float, size: int | None = None) -> float:
    """The seed's step 5: scale the single-process learning rate by the number of workers.

    With ``N`` ranks each seeing its own batch, the effective batch is ``N`` times larger.
    """
    if not learning_rate > 0:
        raise ConfigurationError(f"learning_rate must be > 0, got {learning_rate!r}")
    return float(learning_rate) * (size if size is not None else hvd.size())


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that ``apply`` first averages gradients over all ranks.

    The wrapper is a subclass created on the fly with the same class name, module and config
    as the original, so a model saved with it (``model.save``, MLflow checkpoints,
    ``mlflow.tensorflow.log_model``) loads back as the plain optimizer, without Horovod.

    Returns:
        The same optimizer object, with its class swapped for the distributed subclass.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigurationError(
            f"DistributedOptimizer needs a keras.optimizers.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if getattr(optimizer, _WRAPPED, False):
        return optimizer
    base = type(optimizer)

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        if hvd.size() > 1:
            present = [i for i, g in enumerate(grads) if g is not None]
            reduced = hvd.grouped_allreduce(
                [tf.convert_to_tensor(grads[i]) for i in present], op=hvd.Average
            )
            for i, g in zip(present, reduced, strict=True):
                grads[i] = g
        return base.apply(self, grads, trainable_variables)

    cls = type(base.__name__, (base,), {"apply": apply, _WRAPPED: True})
    cls.__module__ = base.__module__
    cls.__qualname__ = base.__qualname__
    optimizer.__class__ = cls
    return optimizer


def broadcast_variables(variables: list[Any], root_rank: int = 0) -> None:
    """Overwrite ``variables`` on every rank with their values on ``root_rank``."""
    if variables and hvd.size() > 1:
        hvd.broadcast_variables([getattr(v, "value", v) for v in variables], root_rank)

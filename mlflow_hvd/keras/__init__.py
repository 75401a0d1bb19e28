"""A Keras 3 integration for Horovod, built on ``horovod.tensorflow`` collectives (rank side).

``horovod.tensorflow.keras`` no longer works with Keras 3 (the default ``tf.keras`` since
TensorFlow 2.16). This package provides what it used to:

* :func:`DistributedOptimizer` - averages gradients across ranks (one fused
  ``grouped_allreduce`` per step) inside Keras' compiled ``train_step``, so ``model.fit``
  works unchanged (:mod:`.optimizer`);
* :class:`BroadcastGlobalVariablesCallback` - rank 0's model and optimizer state to all;
* :class:`MetricAverageCallback` - epoch metrics averaged over ranks;
* :func:`scale_learning_rate` and :class:`LearningRateWarmupCallback` (:mod:`.callbacks`);
* :class:`MlflowCallback` and :func:`restore_from_checkpoint` (:mod:`.tracking`).

Compile models with ``jit_compile=False``: Horovod's ops have no XLA kernels in this build.
"""

from mlflow_hvd.keras.callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from mlflow_hvd.keras.optimizer import (
    DistributedOptimizer,
    broadcast_variables,
    scale_learning_rate,
)
from mlflow_hvd.keras.tracking import MlflowCallback, restore_from_checkpoint

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "DistributedOptimizer",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "MlflowCallback",
    "broadcast_variables",
    "restore_from_checkpoint",
    "scale_learning_rate",
]

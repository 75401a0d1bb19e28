"""Rank side (inside the training function): a drop-in for ``horovod.tensorflow.keras`` on
Keras 3.

``horovod.tensorflow.keras`` no longer works with Keras 3 (the default ``tf.keras`` since
TensorFlow 2.16): its callbacks fail, and its ``DistributedOptimizer`` trains *without*
averaging gradients, silently. Code written for it runs with one changed import::

    import horovod.tensorflow.keras as hvd   ->   import mlflow_hvd.keras as hvd

This namespace has Horovod's process functions and collectives (from ``horovod.tensorflow``,
which works on Keras 3), and Keras 3 versions of the Keras layer:

* :func:`DistributedOptimizer` - averages gradients across ranks (one fused
  ``grouped_allreduce`` per step) inside Keras' compiled ``train_step`` (:mod:`.optimizer`);
* :func:`DistributedGradientTape` - the same for custom training loops;
* ``callbacks.BroadcastGlobalVariablesCallback``, ``callbacks.MetricAverageCallback``,
  ``callbacks.LearningRateWarmupCallback``, ``callbacks.LearningRateScheduleCallback``
  (:mod:`.callbacks`), also importable from here;
* :func:`broadcast_global_variables`, :func:`load_model`;
* :func:`scale_learning_rate`, :class:`MlflowCallback` and :func:`restore_from_checkpoint`
  (:mod:`.tracking`), which Horovod never had.

Compile models with ``jit_compile=False``: Horovod's ops have no XLA kernels in this build.
"""
# ruff: noqa: E402  (the checks come before TensorFlow's import, which takes seconds)

from mlflow_hvd.common.compat import check_legacy_keras, require_horovod, require_tensorflow

# what this layer is built on, each missing one named with the command that installs it
require_tensorflow("mlflow_hvd.keras (the Keras layer)")
require_horovod("mlflow_hvd.keras (the Keras layer)")
check_legacy_keras("in this process's environment")  # this layer is for Keras 3

from horovod.tensorflow import (
    Average,
    Compression,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    broadcast,
    broadcast_object,
    cross_rank,
    cross_size,
    global_process_set,
    gloo_enabled,
    grouped_allreduce,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    rank,
    reducescatter,
    shutdown,
    size,
)

from mlflow_hvd.keras import callbacks
from mlflow_hvd.keras.callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from mlflow_hvd.keras.optimizer import (
    DistributedGradientTape,
    DistributedOptimizer,
    broadcast_global_variables,
    broadcast_variables,
    load_model,
    scale_learning_rate,
)
from mlflow_hvd.keras.tracking import MlflowCallback, restore_from_checkpoint

__all__ = [
    "Average",
    "BroadcastGlobalVariablesCallback",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "MlflowCallback",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "gloo_enabled",
    "grouped_allreduce",
    "init",
    "is_initialized",
    "join",
    "load_model",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "restore_from_checkpoint",
    "scale_learning_rate",
    "shutdown",
    "size",
]

"""The digits classifier with a custom TensorFlow loop (``tf.GradientTape``) instead of fit.

Same eight steps as examples/digits_keras.py, with ``horovod.tensorflow`` directly:
``hvd.grouped_allreduce`` averages the gradients inside the ``tf.function`` step, the
weights and optimizer slots (built up front) are broadcast from rank 0, rank 0 logs and
checkpoints (weights only: the model is not compiled with an optimizer).

    HorovodRunner(np=2).run(train, epochs=3)
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import digits_keras


def train(epochs: int = 3, batch_size: int = 32, learning_rate: float = 0.001,
          seed: int = 0) -> dict[str, Any]:
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import mlflow_hvd
    from mlflow_hvd import tracking
    from mlflow_hvd.data import shard_arrays
    from mlflow_hvd.keras import broadcast_variables, scale_learning_rate
    from mlflow_hvd.tracking import checkpoints

    hvd.init()  # 1. initialise
    gpus = tf.config.list_physical_devices("GPU")  # 2. one GPU per process, if any
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    keras.utils.set_random_seed(seed + hvd.rank())

    x_train, y_train, x_test, y_test = digits_keras.load_data(seed)
    x, y = shard_arrays([x_train, y_train], hvd.rank(), hvd.size(), seed=seed)  # 3. shard
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)

    model = digits_keras.build_model()
    optimizer = keras.optimizers.Adam(scale_learning_rate(learning_rate))  # 4. scale LR
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        # 5. averaged gradients: one fused allreduce. (hvd.DistributedGradientTape fails on
        # Keras 3 variables: "'Variable' object has no attribute 'ref'".)
        grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    # 6. every rank starts from rank 0's weights and optimizer state
    broadcast_variables(list(model.weights) + list(optimizer.variables), root_rank=0)
    tracking.log_params({"loop": "GradientTape", "hvd_size": hvd.size()}, keep_existing=True)
    global_step = 0
    for epoch in range(epochs):
        losses = []
        for xb, yb in dataset:
            losses.append(float(step(xb, yb)))
            global_step += 1
        mean_loss = float(hvd.allreduce(tf.constant(sum(losses) / len(losses)), op=hvd.Average))
        logits = model(x_test, training=False)
        accuracy = float(tf.reduce_mean(tf.cast(
            tf.equal(tf.argmax(logits, axis=1), tf.cast(y_test, tf.int64)), tf.float32)))
        metrics = {"loss": mean_loss, "val_accuracy": accuracy}
        checkpoints.save(model, epoch, global_step, metrics, log_metrics=True,
                         epochs=epochs)  # 7. rank 0
        if hvd.rank() == 0:  # 8. one rank talks
            mlflow_hvd.log_to_driver(f"epoch {epoch + 1}/{epochs} loss={mean_loss:.4f} "
                                     f"val_accuracy={accuracy:.4f}")
        if tracking.should_prune():  # a sweep that prunes stops every rank here
            break
    return {"val_accuracy": accuracy, "loss": mean_loss}

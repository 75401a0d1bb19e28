"""Databricks' "migrate from single node to distributed" Keras example, with one changed
import.

The training function below is the one of Databricks' HorovodRunner documentation (MNIST
replaced by scikit-learn's bundled 8x8 digits, since nothing can be downloaded here). The
only change needed for Keras 3 is the import line: ``horovod.tensorflow.keras`` trains
without averaging gradients under Keras 3 (and its callbacks fail), so ranks refuse it.
The last line (a checksum of the weights on every rank) is added to show that they agree.

    HorovodRunner(np=2).run(train_hvd, checkpoint_path="/tmp/ckpt.weights.h5")
"""

from __future__ import annotations

from typing import Any

import mlflow_hvd.keras as hvd  # was: import horovod.tensorflow.keras as hvd


def get_dataset(num_classes: int, rank: int = 0, size: int = 1) -> tuple[Any, Any]:
    import numpy as np
    from sklearn.datasets import load_digits
    from tensorflow import keras

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = keras.utils.to_categorical(digits.target, num_classes)
    split = 1400
    x_train, y_train = x[:split][rank::size], y[:split][rank::size]
    n = min(len(x[:split][r::size]) for r in range(size))  # equal shards
    return (x_train[:n], y_train[:n]), (np.asarray(x[split:]), np.asarray(y[split:]))


def get_model(num_classes: int) -> Any:
    from tensorflow.keras import layers, models

    model = models.Sequential()
    model.add(layers.Input((8, 8, 1)))
    model.add(layers.Conv2D(32, kernel_size=(3, 3), activation="relu"))
    model.add(layers.Conv2D(64, (3, 3), activation="relu"))
    model.add(layers.MaxPooling2D(pool_size=(2, 2)))
    model.add(layers.Dropout(0.25))
    model.add(layers.Flatten())
    model.add(layers.Dense(128, activation="relu"))
    model.add(layers.Dropout(0.5))
    model.add(layers.Dense(num_classes, activation="softmax"))
    return model


def train_hvd(
    checkpoint_path: str,
    learning_rate: float = 1.0,
    batch_size: int = 128,
    epochs: int = 2,
    num_classes: int = 10,
) -> list[float]:
    # Tensorflow has given up on pickling. We need to explicitly import its modules inside
    # workers
    import tensorflow as tf
    from tensorflow import keras

    # Initialize Horovod
    hvd.init()

    # Pin GPU to be used to process local rank (one GPU per process)
    # These steps are skipped on a CPU cluster
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    (x_train, y_train), (x_test, y_test) = get_dataset(num_classes, hvd.rank(), hvd.size())
    model = get_model(num_classes)

    # Adjust learning rate based on number of GPUs
    optimizer = keras.optimizers.Adadelta(learning_rate=learning_rate * hvd.size())

    # Use the Horovod Distributed Optimizer
    optimizer = hvd.DistributedOptimizer(optimizer)

    model.compile(optimizer=optimizer, loss="categorical_crossentropy", metrics=["accuracy"])

    # Create a callback to broadcast the initial variable states from rank 0 to all other
    # processes. This is required to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
    ]

    # Save checkpoints only on worker 0 to prevent conflicts between workers
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(checkpoint_path, save_weights_only=True))

    model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        callbacks=callbacks,
        epochs=epochs,
        verbose=2,
        validation_data=(x_test, y_test),
    )
    return list(hvd.allgather_object(float(sum(w.sum() for w in model.get_weights()))))

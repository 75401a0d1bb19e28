"""examples/digits_single.py migrated to Horovod, tracked in MLflow: the eight steps.

Every rank runs :func:`train`; ``HorovodRunner(np=...).run(train, ...)`` (see
mlflow_hvd/cli/train.py) starts the ranks and returns rank 0's result. The numbered comments are
the migration steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (offline), scaled to [0, 1]; 25% held out."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    return x_train, y_train, x_test, y_test


def build_model() -> Any:
    import keras

    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def train(
    epochs: int = 5,
    batch_size: int = 32,
    learning_rate: float = 0.001,
    warmup_epochs: int = 1,
    seed: int = 0,
    data: Any = "digits",
    val: Any = None,
    fail_at_epoch: int | None = None,
    kill_at_epoch: int | None = None,
    log_model: bool = True,
    log_every_n_steps: int = 0,
    run_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train on this rank's shard; returns held-out metrics (rank 0's reach the driver).

    ``data`` is ``"digits"`` (scikit-learn's bundled set, sharded in memory) or a Spark
    DataFrame of ``pixels`` (64 floats) and ``label`` passed to ``run()``, which arrives here
    as this rank's :class:`mlflow_hvd.data.Shard` (``val``: a validation DataFrame, likewise;
    examples/digits_to_parquet.py writes such a data set). ``run_params`` are logged once
    as params (kept if the run already has them, as under ``mlflow run``).
    ``log_every_n_steps`` > 0 also logs per-batch metrics (``step_*``, step = global
    batch). Without ``val``, the validation split is carved out of the bundled training
    data; the test split is only used once, at the end. ``fail_at_epoch`` makes rank 1 (or
    rank 0 when alone) crash at the start of that epoch; ``kill_at_epoch`` makes it SIGKILL
    itself half-way through that epoch, on the job's first attempt only. They exist to
    demonstrate and test resuming from a checkpoint, by hand or with
    ``HorovodRunner(job=JobConfig(max_failures=...))``.
    """
    import os
    import signal
    import time

    started = time.monotonic()
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import mlflow_hvd
    from mlflow_hvd import keras as hvd_keras
    from mlflow_hvd import tracking
    from mlflow_hvd.data import Shard, shard_arrays

    # 1. Initialise Horovod.
    hvd.init()

    # 2. Pin one GPU per process (local rank); skipped on CPU-only machines.
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.experimental.set_memory_growth(gpus[hvd.local_rank()], True)
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    keras.utils.set_random_seed(seed + hvd.rank())

    # 3. Shard the data: every rank a distinct, equal-size shard (remainder dropped).
    x_all, y_all, x_test, y_test = load_data(seed)
    # validation apart from the test set: val_* metrics guide training, test_* judge it
    from sklearn.model_selection import train_test_split

    x_train, x_val, y_train, y_val = train_test_split(
        x_all, y_all, test_size=0.15, random_state=seed, stratify=y_all
    )
    validation: Any = (x_val, y_val)
    if isinstance(data, Shard):  # a DataFrame: this rank's own rows, fed by its Spark task

        def images(shard: Shard) -> Any:  # shuffled anew each epoch, from seed + epoch
            ds = shard.tf_dataset(batch_size, label="label", features=["pixels"], seed=seed)
            return ds.map(lambda x, y: (tf.reshape(x, (-1, 8, 8, 1)), y))

        fit_data: dict[str, Any] = {"x": images(data)}  # knows its steps: no steps_per_epoch
        steps_per_epoch, shard_size = data.steps(batch_size), data.rows
        if isinstance(val, Shard):
            validation = images(val)
    else:
        x_shard, y_shard = shard_arrays([x_train, y_train], hvd.rank(), hvd.size(), seed=seed)
        fit_data = {"x": x_shard, "y": y_shard, "batch_size": batch_size}
        steps_per_epoch = -(-len(x_shard) // batch_size)  # equal on every rank: equal shards
        shard_size = len(x_shard)

    # 4. Scale the learning rate by the number of workers (warmed up from lr).
    scaled_lr = hvd_keras.scale_learning_rate(learning_rate)

    # 5. Wrap the optimizer: gradients are averaged across ranks every step.
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
    model = build_model()
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=False,
    )

    # Resume: continue after the run's latest checkpoint, if it has one.
    initial_epoch = hvd_keras.restore_from_checkpoint(model)
    if initial_epoch:
        mlflow_hvd.log_to_driver(f"resuming at epoch {initial_epoch}")

    tracking.log_params({"shard_size": shard_size}, keep_existing=True)

    class FailAt(keras.callbacks.Callback):
        epoch = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if (
                kill_at_epoch == self.epoch
                and batch == steps_per_epoch // 2
                and mlflow_hvd.attempt() == 0
                and hvd.rank() == min(1, hvd.size() - 1)
            ):
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.epoch = epoch
            if fail_at_epoch is None or epoch != fail_at_epoch:
                return
            # every rank gets here only after rank 0 committed the previous checkpoint
            hvd.allreduce(tf.constant(0.0), name="fail_at_barrier")
            if hvd.rank() == min(1, hvd.size() - 1):
                raise RuntimeError(f"injected failure at the start of epoch {epoch}")

    class Progress(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if hvd.rank() == 0:
                shown = " ".join(f"{k}={float(v):.4f}" for k, v in sorted((logs or {}).items()))
                mlflow_hvd.log_to_driver(f"epoch {epoch + 1}/{epochs} {shown}")

    callbacks = [
        # 6. Broadcast the initial state (weights, optimizer) from rank 0.
        hvd_keras.BroadcastGlobalVariablesCallback(0),
        hvd_keras.LearningRateWarmupCallback(
            scaled_lr, warmup_epochs, steps_per_epoch=steps_per_epoch
        ),
        hvd_keras.MetricAverageCallback(),
        # 7. Checkpoints (and metrics) only on rank 0, as MLflow artifacts.
        hvd_keras.MlflowCallback(
            checkpoint=True, log_every_n_steps=log_every_n_steps or None, params=run_params
        ),
        Progress(),
        FailAt(),
    ]
    fit_started = time.monotonic()
    model.fit(
        **fit_data,
        epochs=epochs,
        initial_epoch=initial_epoch,
        validation_data=validation,
        callbacks=callbacks,
        # 8. Only rank 0 talks: progress bars and logs from one rank, not N.
        verbose=0,
    )
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    now = time.monotonic()
    tracking.log_metrics({"test_loss": loss, "test_accuracy": accuracy,
                          "train_seconds": now - started,  # imports and data included
                          "fit_evaluate_seconds": now - fit_started}, step=epochs - 1)
    # (a trial a sweep pruned needs no model: MlflowCallback ended fit early on every rank)
    if log_model and not tracking.was_pruned():  # rank 0 logs it: signature, input example
        logging_started = time.monotonic()
        tracking.log_model(model, name="model", input_example=x_test[:4])
        tracking.log_metrics({"log_model_seconds": time.monotonic() - logging_started},
                             step=epochs - 1)
    return {"test_loss": float(loss), "test_accuracy": float(accuracy), "epochs": epochs}

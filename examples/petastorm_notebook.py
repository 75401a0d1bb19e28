"""Databricks' HorovodRunner notebook that feeds a Spark DataFrame to Keras through
Petastorm's converter, with its imports changed and nothing else.

The notebook's shape is kept: the converters are made on the driver from a DataFrame split
in Spark, the training function holds them as globals and opens
``make_tf_dataset(..., cur_shard=hvd.rank(), shard_count=hvd.size())`` on each rank, and
``steps_per_epoch = len(converter_train) // (BATCH_SIZE * hvd.size())``. Its flowers
images are replaced by scikit-learn's bundled 8x8 digits (nothing can be downloaded here),
as 64 floats per row. The cache directory the notebook sets is not needed (each rank's shard
is written on its own host) and may stay.

    python examples/petastorm_notebook.py          # np=2 on an embedded local Spark
"""

from __future__ import annotations

import sys
from typing import Any

# --8<-- [start:imports]
import mlflow_hvd.keras as hvd  # was: import horovod.tensorflow.keras as hvd
from mlflow_hvd import HorovodRunner  # was: from sparkdl import HorovodRunner
from mlflow_hvd.petastorm import (  # was: from petastorm.spark import ...
    SparkDatasetConverter,
    make_spark_converter,
)

# --8<-- [end:imports]

BATCH_SIZE = 32
NUM_EPOCHS = 3
converter_train: SparkDatasetConverter | None = None  # made on the driver (make_converters)
converter_val: SparkDatasetConverter | None = None


def digits_frame(spark: Any) -> Any:
    """The digits as a DataFrame: ``id``, ``features`` (64 doubles), ``label_index``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = [(i, [float(v) / 16.0 for v in image], int(label))
            for i, (image, label) in enumerate(zip(digits.data, digits.target, strict=True))]
    return spark.createDataFrame(rows, "id long, features array<double>, label_index int")


# --8<-- [start:converters]
def make_converters(spark: Any) -> None:
    global converter_train, converter_val
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF,
                   "file:///dbfs/ml/tmp/petastorm/cache")
    df_train, df_val = digits_frame(spark).randomSplit([0.85, 0.15], seed=12345)
    converter_train = make_spark_converter(df_train)  # doubles become float32
    converter_val = make_spark_converter(df_val)
# --8<-- [end:converters]


def get_model(lr: float) -> Any:
    from tensorflow import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(learning_rate=lr))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


# --8<-- [start:train]
def train_and_evaluate_hvd(lr: float = 0.001, checkpoint_dir: str = "") -> dict[str, Any]:
    import tensorflow as tf
    from tensorflow import keras

    hvd.init()  # 1. initialize Horovod
    gpus = tf.config.experimental.list_physical_devices("GPU")  # 2. pin one GPU per process
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    model = get_model(lr * hvd.size())  # 4. scale the learning rate, 5. distributed optimizer
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # 6. broadcast
                 hvd.callbacks.MetricAverageCallback()]
    if hvd.rank() == 0 and checkpoint_dir:  # 7. checkpoints on rank 0 only
        callbacks.append(keras.callbacks.ModelCheckpoint(
            f"{checkpoint_dir}/checkpoint-{{epoch}}.weights.h5", save_weights_only=True))

    # 3. each rank reads its own shard
    with converter_train.make_tf_dataset(batch_size=BATCH_SIZE, cur_shard=hvd.rank(),
                                         shard_count=hvd.size()) as train_dataset, \
            converter_val.make_tf_dataset(batch_size=BATCH_SIZE, cur_shard=hvd.rank(),
                                          shard_count=hvd.size()) as val_dataset:
        train_dataset = train_dataset.map(lambda x: (x.features, x.label_index))
        steps_per_epoch = len(converter_train) // (BATCH_SIZE * hvd.size())
        val_dataset = val_dataset.map(lambda x: (x.features, x.label_index))
        validation_steps = max(1, len(converter_val) // (BATCH_SIZE * hvd.size()))
        hist = model.fit(train_dataset, steps_per_epoch=steps_per_epoch, epochs=NUM_EPOCHS,
                         validation_data=val_dataset, validation_steps=validation_steps,
                         callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    return {"val_loss": hist.history["val_loss"], "val_accuracy": hist.history["val_accuracy"],
            "steps_per_epoch": steps_per_epoch,
            "weights": hvd.allgather_object(float(sum(w.sum() for w in model.get_weights())))}
# --8<-- [end:train]


def main(argv: list[str]) -> None:
    import os

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this Python
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    make_converters(spark)
    # --8<-- [start:run]
    result = HorovodRunner(np=2).run(train_and_evaluate_hvd, lr=0.001)
    # --8<-- [end:run]
    print(f"val_loss per epoch {result['val_loss']}, val_accuracy {result['val_accuracy']}")


if __name__ == "__main__":
    main(sys.argv[1:])

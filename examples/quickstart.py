"""A first distributed job: Keras on 2 Horovod ranks in a local Spark session, tracked in
MLflow (docs/quickstart.md).

    python examples/quickstart.py

The data is scikit-learn's bundled 8x8 digits (no download), made a Spark DataFrame; each
rank trains on its own equal shard of it. The run lands in ``sqlite:///mlflow.db`` here:
``mlflow ui --backend-store-uri sqlite:///mlflow.db`` shows it.
"""

from __future__ import annotations

from typing import Any


def train(data: Any, learning_rate: float = 0.001, epochs: int = 3) -> float:
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    from mlflow_hvd import keras as hk

    hvd.init()                                                          # 1. Horovod
    gpus = tf.config.list_physical_devices("GPU")                       # 2. one GPU per rank
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    batches = data.tf_dataset(32, label="label", features=["pixels"])   # 3. this rank's shard
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    lr = hk.scale_learning_rate(learning_rate)                          # 4. lr x ranks
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(lr)),  # 5. averaged
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False)
    history = model.fit(batches, epochs=epochs, verbose=0, callbacks=[
        hk.BroadcastGlobalVariablesCallback(0),                         # 6. rank 0's weights
        hk.MetricAverageCallback(),
        hk.MlflowCallback(checkpoint=True)])      # 7. checkpoints, 8. metrics: rank 0 only
    return float(history.history["accuracy"][-1])


def main() -> None:
    import os
    import sys

    import mlflow
    from pyspark.sql import SparkSession
    from sklearn.datasets import load_digits

    from mlflow_hvd import HorovodRunner

    mlflow.set_tracking_uri("sqlite:///mlflow.db")
    # Spark's Python workers (the ranks' tasks) run this interpreter, not python3 from PATH
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    digits = load_digits()
    rows = [((image.ravel() / 16.0).tolist(), int(label))
            for image, label in zip(digits.images, digits.target, strict=True)]
    data = spark.createDataFrame(rows, "pixels array<float>, label int")

    runner = HorovodRunner(np=2)                     # 2 Spark barrier tasks, one rank each
    accuracy = runner.run(train, data=data, epochs=3)
    print(f"rank 0's training accuracy: {accuracy:.3f}; MLflow run {runner.last_run_id}")


if __name__ == "__main__":
    main()

"""The examples beyond the main one: Parquet input and the custom TensorFlow loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import digits_custom_loop
import digits_keras
import digits_to_parquet
import mlflow
import pytest

from mlflow_hvd.data import parquet_row_count

pytestmark = pytest.mark.slow


def test_the_keras_example_trains_from_a_dataframe_read_by_spark(
    store: str, tmp_path: Path, warm_ranks: Any, spark: Any
) -> None:
    """examples/digits_to_parquet.py's data set read with Spark and passed to run(): each of
    two local ranks trains on its own shard (fed from the DataFrame's partitions to the
    driver's disk), validates on its shard of the validation DataFrame."""
    data = tmp_path / "digits_parquet"
    rows = digits_to_parquet.write(str(data), files=3)
    assert parquet_row_count(str(data)) == rows == 1347
    train, val = spark.read.parquet(str(data)).randomSplit([0.85, 0.15], seed=0)
    runner = warm_ranks
    result = runner.run(digits_keras.train, epochs=2, data=train, val=val, log_model=False)
    run = mlflow.MlflowClient().get_run(runner.last_run_id)
    per_rank = int(run.data.tags["mlflow_hvd.data.data.rows_per_rank"])
    assert run.data.params["shard_size"] == str(per_rank)
    assert int(run.data.tags["mlflow_hvd.data.data.total_rows"]) + int(
        run.data.tags["mlflow_hvd.data.val.total_rows"]) == rows
    assert [m.step for m in mlflow.MlflowClient().get_metric_history(
        run.info.run_id, "val_loss")] == [0, 1]
    assert result["test_accuracy"] > 0.5


def test_custom_gradient_tape_loop(store: str, warm_ranks: Any) -> None:
    runner = warm_ranks
    result = runner.run(digits_custom_loop.train, epochs=2)
    client = mlflow.MlflowClient()
    run = client.get_run(runner.last_run_id)
    assert run.data.params["loop"] == "GradientTape"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1]
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    assert losses[1] < losses[0]
    assert run.data.tags["mlflow.latest_checkpoint_artifact"] == (
        "checkpoints/epoch_1/checkpoint.keras"
    )
    assert result["val_accuracy"] > 0.5

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


def test_parquet_input_each_rank_reads_its_equal_shard(
    store: str, tmp_path: Path, warm_ranks: Any
) -> None:
    data = tmp_path / "digits_parquet"
    rows = digits_to_parquet.write(str(data), files=3)
    assert parquet_row_count(str(data)) == rows == 1347
    runner = warm_ranks
    result = runner.run(digits_keras.train, epochs=2, data=str(data), log_model=False)
    run = mlflow.MlflowClient().get_run(runner.last_run_id)
    assert run.data.params["shard_size"] == str(rows // 2)  # 673 each, 1 row dropped
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

"""The examples beyond the main one: Parquet input, images decoded in loader workers and
the custom TensorFlow loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import digits_custom_loop
import digits_images_torch
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


def test_the_image_example_decodes_pngs_in_loader_workers_on_spark_ranks(
    store: str, spark: Any
) -> None:
    """examples/digits_images_torch.py: a DataFrame of PNG bytes, decoded and augmented in
    two DataLoader worker processes per rank (forkserver), on two Spark ranks."""
    from mlflow_hvd import HorovodRunner

    runner = HorovodRunner(np=2, spark=spark)
    result = runner.run(digits_images_torch.train, data=digits_images_torch.images_frame(spark),
                        epochs=3, log_model=False)
    # every rank the same steps, each epoch its whole shard: len(loader) batches
    assert result["batches_per_epoch"] == [[result["len"]] * 3] * 2
    run = mlflow.MlflowClient().get_run(runner.last_run_id)
    assert run.data.params["loader_workers"] == "2"
    assert int(run.data.tags["mlflow_hvd.data.data.rows_per_rank"]) // 32 == result["len"]
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


def test_the_readmes_example_runs_as_written(
    store: str, tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's (and the docs' home page's) example, copied out and run as it is: two
    Spark barrier tasks train on the Parquet data set's shards; rank 0's loss comes back
    and the run has a checkpoint and a metric per epoch."""
    import re

    from conftest import REPO

    readme = (REPO / "README.md").read_text()
    block = readme.split("<!-- --8<-- [start:example] -->", 1)[1].split(
        "<!-- --8<-- [end:example] -->", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", block, re.S)
    monkeypatch.chdir(tmp_path)
    digits_to_parquet.write("digits_parquet")  # the example's first (commented) line
    # the shared test session's JVM resolves relative paths against its own directory (a
    # user's new session starts in theirs): the one change, the data set's absolute path
    assert code.count('read.parquet("digits_parquet")') == 1
    code = code.replace('"digits_parquet"', repr(str(tmp_path / "digits_parquet")))
    printed: list[Any] = []
    exec(compile(code, "README.md", "exec"),
         {"__name__": "readme_example", "print": printed.append})
    (loss,) = printed
    assert 0.0 < loss < 1.5  # a cross-entropy over 10 classes (2.3 untrained), 3 epochs
    client = mlflow.MlflowClient()
    (run,) = client.search_runs(["0"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.backend"] == "spark"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2]
    assert run.data.metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert run.data.tags["mlflow.latest_checkpoint_artifact"].startswith("checkpoints/epoch_2/")

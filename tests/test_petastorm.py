"""Integration: notebook code written for Petastorm's Spark converter, imports changed to
mlflow_hvd.petastorm, on real ranks of local-cluster[2,1,1024]: the converters held in the
training function's closure are fed to the ranks as DataFrames passed to run() are (each
rank its own shard, written on its executor's host), Keras fit and a horovod.torch loop
train on them, and what the feed cannot honour is refused by name."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import workers

from mlflow_hvd import HorovodRunner, TrackingConfig
from mlflow_hvd.errors import ConfigurationError, DataInputError
from mlflow_hvd.petastorm import SparkDatasetConverter, make_spark_converter

pytestmark = pytest.mark.spark


def frame(spark: Any, rows: int, partitions: int) -> Any:
    """Doubles (made float32 by the converter), an array of 4 doubles, an int label."""
    from pyspark.sql import functions as F

    return spark.range(0, rows, 1, partitions).select(
        "id",
        F.array(*[F.rand(seed=i) for i in range(4)]).alias("x"),
        (F.col("id") % 2).cast("double").alias("label"),
    )


def test_a_petastorm_notebook_trains_with_keras_and_torch_on_each_ranks_shard(
    spark: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """examples/petastorm_notebook.py (Databricks' notebook, imports changed): its
    converters are globals the training function holds, its cache directory exists on no
    executor; then a torch loop with a TransformSpec on the same converters (the same warm
    ranks), and the finite and endless passes of both faces."""
    import petastorm_notebook as notebook

    notebook.make_converters(spark)
    converter_train, converter_val = notebook.converter_train, notebook.converter_val
    assert converter_train is not None and converter_val is not None
    assert len(converter_train) + len(converter_val) == 1_797  # the digits
    partitions = notebook.digits_frame(spark).rdd.getNumPartitions()

    def train_torch() -> dict[str, Any]:
        return workers.petastorm_torch_loop(converter_train, converter_val, batch_size=32)

    caplog.set_level(logging.INFO, logger="mlflow_hvd.driver.generation")
    try:
        with HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)) as runner:
            keras_out = runner.run(notebook.train_and_evaluate_hvd, lr=0.001,
                                   checkpoint_dir=str(tmp_path))
            torch_out = runner.run(train_torch)  # the same converters: the same warm ranks
            # the training converter alone: the ranks fed with both serve it
            census = runner.run(lambda: workers.petastorm_census(converter_train))
            census_passed = runner.run(workers.petastorm_census, train=converter_train)
            said = runner.run(lambda: workers.petastorm_refusals(converter_train))
    finally:
        spark.conf.unset(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF)
    assert sum(" starting 2 ranks on the spark backend " in r.getMessage()
               for r in caplog.records) == 1  # five jobs, one generation, fed once
    # Keras: steps from len(converter), gradients averaged (the ranks' weights agree), rank
    # 0's checkpoints, and it learned
    assert keras_out["steps_per_epoch"] == len(converter_train) // 64
    assert len(set(keras_out["weights"])) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"checkpoint-{e}.weights.h5" for e in (1, 2, 3)]
    assert keras_out["val_accuracy"][-1] > 0.5 and keras_out["val_loss"][-1] < \
        keras_out["val_loss"][0]
    # torch: dicts of tensors, the TransformSpec's column and selection
    assert torch_out["keys"] == ["scaled", "label_index"]
    assert torch_out["scaled"] == ((32, 64), "torch.float32") and len(torch_out["losses"]) == 2
    assert 0.0 < torch_out["val_loss"] < 10.0
    assert torch_out["val_rows"] == len(converter_val)  # a finite pass: every row once

    for ranks in (census, census_passed):  # captured in a closure, or passed to run()
        _check_census(ranks, len(converter_train), range(1_797), partitions,
                      batch_size=48, with_tf=True)
        assert ranks[0]["tf_fields"] == ["id", "features", "label_index"]
        assert ranks[0]["dtypes"] == {"id": "torch.int64", "features": "torch.float32",
                                      "label_index": "torch.int32"}
    assert [s.split(":")[0] for s in said] == ["ConfigurationError"] * 7
    assert "without cur_shard/shard_count: Petastorm would give every rank all the rows" in said[0]
    assert "pass cur_shard=hvd.rank(), shard_count=hvd.size()" in said[0]
    assert "cur_shard=0, shard_count=1 on rank 0 of 2" in said[1]
    assert "predicate= is Petastorm's reader's and has no meaning for this feed: filter the " \
           "DataFrame in Spark" in said[2]
    assert "reader_pool_type= is Petastorm's reader's" in said[3]
    assert "data_loader_fn= builds a loader from Petastorm's reader" in said[4]
    assert "schema_fields ['nope'] are not columns" in said[5]
    assert "unexpected argument(s) ['no_such_argument']" in said[6]


converter_in_globals: SparkDatasetConverter | None = None  # as a notebook holds it


def census_of_the_global_converter() -> list[dict[str, Any]]:
    return workers.petastorm_census(converter_in_globals, batch_size=64, with_tf=False)


def test_local_ranks_read_their_shards_of_a_converter_the_driver_wrote(spark: Any) -> None:
    global converter_in_globals
    converter_in_globals = make_spark_converter(frame(spark, 1_001, 4))
    try:
        ranks = HorovodRunner(np=-2, spark=spark, tracking=TrackingConfig(track=False)).run(
            census_of_the_global_converter)
    finally:
        converter_in_globals = None
    _check_census(ranks, 1_001, range(1_001), partitions=4, batch_size=64, with_tf=False)
    assert ranks[0]["dtypes"] == {"id": "torch.int64", "x": "torch.float32",
                                  "label": "torch.float32"}


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _check_census(ranks: list[dict[str, Any]], total: int, ids: range, partitions: int,
                  batch_size: int, with_tf: bool) -> None:
    """Each rank's finite passes read every row it holds once (batches of ``batch_size``,
    the last one short), and the ranks' together every row of the DataFrame once, as
    Petastorm's do (their lengths may differ); endless streams run pass after pass over
    the ranks' equal shards, each in a new order."""
    seen = [_flat(r["torch"]) for r in ranks]
    assert [len(s) for s in seen] == [r["rows"] for r in ranks]
    every = [i for s in seen for i in s]
    assert len(every) == len(set(every)) == total and set(every) <= set(ids)
    equal = min(r["rows"] for r in ranks)  # what every rank's endless passes read
    assert total - equal * len(ranks) <= partitions * (len(ranks) - 1)
    for r in ranks:
        rows = r["rows"]
        batches = r["torch"] + r["tf"]
        assert all(len(b) == batch_size for b in r["torch"][:-1])
        assert 0 < len(r["torch"][-1]) <= batch_size and len(batches) > 2
        if with_tf:
            assert all(len(b) == batch_size for b in r["tf"][:-1])
            assert sorted(_flat(r["tf"])) == sorted(_flat(r["torch"]))
        # in file order, twice
        assert r["in_order"][:rows] == r["in_order"][rows:] and len(r["in_order"]) == 2 * rows
        for endless in (r["endless"], r["endless_tf"]) if with_tf else (r["endless"],):
            first, second = endless[:equal], endless[equal:2 * equal]
            assert sorted(first) == sorted(second) == sorted(r["in_order"][:equal])
            assert first != second


def test_a_converter_on_the_driver_reads_the_whole_dataframe(spark: Any) -> None:
    from pyspark.ml.linalg import Vectors

    data = spark.createDataFrame([(i, Vectors.dense([i, 2.0 * i]), f"r{i}") for i in range(50)],
                                 ["id", "v", "text"])
    converter = make_spark_converter(data, dtype="float64")
    with converter.make_torch_dataloader(batch_size=16, num_epochs=1) as loader:
        batches = list(loader)
    assert [len(b["id"]) for b in batches] == [16, 16, 16, 2]
    ids = [i for b in batches for i in b["id"].tolist()]
    assert sorted(ids) == list(range(50))
    vectors = {int(i): v.tolist() for b in batches for i, v in zip(b["id"], b["v"], strict=True)}
    assert vectors[7] == [7.0, 14.0] and batches[0]["v"].dtype.__str__() == "torch.float64"
    assert all(isinstance(t, str) for b in batches for t in b["text"])
    converter.delete()
    with pytest.raises(ConfigurationError, match=r"was deleted \(converter.delete\(\)\)"):
        HorovodRunner(np=-1, spark=spark, tracking=TrackingConfig(track=False)).run(
            lambda: len(converter))


def test_what_a_converter_cannot_take_is_refused_on_the_driver(spark: Any) -> None:
    from pyspark.sql import functions as F

    with pytest.raises(DataInputError, match=r"column 'when' of the DataFrame passed as "
                                             r"converter_\d+= has type timestamp"):
        make_spark_converter(spark.range(3).select("id", F.current_timestamp().alias("when")))
    with pytest.raises(ConfigurationError, match="dtype 'float16' is not supported"):
        make_spark_converter(spark.range(3), dtype="float16")
    with pytest.raises(ConfigurationError, match="compression_codec should be None or one of"):
        make_spark_converter(spark.range(3), compression_codec="brotli")
    with pytest.raises(ConfigurationError, match="must be a Spark DataFrame or the path"):
        make_spark_converter([1, 2, 3])

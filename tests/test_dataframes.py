"""Integration: Spark DataFrames passed to run() reach real ranks as their own shards, on
local-cluster[2,1,1024] (two executor JVMs, each with its own local directory). The data is
built in memory (spark.range + rand): no file exists that a rank could read behind the
feed's back."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import pytest
import workers
from conftest import assert_no_workers_left

from mlflow_hvd import ClusterConfig, HorovodRunner, JobConfig, TrackingConfig
from mlflow_hvd.errors import DataInputError, WorkerFailedError

pytestmark = pytest.mark.spark


def frame(spark: Any, rows: int, partitions: int, width: int = 4) -> Any:
    from pyspark.sql import functions as F

    return spark.range(0, rows, 1, partitions).select(
        "id",
        F.array(*[F.rand(seed=i).cast("float") for i in range(width)]).alias("x"),
        (F.col("id") % 2).cast("int").alias("label"),
    )


@pytest.mark.old_end
def test_shards_are_disjoint_equal_and_all_rows_but_the_reported_drop(spark: Any) -> None:
    from pyspark.sql import functions as F

    data = frame(spark, 10_003, 7)
    # a validation set of another schema in the same stage
    val = spark.range(0, 1_001, 1, 3).select(F.col("id").alias("vid"),
                                            F.concat(F.lit("t"), "id").alias("text"))
    ranks = HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)).run(
        workers.shard_census, data=data, val=val, batch_size=100)
    assert [r["rank"] for r in ranks] == [0, 1]
    rows = ranks[0]["rows"]
    assert all(r["rows"] == rows and len(r["ids"]) == rows for r in ranks)
    assert {r["steps"] for r in ranks} == {rows // 100}
    first, second = (set(r["ids"]) for r in ranks)
    assert not first & second  # disjoint
    assert first | second <= set(range(10_003))
    assert 10_003 - len(first | second) == ranks[0]["dropped"] == 10_003 - 2 * rows
    assert ranks[0]["dropped"] <= 7  # round robin: counts differ by at most the partitions
    assert ranks[0]["columns"] == ["id", "x", "label"] and ranks[0]["x_shape"] == (4, 4)
    assert {r["val_rows"] for r in ranks} == {500}
    assert ranks[0]["val_columns"] == ["vid", "text"]
    vid, text = ranks[0]["val_first"]
    assert text == f"t{vid}"


def test_skewed_partitions_give_every_rank_the_same_steps(spark: Any) -> None:
    # one partition of 3000 rows, four of 10: the feed's repartition evens them out
    big = frame(spark, 3_000, 1)
    small = frame(spark, 40, 4).selectExpr("id + 100000 as id", "x", "label")
    ranks = HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)).run(
        workers.shard_census, data=big.union(small), batch_size=64)
    assert {r["steps"] for r in ranks} == {ranks[0]["rows"] // 64}
    assert ranks[0]["rows"] >= (3_040 - 5) // 2


@pytest.mark.new_end
def test_keras_fit_and_a_torch_loop_train_on_dataframe_shards(
    spark: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlflow_hvd.driver.generation")
    data = frame(spark, 2_000, 3)
    with HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)) as runner:
        fitted = runner.run(workers.keras_fit_on_shard, data=data, epochs=2, batch_size=64)
        looped = runner.run(workers.torch_loop_on_shard, data=data, epochs=2, batch_size=50)
        census = runner.run(workers.torch_loader_census, data=data)
    generations = sum(" starting 2 ranks on the spark backend " in r.getMessage()
                      for r in caplog.records)
    assert len(fitted["losses"]) == 2 and len(set(fitted["steps"])) == 1
    assert fitted["epochs_read"] == 2  # fit read one pass per epoch
    assert looped["batches"] == [2 * looped["len"]] * 2
    assert generations == 1  # the same DataFrame: fed once, to the same warm ranks
    # DataLoader worker processes (0, 1, 2 of them) split each rank's pass: every row once
    # per epoch, the pass's own order whatever the count, a new order each epoch
    for count in ("0", "1", "2"):
        epochs = [[rank[count]["epochs"][e] for rank in census] for e in range(2)]
        for ranks in epochs:
            assert all(len(ids) == len(set(ids)) == census[0][count]["len"] * 50 for ids in ranks)
            assert not set(ranks[0]) & set(ranks[1])  # the ranks' shards are disjoint
        assert epochs[0] != epochs[1]
        assert epochs == [[rank["0"]["epochs"][e] for rank in census] for e in range(2)]


def test_a_column_type_that_cannot_be_fed_is_refused_before_any_spark_job(spark: Any) -> None:
    from pyspark.sql import functions as F

    data = spark.range(10).select("id", F.current_timestamp().alias("when"))
    tracker = spark.sparkContext.statusTracker()
    jobs_before = tracker.getJobIdsForGroup(None)
    with pytest.raises(DataInputError, match=r"column 'when' of the DataFrame passed as "
                                             r"data= has type timestamp, which cannot be fed"):
        HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)).run(workers.echo,
            data=data)
    assert tracker.getJobIdsForGroup(None) == jobs_before


def test_nulls_and_empty_frames_fail_the_job_with_the_feeds_error(spark: Any) -> None:
    """Found while the tasks write (their ranks started meanwhile): the job's error is the
    feed's, and no rank is left. The ranks end with their barrier tasks, which Spark ends
    when the job is cancelled: on a loaded machine up to a second and a half after run()
    raised (seen: 0.6 s and 1.5 s once the tasks' agents no longer imported Horovod, so
    that their ranks are running by then), hence the wait with a deadline."""
    from pyspark.sql import functions as F

    with_nulls = spark.range(0, 100, 1, 2).select(
        "id", F.when(F.col("id") == 57, None).otherwise(F.col("id") * 1.0).alias("y"))
    runner = HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False))
    with pytest.raises(DataInputError, match=r"column 'y' of the DataFrame passed as "
                                             r"data= has null values"):
        runner.run(workers.echo, data=with_nulls)
    with pytest.raises(DataInputError, match=r"passed as data= has 0 rows, and rank\(s\) 0, 1 "
                                             r"of 2 got none"):
        runner.run(workers.echo, data=spark.range(0).selectExpr("id"))
    assert_no_workers_left()


def test_a_batch_larger_than_the_shard_fails_every_rank_alike(spark: Any) -> None:
    with pytest.raises(WorkerFailedError, match=r"batch_size=100 but every rank has 2\d rows "
                                                r"of data= \(50 rows over 2 ranks\)"):
        HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)).run(
            workers.shard_census, data=frame(spark, 50, 2), batch_size=100)


def test_a_dataframe_of_another_session_is_refused(spark: Any) -> None:
    other = spark.newSession().range(10)
    with pytest.raises(DataInputError, match="belongs to another SparkSession"):
        HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)).run(workers.echo,
            data=other)


def test_np_below_zero_feeds_the_driver_disk(spark: Any) -> None:
    ranks = HorovodRunner(np=-2, tracking=TrackingConfig(track=False)).run(
        workers.shard_census, data=frame(spark, 1_001, 3), batch_size=10)
    assert [r["rows"] for r in ranks] == [500, 500]
    assert not set(ranks[0]["ids"]) & set(ranks[1]["ids"])
    assert isinstance(ranks[0]["dropped"], int) and ranks[0]["dropped"] == 1


def test_plain_values_next_to_a_dataframe_are_passed_as_they_are(spark: Any) -> None:
    result = HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)).run(
        workers.echo, data=frame(spark, 20, 2), lr=0.5)
    assert result["kwargs"]["lr"] == 0.5
    shard = result["kwargs"]["data"]
    assert type(shard).__name__ == "Shard" and shard.rows == 10 and shard.argument == "data"



@pytest.mark.parametrize("np_", [2, -2])
def test_the_shard_files_are_gone_once_the_job_is(spark: Any, np_: int) -> None:
    from services import wait_until

    path, existed = HorovodRunner(np=np_, spark=spark if np_ > 0 else None,
        tracking=TrackingConfig(track=False)).run(
        workers.where_my_shard_is, data=frame(spark, 20, 2))
    assert existed and os.path.basename(os.path.dirname(path)).startswith("mlflow-hvd-feed-")
    wait_until(lambda: not os.path.exists(os.path.dirname(path)), 30,
               f"{os.path.dirname(path)} to be removed")


def test_the_run_records_each_dataframe_as_a_dataset_input_and_the_split(
        spark: Any, store: str, capsys: pytest.CaptureFixture[str]) -> None:
    import mlflow
    from services import wait_until

    # 2 rows per partition over 30 partitions: rows per rank differ, more than 1% is left out
    small = frame(spark, 61, 30)
    val = frame(spark, 100, 2)
    runner = HorovodRunner(np=2, spark=spark)
    runner.run(workers.shard_census, data=small, val=val, batch_size=4)
    client = mlflow.MlflowClient()

    def inputs() -> list[Any]:
        return client.get_run(runner.last_run_id).inputs.dataset_inputs

    wait_until(lambda: len(inputs()) == 2, 30, "the run's two dataset inputs")
    found = {d.dataset.name: d for d in inputs()}
    contexts = {name: {t.key: t.value for t in d.tags}["mlflow.data.context"]
                for name, d in found.items()}
    assert contexts == {"data": "training", "val": "validation"}
    profile = json.loads(found["data"].dataset.profile)
    run = client.get_run(runner.last_run_id)
    rows = int(run.data.tags["mlflow_hvd.data.data.rows_per_rank"])
    assert profile == {"num_rows": 61, "ranks": 2, "rows_per_rank": rows,
                       "dropped_rows": 61 - 2 * rows}
    assert run.data.tags["mlflow_hvd.data.data.dropped_rows"] == str(61 - 2 * rows)
    assert run.data.tags["mlflow_hvd.data.val.total_rows"] == "100"
    assert "mlflow_colspec" in found["data"].dataset.schema
    assert found["data"].dataset.digest  # the plan's semantic hash: no Spark job
    out = capsys.readouterr().out
    assert f"mlflow_hvd: warning: {61 - 2 * rows} of the 61 rows of data=" in out
    assert "rows of val=" not in out


def test_a_sweep_over_a_dataframe_feeds_its_warm_ranks_once(spark: Any, store: str) -> None:
    import mlflow
    from hyperopt import hp
    from services import wait_until

    from mlflow_hvd.sweep import sweep

    result = sweep(workers.shard_trial, {"lr": hp.uniform("lr", 0.0, 1.0)}, max_evals=2, np=2,
                   fixed_params={"data": frame(spark, 1_000, 4)},
                   spark=spark)
    client = mlflow.MlflowClient()
    trials = client.search_runs(
        [client.get_run(result.parent_run_id).info.experiment_id],
        f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    assert len(trials) == 2
    assert len({t.data.params["rank0_pid"] for t in trials}) == 1  # one generation
    assert all("data" not in t.data.params for t in trials)  # a dataset, not a param
    for run_id in [result.parent_run_id, *(t.info.run_id for t in trials)]:
        wait_until(lambda r=run_id: [d.dataset.name for d in
                                     client.get_run(r).inputs.dataset_inputs] == ["data"],
                   30, f"run {run_id}'s dataset input")


def test_a_retried_attempt_is_fed_again(spark: Any, store: str) -> None:
    ranks = HorovodRunner(np=2, spark=spark, job=JobConfig(max_failures=1)).run(
        workers.census_after_a_failed_attempt, data=frame(spark, 300, 3))
    assert [r["rows"] for r in ranks] == [ranks[0]["rows"]] * 2
    assert len(set(ranks[0]["ids"]) | set(ranks[1]["ids"])) == 2 * ranks[0]["rows"]


def test_an_elastic_job_runs_on_the_slots_there_are_and_splits_its_data_over_them(
        spark: Any, store: str, caplog: pytest.LogCaptureFixture) -> None:
    """np=3, min_np=2 on two slots: the attempt runs on 2 ranks (hvd.size() 2), the
    DataFrame split into 2 equal shards, the world size in the run, the reason logged."""
    import mlflow

    caplog.set_level(logging.INFO, logger="mlflow_hvd")
    runner = HorovodRunner(np=3, spark=spark,
                           job=JobConfig(min_np=2, max_failures=1, slot_timeout=1))
    ranks = runner.run(workers.shard_census, data=frame(spark, 301, 3), batch_size=10)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["rows"] == ranks[1]["rows"] == 150
    assert len(set(ranks[0]["ids"]) | set(ranks[1]["ids"])) == 300
    history = mlflow.MlflowClient().get_metric_history(runner.last_run_id,
                                                       "mlflow_hvd.world_size")
    assert [(m.step, m.value) for m in history] == [(0, 2.0)]
    assert ("attempt 1 runs on 2 of np=3 ranks: Spark offers 2 task slots after waiting 1s "
            "for 3 (min_np=2)") in caplog.text


def test_an_elastic_job_with_fewer_slots_than_min_np_fails_naming_both(spark: Any) -> None:
    from mlflow_hvd.errors import InsufficientSlotsError

    runner = HorovodRunner(np=4, spark=spark, tracking=TrackingConfig(track=False),
                           job=JobConfig(min_np=3, max_failures=1, slot_timeout=1))
    with pytest.raises(InsufficientSlotsError) as info:
        runner.run(workers.echo)
    assert str(info.value) == (
        "the job needs at least min_np=3 (at most np=4) concurrent barrier task slots, and "
        "after waiting 1s for 4 the Spark cluster (master local-cluster[2,1,1024]) has "
        "fewer: it offers 2. Add executors, lower JobConfig(min_np=...), or raise "
        "JobConfig(slot_timeout=...) if executors are still coming back")


def test_an_elastic_job_that_does_not_track_shrinks_and_says_it_cannot_grow_back(
        spark: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Growing back happens at a checkpoint in the job's run: a job without tracking runs
    below np and says so (it was silent: it never grew and nothing told why)."""
    from services import wait_until

    caplog.set_level(logging.INFO, logger="mlflow_hvd")
    memory = spark.sparkContext._jsc.sc().getExecutorMemoryStatus
    wait_until(lambda: memory().size() >= 3, 60, "both executors")  # and the driver
    runner = HorovodRunner(np=3, spark=spark, tracking=TrackingConfig(track=False),
                           job=JobConfig(min_np=2, max_failures=1, slot_timeout=1))
    assert runner.run(workers.echo, value=7)["kwargs"] == {"value": 7}
    assert ("attempt 1 runs on 2 of np=3 ranks and will not grow back: growing back "
            "happens at a checkpoint committed to the job's MLflow run, and this job does not "
            "track (TrackingConfig(track=False))") in caplog.text


def test_vectors_arrays_binary_text_and_booleans_reach_the_ranks(spark: Any) -> None:
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T

    schema = T.StructType([
        T.StructField("v", VectorUDT()),
        T.StructField("a", T.ArrayType(T.ShortType())),
        T.StructField("b", T.BinaryType()),
        T.StructField("s", T.StringType()),
        T.StructField("t", T.BooleanType()),
    ])
    rows = [(Vectors.dense([i, 0.5]) if i % 2 else Vectors.sparse(2, [0], [float(i)]),
             [i, i + 1, i + 2], bytes([i, 255]), f"row {i}", i % 3 == 0) for i in range(40)]
    data = spark.createDataFrame(rows, schema).coalesce(1)  # file order = creation order
    # zstd-compressed shards read back the same
    got = HorovodRunner(np=2, spark=spark, cluster=ClusterConfig(data_compression="zstd"),
        tracking=TrackingConfig(track=False)).run(
        workers.first_rows, data=data)
    (v, v_type), (a, a_type), (b, b_type), (s, s_type), (t, t_type) = (
        got[c] for c in ("v", "a", "b", "s", "t"))
    assert (v_type, a_type, b_type, s_type, t_type) == (
        "float64", "int16", "object", "object", "bool")
    first = int(s[0].split()[1])
    assert v[0] == ([first, 0.5] if first % 2 else [float(first), 0.0])  # sparse: dense
    assert a[0] == [first, first + 1, first + 2]
    assert b[0] == bytes([first, 255]) and t[0] == (first % 3 == 0)


def test_dataframes_that_cannot_be_projected_are_refused_on_the_driver(spark: Any) -> None:
    from types import SimpleNamespace

    from mlflow_hvd.driver.feed import _check_sessions, split_frames

    with pytest.raises(DataInputError, match=r"column name '__mlflow_hvd_argument' \(argument "
                                             r"data=\) is reserved"):
        split_frames({"data": spark.range(3).selectExpr("id as __mlflow_hvd_argument")})
    with pytest.raises(DataInputError, match="the DataFrame passed as data= has no columns"):
        split_frames({"data": spark.range(3).select()})
    stopped = SimpleNamespace(sparkSession=SimpleNamespace(sparkContext=SimpleNamespace(
        _jsc=None)))
    with pytest.raises(DataInputError, match="belongs to a SparkSession that was stopped"):
        _check_sessions([("data", stopped)], None)
    # two arguments with a column of the same name and different types: one name each
    kwargs, feed = split_frames({"a": spark.range(3), "b": spark.range(3).selectExpr(
        "cast(id as string) as id"), "lr": 0.1})
    assert feed is not None and kwargs["lr"] == 0.1
    assert [[c.field for c in f.columns] for f in feed.spec.frames] == [["id#0"], ["id#1"]]
    assert feed.fed_frame(2).columns == ["__mlflow_hvd_argument", "id#0", "id#1"]

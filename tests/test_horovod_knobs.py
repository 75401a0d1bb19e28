"""Horovod's knobs reach every rank as horovodrun would set them: HorovodOptions, the
driver's HOROVOD_* variables and Spark's spark.executorEnv.*; the variables the runner owns
are refused; the timeline is written on rank 0's host and logged to the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers

from mlflow_hvd import ConfigurationError, HorovodOptions, HorovodRunner
from mlflow_hvd.common import horovod_env
from mlflow_hvd.common.layout import worker_env


def test_options_become_the_variables_horovodrun_sets_for_the_same_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from horovod.runner import launch
    from horovod.runner.common.util import config_parser

    options = HorovodOptions(timeline=True, timeline_mark_cycles=True, fusion_threshold_mb=32,
                             cycle_time_ms=2.5, cache_capacity=512,
                             hierarchical_allreduce=True, hierarchical_allgather=False,
                             autotune=True, autotune_log=True)
    ours = options.env()
    monkeypatch.setattr("sys.argv", [  # horovodrun's own parser reads the command line
        "horovodrun", "-np", "2", "--timeline-filename", "T", "--timeline-mark-cycles",
        "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5", "--cache-capacity", "512",
        "--hierarchical-allreduce", "--no-hierarchical-allgather", "--autotune",
        "--autotune-log-file", "A", "python", "train.py"])
    args = launch.parse_args()
    theirs: dict[str, Any] = {}
    config_parser.set_env_from_args(theirs, args)
    theirs = {k: str(v) for k, v in theirs.items()}
    files = {"HOROVOD_TIMELINE", "HOROVOD_AUTOTUNE_LOG"}  # paths: chosen on rank 0's host
    assert {k: v for k, v in ours.items() if k not in files} == {
        k: v for k, v in theirs.items() if k not in files}
    assert files <= set(ours)
    assert ours["HOROVOD_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert ours["HOROVOD_HIERARCHICAL_ALLGATHER"] == "0"
    assert HorovodOptions().env() == {}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"fusion_threshold_mb": -1}, "HorovodOptions(fusion_threshold_mb=-1): must be a "
                                  "non-negative integer"),
    ({"cycle_time_ms": 0}, "HorovodOptions(cycle_time_ms=0): must be a positive number"),
    ({"autotune_log": True}, "HorovodOptions(autotune_log=True) needs autotune=True"),
    ({"timeline_mark_cycles": True}, "needs timeline=True"),
])
def test_bad_options_are_refused_naming_them(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HorovodOptions(**kwargs)


def test_variables_the_runner_owns_are_refused_when_the_runner_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOROVOD_SIZE", "8")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", "1234")
    with pytest.raises(ConfigurationError, match=(
        r"^HOROVOD_GLOO_RENDEZVOUS_PORT, HOROVOD_SIZE set in the driver's environment: the "
        r"runner sets them for each rank .* Unset them$")):
        HorovodRunner(np=-2)


def test_spark_executor_env_setting_an_owned_variable_is_refused(spark: Any) -> None:
    from pyspark import SparkConf

    from mlflow_hvd.backends.spark.session import check_executor_env

    check_executor_env(spark.sparkContext.getConf())  # tuning only: welcome
    conf = SparkConf(loadDefaults=False).set("spark.executorEnv.HOROVOD_RANK", "0")
    with pytest.raises(ConfigurationError, match=(
        r"^HOROVOD_RANK set in Spark's configuration \(spark.executorEnv.\*\): the runner "
        r"sets it for each rank")):
        check_executor_env(conf)


def test_a_ranks_environment_keeps_tuning_and_drops_what_the_runner_owns(
    tmp_path: Path,
) -> None:
    host = {"HOROVOD_FUSION_THRESHOLD": "1", "HOROVOD_CYCLE_TIME": "9", "HOROVOD_RANK": "5",
            "MLFLOW_RUN_ID": "stale", "PATH": "/bin"}
    env = worker_env(host, {"HOROVOD_RANK": "1"}, {"HOROVOD_CYCLE_TIME": "3"})
    assert env == {"HOROVOD_FUSION_THRESHOLD": "1", "HOROVOD_CYCLE_TIME": "3",
                   "HOROVOD_RANK": "1", "PATH": "/bin"}
    files = horovod_env.rank_files({"HOROVOD_TIMELINE": "x"}, str(tmp_path), 0)
    assert files == {"HOROVOD_TIMELINE": str(tmp_path / "horovod-rank0" / "timeline.json")}
    assert (tmp_path / "horovod-rank0").is_dir()


def _check_timeline(run_id: str, tmp_path: Path) -> None:
    """The run holds rank 0's timeline, in Chrome's trace format, with the job's allreduces:
    Horovod names each op in a process-name record and times its phases."""
    client = mlflow.MlflowClient()
    assert [a.path for a in client.list_artifacts(run_id, "horovod")] == [
        "horovod/timeline.json"]
    text = Path(client.download_artifacts(run_id, "horovod/timeline.json", str(tmp_path)))
    events = json.loads(text.read_text())  # complete JSON: Horovod was shut down first
    tensors = {e["args"].get("name") for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert "HorovodAllreduce" in tensors, tensors
    # the three allreduces of workers.horovod_knobs
    assert [e["ph"] for e in events if e.get("name") == "ALLREDUCE"] == ["B", "B", "B"]


@pytest.mark.slow
def test_options_and_driver_variables_reach_every_local_rank_and_the_timeline_is_logged(
    store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "256")  # the driver's environment
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "7")  # overridden by the option
    runner = HorovodRunner(np=-2, horovod=HorovodOptions(timeline=True, cycle_time_ms=3,
                                                          fusion_threshold_mb=16))
    seen = runner.run(workers.horovod_knobs)
    assert [s["rank"] for s in seen] == ["0", "1"]
    for view in seen:
        assert view["HOROVOD_CACHE_CAPACITY"] == "256"
        assert view["HOROVOD_CYCLE_TIME"] == "3"
        assert view["HOROVOD_FUSION_THRESHOLD"] == str(16 * 2**20)
        assert view["HOROVOD_TIMELINE"].endswith(f"horovod-rank{view['rank']}/timeline.json")
    _check_timeline(runner.last_run_id or "", tmp_path)


@pytest.mark.slow
@pytest.mark.spark
def test_options_and_executor_variables_reach_every_spark_rank_and_the_timeline_is_logged(
    spark: Any, store: str, tmp_path: Path,
) -> None:
    runner = HorovodRunner(np=2, spark=spark, horovod=HorovodOptions(timeline=True,
                                                                     cache_capacity=128))
    seen = runner.run(workers.horovod_knobs)
    for view in seen:
        assert view["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "120"  # spark.executorEnv.*
        assert view["HOROVOD_CACHE_CAPACITY"] == "128"
    _check_timeline(runner.last_run_id or "", tmp_path)


@pytest.mark.slow
def test_the_autotune_log_is_written_on_rank_0s_host_and_logged(
    store: str, tmp_path: Path,
) -> None:
    runner = HorovodRunner(np=-2, horovod=HorovodOptions(autotune=True, autotune_log=True))
    assert runner.run(workers.allreduce_many, n=300) == 300
    client = mlflow.MlflowClient()
    run_id = runner.last_run_id or ""
    assert [a.path for a in client.list_artifacts(run_id, "horovod")] == [
        "horovod/autotune_log.csv"]
    lines = Path(client.download_artifacts(run_id, "horovod/autotune_log.csv", str(tmp_path))
                 ).read_text().splitlines()
    assert lines[0].split(",")[:2] == ["hierarchical_allreduce", "hierarchical_allgather"]
    assert len(lines) >= 2  # at least one sample of the autotuner

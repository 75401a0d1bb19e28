"""HorovodRunner's options grouped by concern (mlflow_hvd.common.config): each group checks
itself when made, a misplaced or misspelled option is refused naming its group, the
Databricks signature is unchanged, and the sweep drives the runner through its public seam."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from mlflow_hvd import (
    ClusterConfig,
    ConfigurationError,
    HorovodOptions,
    HorovodRunner,
    JobConfig,
    TrackingConfig,
)
from mlflow_hvd.runner import RunHooks, TaskSlots
from mlflow_hvd.sweep import sweep


def test_the_runner_takes_at_most_eight_parameters_and_keeps_databricks_signature() -> None:
    params = inspect.signature(HorovodRunner.__init__).parameters
    assert len(params) - 1 <= 8  # self aside
    assert list(params)[1:3] == ["np", "driver_log_verbosity"]
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for n, p in params.items()
               if n != "self")
    assert params["driver_log_verbosity"].default == "log_callback_only"
    runner = HorovodRunner(np=-2, driver_log_verbosity="all")
    assert (runner.num_processor, runner.driver_log_verbosity) == (-2, "all")
    # no group given: each group's defaults
    assert (runner.job, runner.cluster, runner.tracking, runner.horovod) == (
        JobConfig(), ClusterConfig(), TrackingConfig(), None)


def test_groups_are_frozen_keyword_only_and_given_back_as_made() -> None:
    job = JobConfig(timeout=600, max_failures=2)
    runner = HorovodRunner(np=-1, job=job, tracking=TrackingConfig(tracking_env=["A"]))
    assert runner.job is job and runner.job.timeout == 600.0
    assert runner.tracking.tracking_env == ("A",)  # a list is kept as a tuple
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.timeout = 5  # type: ignore[misc]
    with pytest.raises(ConfigurationError, match=r"^JobConfig takes its options by name"):
        JobConfig(60.0)  # type: ignore[misc]


def test_a_flat_option_on_the_runner_is_refused_naming_its_group() -> None:
    with pytest.raises(ConfigurationError) as info:
        HorovodRunner(np=2, timeout=600)
    assert str(info.value) == (
        "HorovodRunner() takes no option 'timeout': timeout is an option of JobConfig: "
        "job=JobConfig(timeout=...), e.g. HorovodRunner(np=2, job=JobConfig(timeout=...)); "
        "sweep(..., job=JobConfig(timeout=...)) takes the same")
    for name, group in [("ship_environment", "ClusterConfig"), ("track", "TrackingConfig"),
                        ("fusion_threshold_mb", "HorovodOptions")]:
        with pytest.raises(ConfigurationError, match=rf"{name} is an option of {group}: "):
            HorovodRunner(np=-1, **{name: 1})


def test_an_option_in_the_wrong_group_or_misspelled_is_refused_naming_where_it_goes() -> None:
    with pytest.raises(ConfigurationError, match=(
            r"^JobConfig\(\) takes no option 'tracking_timeout': tracking_timeout is an option "
            r"of TrackingConfig: tracking=TrackingConfig\(tracking_timeout=\.\.\.\)")):
        JobConfig(tracking_timeout=5)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError) as info:
        JobConfig(timout=5)  # type: ignore[call-arg]
    assert str(info.value).startswith(
        "JobConfig() takes no option 'timout'; did you mean 'timeout' (in JobConfig)")
    with pytest.raises(ConfigurationError, match=r"takes no option 'no_such_thing' \(options "
                       r"are grouped: JobConfig, ClusterConfig, TrackingConfig, HorovodOptions"):
        HorovodRunner(np=-1, no_such_thing=1)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: JobConfig(max_failures=-1), "max_failures must be an integer >= 0, got -1"),
    (lambda: JobConfig(timeout=0), "timeout must be a positive number of seconds, got 0"),
    (lambda: JobConfig(max_line_bytes=10), "max_line_bytes must be an integer >= 80, got 10"),
    (lambda: JobConfig(min_np=0, max_failures=1), "min_np must be an integer >= 1, got 0"),
    (lambda: JobConfig(min_np=2), "min_np=2 needs max_failures >= 1: a job runs on fewer "
     "ranks only when it restarts after a failure"),
    (lambda: JobConfig(grow_interval=0), "grow_interval must be a positive number of seconds"),
    (lambda: JobConfig(grow_interval=float("nan")), "grow_interval must be a positive number"),
    (lambda: ClusterConfig(spark_master=7), "spark_master must be a master URL such as "
     "'spark://host:7077' (or None), got int"),
    (lambda: ClusterConfig(gloo_iface=""), "gloo_iface must be a network interface name"),
    (lambda: ClusterConfig(gpu_resource="a b"), "gpu_resource must be the name of a Spark "
     "resource"),
    (lambda: ClusterConfig(environment_timeout=-1), "environment_timeout must be a positive"),
    (lambda: ClusterConfig(data_compression="gzip"), "data_compression must be None"),
    (lambda: TrackingConfig(track="yes"), "track must be True or False, got 'yes'"),
    (lambda: TrackingConfig(tracking_timeout=0), "tracking_timeout must be a positive"),
    (lambda: TrackingConfig(tracking_env="AWS_KEY"), "tracking_env must be a list of "
     "environment variable names"),
    (lambda: TrackingConfig(undelivered_dir=3), "undelivered_dir must be a directory path"),
])
def test_each_group_checks_its_values_when_made(make: Any, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        make()
    assert str(info.value).startswith(message), info.value


def test_min_np_is_refused_above_np_and_for_processes_on_the_driver() -> None:
    elastic = JobConfig(min_np=3, max_failures=1)
    with pytest.raises(ConfigurationError) as info:
        HorovodRunner(np=2, job=elastic)
    assert str(info.value) == (
        "JobConfig(min_np=3) is above np=2: min_np is the fewest ranks an attempt may run "
        "on, np the most; give min_np between 1 and 2")
    with pytest.raises(ConfigurationError, match=r"^JobConfig\(min_np=3\) applies to Spark "
                       r"jobs \(np > 0\).*np=-4 runs 4 processes on the driver"):
        HorovodRunner(np=-4, job=elastic)
    assert HorovodRunner(np=3, job=elastic).job.min_np == 3


def test_a_group_of_the_wrong_type_is_refused_naming_the_class() -> None:
    with pytest.raises(ConfigurationError, match=r"^job must be a mlflow_hvd.JobConfig \(e.g. "
                       r"job=JobConfig\(\.\.\.\)\), got dict$"):
        HorovodRunner(np=-1, job={"timeout": 5})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^cluster must be a mlflow_hvd.ClusterConfig"):
        HorovodRunner(np=-1, cluster=JobConfig())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^horovod must be a mlflow_hvd.HorovodOptions"):
        HorovodRunner(np=-1, horovod=TrackingConfig())  # type: ignore[arg-type]
    assert HorovodRunner(np=-1, horovod=HorovodOptions(cycle_time_ms=2)).horovod == (
        HorovodOptions(cycle_time_ms=2))


def test_a_malformed_standalone_master_is_refused_when_the_runner_is_made() -> None:
    with pytest.raises(ConfigurationError, match="spark://"):
        HorovodRunner(np=2, cluster=ClusterConfig(spark_master="spark://"))


def test_the_sweep_takes_the_same_groups_and_refuses_the_untyped_dict(store: str) -> None:
    with pytest.raises(ConfigurationError, match=(
            r"^sweep\(\) takes no option 'runner_options' \(options are grouped: ")):
        sweep(print, {"x": 1}, max_evals=1, np=-1, runner_options={"timeout": 5})
    with pytest.raises(ConfigurationError, match=r"^sweep\(\) takes no option 'max_failures': "
                       r"max_failures is an option of JobConfig"):
        sweep(print, {"x": 1}, max_evals=1, np=-1, max_failures=1)
    with pytest.raises(ConfigurationError, match=r"^tracking must be a mlflow_hvd.TrackingConfig"):
        sweep(print, {"x": 1}, max_evals=1, np=-1, tracking={"track": False})


def test_local_task_slots_are_the_drivers_cores() -> None:
    assert HorovodRunner(np=-2).task_slots() == TaskSlots(os.cpu_count() or 1, "the driver")


def test_the_sweep_uses_nothing_private_of_the_runner() -> None:
    """sweep/ reaches the runner through run_with, task_slots, prepare and the groups: none
    of the runner's private methods or attributes is named there."""
    runner = HorovodRunner(np=-1)
    members = {n for n in [*vars(HorovodRunner), *vars(runner)]
               if n.startswith("_") and not n.startswith("__")}
    assert {"_options", "_placement", "_pool"} <= members  # what a face could reach for
    private = []
    for path in sorted((REPO / "mlflow_hvd" / "sweep").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in members:
                private.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert private == [], private


def test_run_hooks_are_public_and_documented() -> None:
    doc = (REPO / "docs" / "api.md").read_text()
    for name in ("RunHooks", "TaskSlots", "run_with", "task_slots", "JobConfig",
                 "ClusterConfig", "TrackingConfig"):
        assert name in doc, name
    assert [f.name for f in dataclasses.fields(RunHooks)] == [
        "epoch_judge", "log_prefix", "dataset_runs", "rank_env", "torch_nodes_are_tasks"]


def test_the_cli_maps_its_flags_onto_the_groups(tmp_path: Path) -> None:
    from mlflow_hvd.cli.common import runner_options
    from mlflow_hvd.cli.train import parse_args

    args = parse_args(["--np", "2", "--max-failures", "1", "--timeout", "900",
                       "--spark-master", "local[2]", "--ship-environment", "false"])
    groups = runner_options(args)
    assert groups.job == JobConfig(max_failures=1, timeout=900)
    assert groups.cluster == ClusterConfig(spark_master="local[2]", ship_environment=False)
    assert runner_options(parse_args(["--np", "2"])).job == JobConfig()  # 0: no limit
    with pytest.raises(ConfigurationError, match=r"^timeout must be a number of seconds"):
        runner_options(parse_args(["--np", "2", "--timeout", "-1"]))

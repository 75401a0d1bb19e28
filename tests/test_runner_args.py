"""Argument validation of HorovodRunner: clear errors before anything starts."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path

import pytest
import workers
from conftest import worker_processes

from mlflow_hvd import (
    BackendError,
    ClusterConfig,
    ConfigurationError,
    HorovodRunner,
    JobConfig,
    TrackingConfig,
)
from mlflow_hvd.backends.spark.session import check_barrier_supported, expected_slots
from mlflow_hvd.errors import SparkBarrierUnsupportedError


def test_np_zero() -> None:
    with pytest.raises(ValueError, match=r"np=0 is not a valid number of processes: use np=-N"):
        HorovodRunner(np=0)


@pytest.mark.parametrize("np", [1.5, 2.0, "2", True, False, None])
def test_np_must_be_a_plain_int(np: object) -> None:
    with pytest.raises(ConfigurationError, match=r"np must be a non-zero integer, got "):
        HorovodRunner(np=np)  # type: ignore[arg-type]


def test_signature_is_the_databricks_one_plus_keyword_only_extras() -> None:
    params = inspect.signature(HorovodRunner).parameters
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params.values())
    assert params["np"].default is inspect.Parameter.empty
    assert params["driver_log_verbosity"].default == "log_callback_only"
    with pytest.raises(TypeError):
        HorovodRunner(2)  # type: ignore[misc]
    runner = HorovodRunner(np=-2, driver_log_verbosity="all")
    assert (runner.np, runner.num_processor, runner.driver_log_verbosity) == (-2, -2, "all")


def test_bad_verbosity() -> None:
    with pytest.raises(ConfigurationError, match=r"driver_log_verbosity must be 'all' or "
                       r"'log_callback_only', got 'verbose'"):
        HorovodRunner(np=-1, driver_log_verbosity="verbose")


@pytest.mark.parametrize(
    "name", ["start_timeout", "slot_timeout", "timeout", "stop_grace", "idle_timeout"]
)
@pytest.mark.parametrize("value", [0, -1, "10", True])
def test_bad_durations(name: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=rf"{name} must be a positive number of seconds"):
        JobConfig(**{name: value})  # type: ignore[arg-type]


def test_bad_max_line_bytes() -> None:
    with pytest.raises(ConfigurationError, match="max_line_bytes must be an integer >= 80, got 10"):
        HorovodRunner(np=-1, job=JobConfig(max_line_bytes=10))


def test_main_must_be_callable() -> None:
    with pytest.raises(ConfigurationError, match="main must be callable, got int"):
        HorovodRunner(np=-1).run(3)  # type: ignore[arg-type]


def test_unpicklable_kwargs_fail_before_any_process_starts() -> None:
    with pytest.raises(ConfigurationError, match="cannot pickle main or its kwargs"):
        HorovodRunner(np=-1).run(workers.takes_anything, lock=threading.Lock())


def _train(learning_rate: float, epochs: int = 2) -> None:
    """A stand-in training function; the runner must refuse bad calls before it runs."""


def test_a_keyword_main_does_not_take_is_refused_on_the_driver_naming_it(store: str) -> None:
    import mlflow

    before = mlflow.search_runs(search_all_experiments=True)
    with pytest.raises(ConfigurationError) as info:
        HorovodRunner(np=-2).run(_train, learning_rate=0.1, epoch=3, nope=1)
    assert str(info.value) == (
        "run(_train, ...): it takes no argument 'epoch' (did you mean 'epochs'?); it takes "
        "no argument 'nope': main(learning_rate, epochs=2). run(main, **kwargs) calls "
        "main(**kwargs) on every rank"
    )
    with pytest.raises(ConfigurationError) as info:
        HorovodRunner(np=-2).run(_train, epochs=3)
    assert str(info.value) == (
        "run(_train, ...): it needs 'learning_rate': main(learning_rate, epochs=2). "
        "run(main, **kwargs) calls main(**kwargs) on every rank"
    )
    # refused before anything started: no MLflow run, no worker
    assert len(mlflow.search_runs(search_all_experiments=True)) == len(before)
    assert worker_processes() == []


def _flexible(a: int, /, *, b: int, **rest: object) -> None:
    """Positional-only ``a`` cannot come as a keyword; ``**rest`` takes any other name."""


def test_positional_only_and_var_keyword_parameters_are_read_as_python_binds_them() -> None:
    with pytest.raises(ConfigurationError) as info:
        HorovodRunner(np=-1, tracking=TrackingConfig(track=False)).run(_flexible, a=1, b=2, c=3)
    assert str(info.value) == (
        "run(_flexible, ...): it takes no argument 'a'; it needs 'a': main(a, /, *, b, "
        "**rest). run(main, **kwargs) calls main(**kwargs) on every rank"
    )


def test_dynamic_allocation_is_refused_with_the_setting_to_change() -> None:
    with pytest.raises(SparkBarrierUnsupportedError,
                       match="set spark.dynamicAllocation.enabled=false"):
        check_barrier_supported({"spark.dynamicAllocation.enabled": "true"})
    check_barrier_supported({"spark.dynamicAllocation.enabled": "false"})


@pytest.mark.parametrize(
    ("master", "conf", "slots"),
    [
        ("local[4]", {}, 4),
        ("local[4]", {"spark.task.cpus": "2"}, 2),
        ("local", {}, 1),
        ("local-cluster[2,1,1024]", {}, 2),
        ("local-cluster[3, 2, 512]", {}, 6),
        ("spark://m:7077", {"spark.executor.instances": "5", "spark.executor.cores": "4"}, 20),
        ("spark://m:7077", {}, None),
        ("local[*]", {}, None),
    ],
)
def test_expected_slots(master: str, conf: dict[str, str], slots: int | None) -> None:
    assert expected_slots(master, conf) == slots


def test_a_spark_session_that_never_starts_fails_within_start_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow_hvd.backends.spark import session

    hung = threading.Event()  # a JVM that never comes up
    monkeypatch.setattr(session, "resolve_master", lambda np, master, timeout: (None, "local[2]"))
    monkeypatch.setattr(session, "new_session", lambda master, archive: hung.wait(60))
    runner = HorovodRunner(np=2, job=JobConfig(start_timeout=0.5),
        tracking=TrackingConfig(track=False))
    try:
        with pytest.raises(BackendError, match=(
            r"^the SparkSession on local\[2\] did not start within 0.5s \(start_timeout\): "
            r"Spark's JVM is hung or very slow to start; check JAVA_HOME and Spark's driver "
            r"log, or raise start_timeout$"
        )):
            runner.run(workers.echo)
    finally:
        hung.set()


def test_a_session_shipping_an_environment_gets_the_unpacking_allowance_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Spark unpacks spark.archives on the driver as its context starts: the boot waits
    start_timeout + environment_timeout, and says so when even that passes."""
    from mlflow_hvd.backends.spark import session

    archive = tmp_path / "env.tar.gz"
    archive.write_bytes(b"")
    hung = threading.Event()
    shipped: list[str | None] = []

    def unpacking(master: str, archive: str | None) -> None:
        shipped.append(archive)
        hung.wait(60)

    monkeypatch.setattr(session, "resolve_master",
                        lambda np, master, timeout: (None, "spark://m:7077"))
    monkeypatch.setattr(session, "new_session", unpacking)
    runner = HorovodRunner(np=2, job=JobConfig(start_timeout=0.3),
        cluster=ClusterConfig(environment_timeout=0.4,
            ship_environment=str(archive)), tracking=TrackingConfig(track=False))
    try:
        with pytest.raises(BackendError, match=(
            r"^the SparkSession on spark://m:7077 did not start within 0.3s \(start_timeout\) "
            r"\+ 0.4s \(environment_timeout: Spark unpacks the shipped environment on the "
            r"driver too\): "
        )):
            runner.run(workers.echo)
    finally:
        hung.set()
    assert shipped == [str(archive)]

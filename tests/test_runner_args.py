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


def _stop_soon(runner: HorovodRunner, after: float = 0.3) -> threading.Timer:
    timer = threading.Timer(after, runner.stop)
    timer.start()
    return timer


def test_stop_ends_the_wait_for_a_booting_session_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HorovodRunner.stop() reaches the start phases too: a SparkSession that is still
    booting (start_timeout far away) is given up on within a fraction of a second."""
    import time

    from mlflow_hvd.backends.spark import session
    from mlflow_hvd.errors import JobStopped

    hung = threading.Event()
    monkeypatch.setattr(session, "resolve_master", lambda np, master, timeout: (None, "local[2]"))
    monkeypatch.setattr(session, "new_session", lambda master, archive: hung.wait(60))
    runner = HorovodRunner(np=2, job=JobConfig(start_timeout=120),
                           tracking=TrackingConfig(track=False))
    timer = _stop_soon(runner)
    started = time.monotonic()
    try:
        with pytest.raises(JobStopped, match=r"^stopped while starting the SparkSession, "
                                             r"after 0\.\ds \(HorovodRunner\.stop\)$"):
            runner.run(workers.echo)
        assert time.monotonic() - started < 2
    finally:
        hung.set()
        timer.join()


def test_stop_ends_packing_the_environment_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing the venv for the executors (a minute or more) is a phase stop() ends."""
    import time

    from mlflow_hvd.backends.spark import boot, session
    from mlflow_hvd.errors import JobStopped

    hung = threading.Event()
    monkeypatch.setattr(session, "resolve_master",
                        lambda np, master, timeout: (None, "spark://m:7077"))
    monkeypatch.setattr(boot, "archive_of", lambda ship: str(hung.wait(60)))
    runner = HorovodRunner(np=2, cluster=ClusterConfig(ship_environment=True),
                           tracking=TrackingConfig(track=False))
    timer = _stop_soon(runner)
    started = time.monotonic()
    try:
        with pytest.raises(JobStopped,
                           match=r"^stopped while packing the environment for the executors"):
            runner.run(workers.echo)
        assert time.monotonic() - started < 2
    finally:
        hung.set()
        timer.join()


def test_feeding_dataframes_to_local_ranks_is_a_phase_with_a_deadline_and_a_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """np < 0 writes the job's DataFrames on the driver before any rank starts: stopped at
    once by the runner's stop request, and bounded by start_timeout without progress (a
    feed that keeps progressing is not cut short)."""
    import time

    from mlflow_hvd.backends import local
    from mlflow_hvd.common.phases import PhaseTimeout, Progress
    from mlflow_hvd.errors import JobStopped
    from mlflow_hvd.protocol.feed import FeedSpec
    from mlflow_hvd.protocol.job import JobSpec

    spec = JobSpec(np=2, payload=b"", secret=b"s" * 32, driver_host="127.0.0.1",
                   channel_port=1, rendezvous_port=1, job_id="j", description="d",
                   channel_timeout=1.0, max_line_bytes=100, stop_grace=1.0, gloo_iface=None,
                   pooled=False, log_level="", idle_timeout=1.0, horovod_env=(),
                   gpu_resource="gpu", feed=FeedSpec(()))
    release = threading.Event()

    def stalled(spec: object, frame: object, np: int, owned: object,
                progress: Progress | None = None) -> object:
        release.wait(30)
        raise RuntimeError("released")

    def progressing(spec: object, frame: object, np: int, owned: object,
                    progress: Progress | None = None) -> object:
        assert progress is not None
        ticks = 0
        # a chunk every 0.1 s for 1.2 s: longer than the 0.5 s limit, never 0.5 s without one
        while not release.wait(0.1) and ticks < 12:
            progress.tick()
            ticks += 1
        raise RuntimeError(f"fed {ticks} chunks")

    try:
        monkeypatch.setattr(local, "feed_locally", stalled)
        stop = threading.Event()
        backend = local.LocalBackend(frame=object(), stop=stop, feed_timeout=60)
        threading.Timer(0.3, stop.set).start()
        started = time.monotonic()
        with pytest.raises(JobStopped, match=r"^stopped while writing the DataFrames for "
                                             r"the ranks, after 0\.\ds"):
            backend.start(spec, lambda message: None)
        assert time.monotonic() - started < 2

        backend = local.LocalBackend(frame=object(), stop=threading.Event(), feed_timeout=0.5)
        with pytest.raises(PhaseTimeout, match=r"^writing the DataFrames for the ranks did "
                           r"not end within 0\.5s \(start_timeout, without progress\)"):
            backend.start(spec, lambda message: None)

        monkeypatch.setattr(local, "feed_locally", progressing)
        backend = local.LocalBackend(frame=object(), stop=threading.Event(), feed_timeout=0.5)
        with pytest.raises(RuntimeError, match="^fed 12 chunks$"):
            backend.start(spec, lambda message: None)
    finally:
        release.set()

"""Integration: real Horovod ranks in Spark barrier tasks on local-cluster[2,1,1024]."""

from __future__ import annotations

from typing import Any

import pytest
import workers
from conftest import assert_no_workers_left, worker_processes
from services import wait_until

from mlflow_hvd import HorovodRunner, InsufficientSlotsError, JobConfig, WorkerFailedError
from mlflow_hvd.errors import LIFECYCLE_HINT

pytestmark = pytest.mark.spark


def _no_active_jobs(spark: Any, timeout: float = 30.0) -> None:
    tracker = spark.sparkContext.statusTracker()
    wait_until(lambda: not tracker.getActiveJobsIds(), timeout, "Spark's jobs to end")


def _tasks_running(spark: Any, group: str) -> int:
    """Tasks of the job group's stages that Spark still counts as running."""
    tracker = spark.sparkContext.statusTracker()
    running = 0
    for job_id in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job_id)
        for stage_id in info.stageIds if info else ():
            stage = tracker.getStageInfo(stage_id)
            running += stage.numActiveTasks if stage else 0
    return running


@pytest.mark.old_end
def test_two_barrier_tasks_run_real_collectives(
    spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = HorovodRunner(np=2, spark=spark)
    result = runner.run(workers.collectives, scale=3.0)
    assert result["rank"] == 0
    # both executors run on this machine: one host, two local ranks, as horovodrun assigns
    assert (result["size"], result["local_size"], result["cross_size"]) == (2, 2, 1)
    assert result["sum"] == [9.0]
    assert result["mean"] == [0.5]
    assert result["gathered"] == [0, 1, 10, 11]
    assert result["broadcast"] == [100.0]
    out = capsys.readouterr().out
    assert "[1]<log>: rank 1 of 2 says hi\n" in out
    assert "[0]<log>: rank 0 of 2 says hi\n" in out
    # the run is one Spark job in its own job group, visible in the Spark UI
    tracker = spark.sparkContext.statusTracker()
    (job_id,) = tracker.getJobIdsForGroup(runner.last_job_id)
    assert tracker.getJobInfo(job_id).status == "SUCCEEDED"
    assert_no_workers_left()


@pytest.mark.old_end
def test_exception_on_rank_1_cancels_the_job_and_leaves_no_worker(spark: Any) -> None:
    runner = HorovodRunner(np=2, spark=spark, job=JobConfig(stop_grace=2))
    with pytest.raises(WorkerFailedError) as info:
        runner.run(workers.raise_on_rank_1)
    exc = info.value
    tb = exc.root_cause.traceback
    assert tb.endswith("ValueError: boom from rank 1\n")
    assert str(exc) == (
        f"Rank 1 on host {exc.host} failed (exit code 1) [root cause]: "
        "ValueError: boom from rank 1\n"
        f"Traceback of rank 1:\n{tb.rstrip()}\n"
        "Stopped by the driver after the root cause: ranks 0\n" + LIFECYCLE_HINT
    )
    assert worker_processes() == []  # at once: run() returned after every rank was gone
    _no_active_jobs(spark)
    tracker = spark.sparkContext.statusTracker()
    (job_id,) = tracker.getJobIdsForGroup(runner.last_job_id)
    assert tracker.getJobInfo(job_id).status == "FAILED"  # cancelled, not retried


def test_no_rank_outlives_run_after_a_failure_on_spark(spark: Any) -> None:
    """A cancelled task can end before the worker it hosts: run() must wait for the worker.
    Repeated to catch the race."""
    for _ in range(3):  # plus the one of the test above
        runner = HorovodRunner(np=2, spark=spark, job=JobConfig(stop_grace=2))
        with pytest.raises(WorkerFailedError):
            runner.run(workers.raise_on_rank_1)
        assert worker_processes() == []
        # nor does one start later: once Spark counts none of the job's tasks running, no
        # task is left that could start a worker
        group = str(runner.last_job_id)
        wait_until(lambda: _tasks_running(spark, group) == 0, 60,  # noqa: B023
                   "the job's tasks to end")
        assert worker_processes() == []


def test_sigkill_on_rank_1_in_a_barrier_task(spark: Any) -> None:
    with pytest.raises(WorkerFailedError) as info:
        HorovodRunner(np=2, spark=spark, job=JobConfig(stop_grace=2)).run(workers.sigkill_on_rank_1)
    assert str(info.value) == (
        f"Rank 1 on host {info.value.host} failed (killed by signal SIGKILL) [root cause]\n"
        "Last 1 lines of output of rank 1:\n"
        "[1]<stdout>: rank 1 about to SIGKILL itself\n"
        "Stopped by the driver after the root cause: ranks 0\n" + LIFECYCLE_HINT
    )
    _no_active_jobs(spark)
    assert_no_workers_left()


@pytest.mark.timeout(120)  # waiting out slot_timeout instead would fail here
def test_np_larger_than_the_cluster_fails_at_once(spark: Any) -> None:
    runner = HorovodRunner(np=3, spark=spark, job=JobConfig(slot_timeout=3600))
    with pytest.raises(InsufficientSlotsError) as info:
        runner.run(workers.echo)
    # refused before a Spark job was submitted
    assert spark.sparkContext.statusTracker().getJobIdsForGroup(runner.last_job_id) == []
    assert str(info.value) == (
        "np=3 needs 3 concurrent barrier task slots but the Spark cluster (master "
        "local-cluster[2,1,1024]) offers 2 and can offer at most 2 (spark.executor.cores="
        "default, spark.task.cpus=1). Lower np, add executors or cores, or raise "
        "HorovodRunner(job=JobConfig(slot_timeout=...)) if executors are still starting"
    )
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []


def test_the_master_is_resolved_once_per_run(spark: Any, store: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow_hvd.backends.spark import session

    calls: list[str | None] = []
    resolve = session.resolve_master

    def counted(np: int, master: str | None = None, timeout: float = 30.0) -> Any:
        calls.append(master)
        return resolve(np, master, timeout)

    monkeypatch.setattr(session, "resolve_master", counted)
    runner = HorovodRunner(np=2)  # the active session; tracked: the master is also a tag
    assert runner.run(workers.echo, x=1)["kwargs"] == {"x": 1}
    assert runner.run(workers.echo, x=2)["kwargs"] == {"x": 2}
    assert calls == [None, None]  # once per run, not once per use


def test_a_session_whose_python_lacks_mlflow_hvd_is_said_in_words(tmp_path: Any) -> None:
    """A user's own session started without the driver's environment (here: Spark's Python
    workers on the venv's base interpreter, as ``python3`` from PATH is when the venv is
    not activated): the failure says which setting to change and to what."""
    import os
    import subprocess
    import sys

    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    assert subprocess.run([base, "-c", "import mlflow_hvd"], capture_output=True, timeout=60,
                          cwd=tmp_path).returncode != 0, f"{base} has mlflow_hvd: pick another"
    code = (
        "from pyspark.sql import SparkSession\n"
        "from mlflow_hvd import HorovodRunner, TrackingConfig\n"
        "spark = (SparkSession.builder.master('local[1]').config('spark.ui.enabled', 'false')"
        ".getOrCreate())\n"
        "try:\n"
        "    HorovodRunner(np=1, spark=spark, tracking=TrackingConfig(track=False)).run(int)\n"
        "except Exception as exc:\n"
        "    print('ERROR', type(exc).__name__, exc)\n")
    # as a user's shell has it: no test's PYTHONPATH (it holds the checkout) or PYSPARK_*
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(
        "PYSPARK")}
    env["PYSPARK_PYTHON"] = base  # what the context reads when it starts
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR")), "")
    assert line.startswith("ERROR BackendError "), proc.stderr[-3000:]
    assert "the executors' Python cannot import mlflow_hvd" in line
    assert f"Start the session with PYSPARK_PYTHON={sys.executable}" in line


def _two_executors(spark: Any) -> bool:
    """Ask the standalone master for two executors again (killing one lowered the
    application's executor limit by one, so it was not replaced)."""
    jvm = spark.sparkContext._jvm
    return bool(spark.sparkContext._jsc.sc().requestTotalExecutors(
        2, 0, jvm.PythonUtils.toScalaMap({})))


def test_slots_back_during_the_last_epoch_finish_the_job_without_a_restart(
        spark: Any, store: str, tmp_path: Any) -> None:
    """np=2, min_np=1 with one of the two executors removed: the attempt runs on 1 rank. A
    new executor registers while the last epoch waits, and a look of the job's elastic
    controller finds the 2 slots; the last epoch's checkpoint (the loop does not say it is
    its last) restarts nothing: run() returns the attempt's value (attempt 0, every epoch
    trained once, on 1 rank), one FINISHED run, each epoch logged once."""
    import threading
    from pathlib import Path

    import mlflow

    context = spark.sparkContext._jsc.sc()
    memory = context.getExecutorMemoryStatus  # the executors and the driver
    wait_until(lambda: memory().size() >= 3, 60, "both executors")
    client = mlflow.MlflowClient()
    assert context.killExecutor(context.getExecutorIds().apply(0))
    requested = False
    try:
        wait_until(lambda: memory().size() == 2, 60, "the executor's removal")
        gate = str(tmp_path / "gate")
        runner = HorovodRunner(np=2, spark=spark, job=JobConfig(
            min_np=1, max_failures=1, slot_timeout=1, grow_interval=0.2))
        ended: list[Any] = []

        def run() -> None:
            try:
                ended.append(runner.run(workers.ddp_held_at_its_last_epoch, epochs=3,
                                        gate=gate))
            except BaseException as exc:
                ended.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        wait_until(lambda: Path(gate + ".last").exists() or ended, 180, "the last epoch")
        assert Path(gate + ".last").read_text() == "1", ended
        requested = _two_executors(spark)
        assert requested
        wait_until(lambda: memory().size() >= 3, 60, "a new executor")
        wait_until(lambda: [m.value for m in client.get_metric_history(
            str(runner.last_run_id), "mlflow_hvd.slots_back")] == [1.0], 30,
            "a look finding the slots back, recorded in the run")
        Path(gate + ".go").write_text("")
        thread.join(120)
        assert not thread.is_alive(), "run() did not return"
    finally:
        if not requested:
            _two_executors(spark)
        wait_until(lambda: memory().size() >= 3, 60, "the session's two executors again")
    assert ended == [{"attempt": 0, "size": 1, "trained": [0, 1, 2]}]
    assert client.get_run(runner.last_run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(runner.last_run_id, "loss")] == [0, 1, 2]
    assert [m.value for m in client.get_metric_history(runner.last_run_id,
                                                       "mlflow_hvd.attempt")] == [0.0]


def test_an_executor_killed_while_the_job_starts_is_retried_and_the_attempt_recorded(
        spark: Any, store: str, tmp_path: Any) -> None:
    """np=2 on the session's two executors, max_failures=1: one executor is killed as soon
    as the job's barrier stage runs, while its ranks start. The attempt fails as a lost
    executor (a backend failure: retried), is recorded in the run with its error, and the
    next attempt, on a replacement executor, returns the value. The ranks wait for a gate
    the test opens once the executor is gone (a kill is asynchronous: on a busy machine
    the first attempt's ranks could otherwise finish before it lands)."""
    import threading
    from pathlib import Path

    import mlflow

    context = spark.sparkContext._jsc.sc()
    memory = context.getExecutorMemoryStatus  # the executors and the driver
    tracker = spark.sparkContext.statusTracker()
    wait_until(lambda: memory().size() >= 3, 60, "both executors")
    runner = HorovodRunner(np=2, spark=spark, job=JobConfig(max_failures=1, slot_timeout=120))
    ended: list[Any] = []

    def run() -> None:
        try:
            ended.append(runner.run(workers.echo_at, gate=gate, x=1))
        except BaseException as exc:
            ended.append(exc)

    gate = str(tmp_path / "gate")
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        stage = wait_until(lambda: tracker.getActiveStageIds(), 120, "the job's barrier stage")
        assert context.killExecutor(context.getExecutorIds().apply(0))
        assert not ended, ended  # the kill came while the ranks were starting
        wait_until(lambda: memory().size() == 2, 60, "the executor's removal")
        Path(gate).write_text("")
        assert _two_executors(spark)  # the retry needs two slots again
        thread.join(240)
        assert not thread.is_alive(), "run() did not return"
    finally:
        Path(gate).write_text("")  # on every path: no rank is left waiting
        _two_executors(spark)
        wait_until(lambda: memory().size() >= 3, 60, "the session's two executors again")
    assert stage and len(ended) == 1 and isinstance(ended[0], dict), ended
    assert ended[0]["kwargs"] == {"x": 1} and ended[0]["rank"] == 0
    client = mlflow.MlflowClient()
    run = client.get_run(str(runner.last_run_id))
    assert run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id,
                                                       "mlflow_hvd.attempt")] == [0.0, 1.0]
    text = mlflow.artifacts.load_text(
        f"runs:/{run.info.run_id}/attempts/attempt_0_error.txt")
    # the stage failed with its task on the lost executor (Spark's words follow)
    assert text.startswith("BackendError: the spark backend failed before all ranks "
                           "finished"), text
    assert "barrier" in text, text

"""The warm rank pool: ``with HorovodRunner(...)`` keeps ranks up between runs."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import mlflow
import psutil
import pytest
import workers
from conftest import assert_no_workers_left, worker_processes
from services import wait_until

from mlflow_hvd import HorovodRunner, JobConfig, TrackingConfig, WorkerFailedError
from mlflow_hvd.errors import ConfigurationError


@pytest.mark.ranks
def test_local_pool_reuses_its_ranks_with_fresh_horovod_keras_and_run(store: str) -> None:
    runner = HorovodRunner(np=-2)
    client = mlflow.MlflowClient()
    with runner:
        first = runner.run(workers.pool_probe, k=0)
        run_ids = [runner.last_run_id]
        second = runner.run(workers.pool_probe, k=5)
        run_ids.append(runner.last_run_id)
        assert len(worker_processes()) == 2  # idle between runs, not gone
    assert first["sum"] == [1.0] and second["sum"] == [11.0]  # (0+k) + (1+k)
    assert first["pids"] == second["pids"]  # the same two processes ran both jobs
    assert first["layer"] == second["layer"] == "dense"  # Keras' state was cleared
    # the first job's garbage was collected before what survived it was frozen
    assert first["previous_cycle_collected"] is None
    assert second["previous_cycle_collected"] is True
    assert run_ids[0] != run_ids[1]  # each run() has its own MLflow run...
    for run_id, k in zip(run_ids, (0, 5), strict=True):
        run = client.get_run(str(run_id))
        assert run.info.status == "FINISHED"
        assert [m.value for m in client.get_metric_history(str(run_id), "k")] == [float(k)]
    assert_no_workers_left()  # leaving the block retired the ranks


@pytest.mark.ranks
def test_a_failed_job_replaces_the_ranks_and_the_pool_goes_on() -> None:
    runner = HorovodRunner(np=-2, job=JobConfig(stop_grace=2), tracking=TrackingConfig(track=False))
    with runner:
        before = runner.run(workers.pool_probe, k=1)
        with pytest.raises(WorkerFailedError) as info:
            runner.run(workers.pool_probe, k=2, fail=True)
        assert info.value.root_cause.rank == 1
        assert "RuntimeError: job 2 fails on rank 1" in str(info.value)
        after = runner.run(workers.pool_probe, k=3)
    assert after["sum"] == [7.0]
    assert not set(before["pids"]) & set(after["pids"])  # new processes after the failure
    assert_no_workers_left()


@pytest.mark.ranks
def test_a_rank_killed_while_idle_is_replaced_at_the_next_run() -> None:
    """A warm rank killed between jobs, its exit seen before the next run (the test waits
    on the generation's record of it): the next job goes to a new generation at once, the
    old one's refusal naming the rank, and no attempt is spent. (Its exit seen only after
    the hand-out is forced in test_a_rank_lost_after_taking_a_job_but_before_starting_it_
    reruns_the_job.)"""
    from mlflow_hvd.driver.pool import Placement

    runner = HorovodRunner(np=-2, job=JobConfig(stop_grace=2), tracking=TrackingConfig(track=False))
    with runner:
        before = runner.run(workers.pool_probe, k=1)
        pool = runner._pool
        first = pool.live
        assert first is not None
        os.kill(before["pids"][1], signal.SIGKILL)
        wait_until(lambda: first.lost, 30, "the killed rank's exit recorded")
        # only the killed rank: a rank that finished its job and waits is not "lost"
        assert first.lost == {1: "rank 1 on localhost (exit -9)"}
        psutil.Process(before["pids"][0])  # rank 0 is still there, idle
        after = runner.run(workers.pool_probe, k=1)
        second = runner.run(workers.pool_probe, k=1)
    assert before["pids"][1] not in after["pids"]
    assert after["pids"] == second["pids"]  # the new generation stays warm
    assert after["sum"] == second["sum"] == [3.0]
    assert pool.history == [
        Placement(pool.history[0].job_id, 1, handed=False),
        Placement(pool.history[1].job_id, 2, handed=False, refused=(
            "a pooled rank ended between jobs: rank 1 on localhost (exit -9)")),
        Placement(pool.history[2].job_id, 2, handed=True)]
    assert_no_workers_left()


def test_nested_warm_blocks_are_refused() -> None:
    runner = HorovodRunner(np=-1, tracking=TrackingConfig(track=False))
    with runner, pytest.raises(ConfigurationError, match="already kept warm"):
        runner.__enter__()


@pytest.mark.slow
def test_spark_pool_keeps_one_barrier_stage_and_frees_its_slots_on_error(spark: Any) -> None:
    runner = HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False))
    tracker = spark.sparkContext.statusTracker()
    with pytest.raises(KeyError), runner:
        first = runner.run(workers.pool_probe, k=0)
        second = runner.run(workers.pool_probe, k=1)
        assert len(tracker.getActiveJobsIds()) == 1  # the stage stays up between runs
        raise KeyError("the user's code fails inside the block")
    assert first["sum"] == [1.0] and second["sum"] == [3.0]
    assert first["pids"] == second["pids"] and first["size"] == 2
    assert tracker.getActiveJobsIds() == []  # the slots are free again
    assert_no_workers_left()


def test_warm_ranks_idle_past_the_limit_are_retired_and_replaced() -> None:
    from mlflow_hvd.driver.generation import GenerationState
    from mlflow_hvd.driver.pool import Placement

    runner = HorovodRunner(np=-2, job=JobConfig(idle_timeout=1),
        tracking=TrackingConfig(track=False))
    with runner:
        first = runner.run(workers.echo, x=1)
        pool = runner._pool
        retired = pool.live
        assert retired is not None
        wait_until(lambda: worker_processes() == [], 30, "the idle ranks to be retired")
        assert retired.state is GenerationState.EXPIRED
        second = runner.run(workers.echo, x=2)
    assert (first["kwargs"], second["kwargs"]) == ({"x": 1}, {"x": 2})
    assert first["pid"] != second["pid"]  # retired, then replaced
    history = pool.history
    assert history == [Placement(history[0].job_id, 1, handed=False),
                       Placement(history[1].job_id, 2, handed=False,
                                 refused="the warm ranks are expired")]
    assert_no_workers_left()


class _NoRanks:
    """A backend that starts nothing: the test plays the ranks over the channel."""

    name = "none"

    def start(self, job: Any, sink: Any) -> None: ...
    def stop(self) -> None: ...
    def wait(self, timeout: float) -> bool:
        return True
    def close(self) -> None: ...
    def describe(self) -> dict[str, str]:
        return {}


def test_a_ranks_exit_between_jobs_is_seen_by_the_hand_out_or_reaches_the_next_job() -> None:
    """Over the real channel, both ranks ask for the next job, then rank 1's exit report
    arrives: before the hand-out, the hand-out refuses the generation naming it; after it,
    the report is in the next job's own events (its loop then fails it by name). Nothing
    of the last job is in the next job's events. (With one queue for every job, checked
    and then emptied by the hand-out while reports were put without its lock, a report
    arriving in between was dropped; the report is now recorded under that lock.)"""
    from driver_jobs import settings

    from mlflow_hvd.common.deadline import Deadline
    from mlflow_hvd.driver.generation import Generation
    from mlflow_hvd.driver.job import Job
    from mlflow_hvd.errors import BackendError
    from mlflow_hvd.protocol.channel import ChannelClient
    from mlflow_hvd.protocol.messages import AwaitJob, NextJob, OutputLines, Stream, WorkerExited

    def generation_waiting() -> tuple[Generation, list[object], list[threading.Thread]]:
        gen = Generation(2, _NoRanks(), "127.0.0.1", warm=True)  # type: ignore[arg-type]
        gen.launch(Job(2, b"first", settings()))
        answers: list[object] = []
        asks = [threading.Thread(target=lambda r=r: answers.append(ChannelClient(
            "127.0.0.1", gen.port, gen.secret, timeout=10).request(AwaitJob(r), 30)))
            for r in (0, 1)]
        for ask in asks:
            ask.start()
        return gen, answers, asks

    exit_1 = WorkerExited(1, "localhost", -9, time.time())
    gen, answers, asks = generation_waiting()
    try:
        gen._route(exit_1)  # the report arrives while the ranks wait
        with pytest.raises(BackendError, match="^a pooled rank ended between jobs: rank 1 on "
                                               r"localhost \(exit -9\)$"):
            gen.hand_out(Job(2, b"next", settings()), Deadline.after(10))
    finally:
        gen.close(stop_now=False)
        for ask in asks:
            ask.join(timeout=10)
    gen, answers, asks = generation_waiting()
    try:
        stale = OutputLines(0, Stream.STDOUT, ("the first job's last line",))
        gen._route(stale)
        gen.hand_out(Job(2, b"next", settings()), Deadline.after(10))
        gen._route(exit_1)  # after the hand-out: the next job's loop gets it
        events = []
        while not gen.events.empty():
            events.append(gen.events.get_nowait())
        assert events == [exit_1]
        for ask in asks:
            ask.join(timeout=10)
        assert [type(a) for a in answers] == [NextJob, NextJob]
    finally:
        gen.close(stop_now=False)


def test_ranks_that_do_not_ask_for_the_next_job_in_time_end_the_generation() -> None:
    from driver_jobs import settings

    from mlflow_hvd.common.deadline import Deadline
    from mlflow_hvd.driver.generation import Generation, GenerationState
    from mlflow_hvd.driver.job import Job
    from mlflow_hvd.errors import BackendError
    from mlflow_hvd.protocol.channel import ChannelClient
    from mlflow_hvd.protocol.messages import AwaitJob, Retire

    gen = Generation(2, _NoRanks(), "127.0.0.1", warm=True)
    gen.launch(Job(2, b"first", settings()))
    answers: list[object] = []
    client = ChannelClient("127.0.0.1", gen.port, gen.secret, timeout=10)
    asks = threading.Thread(target=lambda: answers.append(client.request(AwaitJob(0), 30)))
    try:
        asks.start()  # rank 0 asks for the next job; rank 1 never does
        wait_until(lambda: gen.waiting == {0}, 10, "rank 0 waiting for the next job")
        with pytest.raises(BackendError, match=(
            "^pooled ranks 1 did not ask for the next job in time$"
        )):
            gen.hand_out(Job(2, b"next", settings()), Deadline.after(0.3))
    finally:
        gen.close(stop_now=False)
        asks.join(timeout=10)
        client.close()
    assert gen.state is GenerationState.CLOSED
    assert [type(a) for a in answers] == [Retire]  # the waiting rank was let go


def test_a_rank_lost_after_taking_a_job_but_before_starting_it_reruns_the_job() -> None:
    from mlflow_hvd.driver.pool import Placement
    from mlflow_hvd.driver.retry import FailureKind

    runner = HorovodRunner(np=-2, job=JobConfig(stop_grace=2), tracking=TrackingConfig(track=False))
    with runner:
        assert runner.run(workers.echo, x=1)["kwargs"] == {"x": 1}
        pool = runner._pool
        live = pool.live
        assert live is not None
        (rank_1,) = [p for p in worker_processes() if p.environ().get("HOROVOD_RANK") == "1"]
        # stopped only once it has asked for the next job (a busy machine may take seconds)
        wait_until(lambda: 1 in live.waiting, 60, "rank 1 to ask for the next job")
        rank_1.send_signal(signal.SIGSTOP)  # it asked for the next job; it will not take it
        done: dict[str, Any] = {}
        second = threading.Thread(target=lambda: done.update(out=runner.run(workers.echo, x=2)))
        second.start()
        try:
            wait_until(lambda: live.jobs == 2, 60, "the job handed to rank 1")
            rank_1.kill()  # lost before it could start the job
            second.join(timeout=120)
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank_1.kill()
            second.join(timeout=60)
    assert done["out"]["kwargs"] == {"x": 2}  # run again, on new ranks
    assert done["out"]["pid"] != rank_1.pid
    history = pool.history
    assert history == [  # the second job never ran on generation 1: run again on new ranks
        Placement(history[0].job_id, 1, handed=False),
        Placement(history[1].job_id, 1, handed=True, failure=FailureKind.NOT_STARTED),
        Placement(history[2].job_id, 2, handed=False)]
    assert_no_workers_left()

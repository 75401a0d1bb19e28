"""The driver loop, driven by a fake backend: no processes, no Spark."""

from __future__ import annotations

import dataclasses
import io
import threading
import time
from collections.abc import Callable

import cloudpickle
import pytest
from driver_jobs import run_job, settings
from services import wait_until

from mlflow_hvd.common.layout import assign_slots
from mlflow_hvd.driver import Job, Verbosity
from mlflow_hvd.errors import (
    LIFECYCLE_HINT,
    BackendError,
    DataInputError,
    EnvironmentArchiveError,
    RunTimeoutError,
    StartTimeoutError,
    WorkerFailedError,
)
from mlflow_hvd.protocol.feed import FeedFault
from mlflow_hvd.protocol.job import JobSpec
from mlflow_hvd.protocol.messages import (
    BackendFinished,
    CheckpointCommitted,
    EnvironmentMismatch,
    FeedFailed,
    FeedProgress,
    JobEnded,
    LayoutReport,
    OutputLines,
    Sink,
    Stream,
    WorkerError,
    WorkerExited,
    WorkerResult,
    WorkerStarted,
)

Script = Callable[[Sink, threading.Event], None]


class FakeBackend:
    """Plays a script of messages from a thread; records stop/close calls.

    An exception in the script (e.g. a failed expectation) is kept and re-raised by
    :func:`_run`, so it fails the test instead of only warning from a thread.
    """

    name = "fake"

    def __init__(self, script: Script) -> None:
        self.script = script
        self.stopped = threading.Event()
        self.stopped_by_driver = False  # stop() was called before close()
        self.closed = False
        self.error: BaseException | None = None
        self.job: JobSpec | None = None
        self._thread: threading.Thread | None = None

    def start(self, job: JobSpec, sink: Sink) -> None:
        self.job = job
        sink(LayoutReport(0, assign_slots(["h"] * job.np)))
        self._thread = threading.Thread(target=self._play, args=(sink,))
        self._thread.start()

    def _play(self, sink: Sink) -> None:
        try:
            self.script(sink, self.stopped)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        if not self.closed:
            self.stopped_by_driver = True
        self.stopped.set()

    def wait(self, timeout: float) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        self.closed = True
        self.stopped.set()
        self.wait(10)

    def describe(self) -> dict[str, str]:
        return {"backend": self.name}


def _run(script: Script, np: int = 2, **overrides: object) -> tuple[object, FakeBackend, str]:
    backend = FakeBackend(script)
    out = io.StringIO()
    try:
        payload = run_job(backend, Job(np, b"", settings(**overrides), "test"), out=out)
    finally:
        if backend.error is not None:
            raise backend.error
    return cloudpickle.loads(payload), backend, out.getvalue()


def _ok(sink: Sink, rank: int, value: object = None) -> None:
    sink(WorkerStarted(rank, "h"))
    if rank == 0:
        sink(WorkerResult(0, cloudpickle.dumps(value)))
    sink(WorkerExited(rank, "h", 0, time.time()))


def _until_stopped(sink: Sink, stop: threading.Event, rank: int) -> None:
    if not stop.wait(10):
        raise AssertionError("the driver never stopped the backend")
    sink(WorkerExited(rank, "h", -15, time.time(), stopped=True))


def _elastic_run(script: Script, back: bool = True) -> tuple[object, FakeBackend, str]:
    """``script`` run as an elastic attempt on 2 of 4 ranks whose controller's look found
    the missing slots ``back``: (rank 0's value or GrowingBack, the backend, the job id)."""
    from mlflow_hvd.driver import RankPool
    from mlflow_hvd.driver.elastic import GrowBack

    grow = GrowBack(4, 2, interval=60, slots_back=lambda: back)
    grow.look()
    backend = FakeBackend(script)
    pool = RankPool(lambda _feed, _np: (backend, "127.0.0.1"), warm=False)
    job = dataclasses.replace(Job(2, b"", settings(), "test"), grow=grow)
    try:
        ended = pool.run(job, io.StringIO())
    finally:
        pool.close()
    if backend.error is not None:
        raise backend.error
    return (ended if not isinstance(ended, bytes) else cloudpickle.loads(ended)), backend, \
        job.job_id


def test_a_job_whose_missing_slots_are_back_ends_at_a_checkpoint_for_a_restart() -> None:
    """The controller's decision at rank 0's committed checkpoint ends the job with
    GrowingBack (a value, not an exception): its ranks are stopped and the backend closed."""
    from mlflow_hvd.driver.supervisor import GrowingBack

    def script(sink: Sink, stop: threading.Event) -> None:
        for rank in (0, 1):
            sink(WorkerStarted(rank, "h"))
        sink(CheckpointCommitted(0, 2, last=False))
        for rank in (0, 1):
            _until_stopped(sink, stop, rank)

    ended, backend, job_id = _elastic_run(script)
    assert ended == GrowingBack(job_id, 2)
    assert backend.stopped_by_driver and backend.closed


def test_a_job_that_finished_is_never_restarted() -> None:
    """The slots are back during the last epoch: its checkpoint (the loop's last, or one
    that does not say) is followed by rank 0's value, which the job returns; a checkpoint
    reported after a rank ended changes nothing."""
    def finishing(*commits: CheckpointCommitted) -> Script:
        def script(sink: Sink, stop: threading.Event) -> None:
            for rank in (0, 1):
                sink(WorkerStarted(rank, "h"))
            for commit in commits:
                sink(commit)
            sink(WorkerResult(0, cloudpickle.dumps("trained")))
            sink(WorkerExited(1, "h", 0, time.time()))
            sink(CheckpointCommitted(0, 9, last=False))  # late: rank 1 has ended
            sink(WorkerExited(0, "h", 0, time.time()))
        return script

    for commits in ((CheckpointCommitted(0, 5, last=True),),
                    (CheckpointCommitted(0, 5, last=None),),
                    (CheckpointCommitted(0, 4, last=True), CheckpointCommitted(0, 5, True))):
        ended, backend, _ = _elastic_run(finishing(*commits))
        assert ended == "trained", commits
        assert not backend.stopped_by_driver


def test_success_returns_rank0_value_and_closes_backend() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        _ok(sink, 1)
        _ok(sink, 0, {"answer": 42})

    value, backend, _ = _run(script)
    assert value == {"answer": 42}
    assert backend.closed


def test_log_callback_only_shows_log_lines_but_keeps_stdout_for_failures() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(OutputLines(1, Stream.STDOUT, ("noise",)))
        sink(OutputLines(1, Stream.LOG, ("progress 50%",)))
        _ok(sink, 1)
        _ok(sink, 0)

    _, _, out = _run(script)
    assert out == "[1]<log>: progress 50%\n"


def test_verbosity_all_shows_every_line_prefixed() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(OutputLines(1, Stream.STDOUT, ("a", "b")))
        sink(OutputLines(0, Stream.STDERR, ("c",)))
        _ok(sink, 1)
        _ok(sink, 0)

    _, _, out = _run(script, verbosity=Verbosity.ALL)
    assert out == "[1]<stdout>: a\n[1]<stdout>: b\n[0]<stderr>: c\n"


def test_first_failure_is_root_cause_and_others_are_stopped() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(WorkerStarted(0, "h"))
        sink(WorkerStarted(1, "h"))
        sink(WorkerStarted(2, "h"))
        sink(OutputLines(1, Stream.STDOUT, ("working",)))
        sink(WorkerError(1, "h", "ValueError: boom", "Traceback...\nValueError: boom\n", 10.0))
        sink(WorkerExited(1, "h", 1, 10.5))
        # rank 2 notices later and fails too; rank 0 is stopped by the driver
        sink(WorkerError(2, "h", "HorovodInternalError: gone", "tb2", 11.0))
        sink(WorkerExited(2, "h", 1, 11.5))
        _until_stopped(sink, stop, 0)

    backend = FakeBackend(script)
    with pytest.raises(WorkerFailedError) as info:
        run_job(backend, Job(3, b"", settings(), "test"), out=io.StringIO())
    assert backend.error is None
    assert backend.stopped_by_driver
    exc = info.value
    assert (exc.rank, exc.host, exc.exit_code) == (1, "h", 1)
    assert [f.rank for f in exc.failures] == [1, 2]
    assert exc.stopped_ranks == (0,)
    assert str(exc) == (
        "Rank 1 on host h failed (exit code 1) [root cause]: ValueError: boom\n"
        "Traceback of rank 1:\nTraceback...\nValueError: boom\n"
        "Also failed afterwards: rank 2 on host h (exit code 1): HorovodInternalError: gone\n"
        "Stopped by the driver after the root cause: ranks 0\n" + LIFECYCLE_HINT
    )


def test_earliest_timestamp_wins_even_if_it_arrives_later() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(WorkerExited(0, "h", 1, 20.0))
        sink(WorkerExited(1, "h", -9, 19.0))

    with pytest.raises(WorkerFailedError) as info:
        _run(script)
    assert info.value.rank == 1
    assert "killed by signal SIGKILL" in str(info.value)


@pytest.mark.timeout(60)  # a hang fails here, not after the suite's 600 s
def test_rank_that_never_reports_after_failure_does_not_hang_the_driver() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(WorkerExited(1, "h", 3, 1.0))  # rank 0 never reports at all

    backend = FakeBackend(script)
    with pytest.raises(WorkerFailedError) as info:
        run_job(backend, Job(2, b"", settings(stop_grace=0.5, report_grace=0.5), "test"),
                out=io.StringIO())
    assert backend.stopped_by_driver
    assert info.value.stopped_ranks == (0,)  # the driver stopped the job it never heard of
    assert info.value.unreported_ranks == ()


def test_rank_lost_without_a_stop_is_reported_as_unreported() -> None:
    from mlflow_hvd.driver.supervisor import JobRecord, JobState

    job = JobRecord(np=2)
    job.exited[1] = WorkerExited(1, "h", 3, 1.0)
    job.fail(1.0)
    assert job.state is JobState.FAILING  # no stop sent yet
    failures, stopped, unreported = job.failures()
    assert ([f.rank for f in failures], stopped, unreported) == ([1], [], [0])
    exc = WorkerFailedError(failures[0], failures, stopped, unreported)
    assert str(exc).endswith(
        "No exit report reached the driver from ranks 0 (their task or host may be lost)\n"
        + LIFECYCLE_HINT
    )


def test_start_timeout_names_missing_ranks_and_setting() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(WorkerStarted(0, "h"))
        stop.wait(10)

    with pytest.raises(StartTimeoutError) as info:
        _run(script, start_timeout=0.5)
    assert str(info.value) == (
        "1 of 2 ranks started; the others not within 0.5s of the last one (missing ranks: "
        "1). Raise HorovodRunner(job=JobConfig(start_timeout=...)) if workers are slow to start, "
        "or check "
        "that the cluster has free slots"
    )


def test_ranks_arriving_steadily_past_the_start_timeout_are_not_stuck() -> None:
    """Many ranks sharing a node's cores arrive one after another: the start deadline counts
    from the latest arrival, so 4 ranks 0.3 s apart start under a 0.5 s deadline."""
    def script(sink: Sink, stop: threading.Event) -> None:
        for rank in (1, 2, 3):
            sink(WorkerStarted(rank, "h"))
            stop.wait(0.3)  # a slow rank's start (returns at once if the driver stopped)
        _ok(sink, 0, "done")
        for rank in (1, 2, 3):
            sink(WorkerExited(rank, "h", 0, time.time()))

    value, _, _ = _run(script, np=4, start_timeout=0.5)
    assert value == "done"


def test_run_timeout() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(WorkerStarted(0, "h"))
        sink(WorkerStarted(1, "h"))
        stop.wait(10)

    with pytest.raises(RunTimeoutError, match=r"did not finish within 1s \(0 of 2 ranks exited\)"):
        _run(script, timeout=1.0)


def test_backend_failure_is_reported() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(BackendFinished("SparkException: executor lost"))

    with pytest.raises(BackendError, match=r"the fake backend failed before all ranks finished "
                       r"\(0 of 2 exited\): SparkException: executor lost"):
        _run(script)


def test_backend_failure_names_the_ranks_and_hosts_that_went_silent() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        for rank, host in ((0, "node-a"), (1, "node-a"), (2, "node-b"), (3, "node-b")):
            sink(WorkerStarted(rank, host))
        sink(WorkerExited(1, "node-a", 0, 1.0))
        sink(BackendFinished("Job aborted due to stage failure: worker lost"))

    with pytest.raises(BackendError) as info:
        _run(script, np=4)
    assert str(info.value) == (
        "the fake backend failed before all ranks finished (1 of 4 exited; no exit report "
        "from ranks 0 on node-a; 2, 3 on node-b): Job aborted due to stage failure: worker lost"
    )


def test_spark_errors_are_summarised_to_their_cause() -> None:
    from mlflow_hvd.backends.spark.backend import summarize_spark_error

    java = RuntimeError(
        "An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collect.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not "
        "recover from a failed barrier ResultStage. (ExecutorLostFailure: worker lost)\n"
        "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages"
    )
    assert summarize_spark_error(java) == (
        "Job aborted due to stage failure: Could not recover from a failed barrier "
        "ResultStage. (ExecutorLostFailure: worker lost)"
    )
    assert summarize_spark_error(RuntimeError("x\n  ValueError: boom\n")) == "ValueError: boom"
    assert summarize_spark_error(RuntimeError("just this")) == "RuntimeError: just this"


def test_a_task_error_is_recognised_by_its_class_not_its_words() -> None:
    """The Connect hint follows a task's ChannelError, found by the class its traceback names
    (a ChannelError of other words too; another error with the same words not)."""
    from mlflow_hvd.backends.spark.failures import task_raised
    from mlflow_hvd.errors import AuthenticationError, ChannelError

    trace = ("An exception was thrown from the Python worker.\n"
             "Traceback (most recent call last):\n"
             "ConnectionRefusedError: [Errno 111] Connection refused\n\n"
             "The above exception was the direct cause of the following exception:\n\n"
             "mlflow_hvd.errors.ChannelError: {}\n"
             "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException")
    assert task_raised(RuntimeError(trace.format("cannot reach the mlflow_hvd driver")),
                       ChannelError)
    assert task_raised(RuntimeError(trace.format("other words")), ChannelError)
    assert task_raised(RuntimeError("ChannelError: short name"), ChannelError)
    assert not task_raised(RuntimeError(
        "ValueError: cannot reach the mlflow_hvd driver at 10.0.0.1:5"), ChannelError)
    assert not task_raised(RuntimeError(trace.format("x")), AuthenticationError)
    assert not task_raised(RuntimeError("no python error here"), ChannelError)


def test_all_exit_zero_without_result_is_an_error() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        for r in (0, 1):
            sink(WorkerExited(r, "h", 0, 1.0))

    with pytest.raises(BackendError, match="rank 0 sent no return value"):
        _run(script)


def test_secret_is_not_in_job_repr() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        _ok(sink, 0)

    _, backend, _ = _run(script, np=1)
    assert backend.job is not None
    assert backend.job.secret.hex() not in repr(backend.job)
    assert "secret" not in repr(backend.job)


@pytest.mark.timeout(60)  # a hang fails here, not after the suite's 600 s
def test_backend_finished_without_every_exit_report_does_not_hang() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        _ok(sink, 0)
        sink(BackendFinished())  # rank 1's exit report never arrives

    with pytest.raises(BackendError) as info:
        _run(script, report_grace=0.5)
    assert str(info.value) == (
        "the fake backend finished but ranks 1 never reported their exit within 0.5s of it; "
        "their output was lost on the way to the driver"
    )


def test_a_job_whose_value_arrived_succeeds_when_only_an_exit_report_is_lost(
        caplog: pytest.LogCaptureFixture) -> None:
    """Both ranks started, rank 0 sent its value, the backend finished cleanly, and rank
    1's exit report never came: the job trained, and it is not reported failed."""
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(WorkerStarted(1, "h"))
        _ok(sink, 0, value="trained")
        sink(BackendFinished())

    value, backend, _ = _run(script, report_grace=0.5)
    assert value == "trained" and not backend.stopped_by_driver
    assert ("ranks 1 never reported their exit within 0.5s of the fake backend's clean "
            "finish; rank 0's value arrived: the job succeeded") in caplog.text


@dataclasses.dataclass(frozen=True)
class FromANewerVersion:
    """A message of a kind this driver does not know."""

    rank: int


def test_a_message_the_driver_does_not_know_fails_the_job_naming_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """A peer holding the job's secret but sending a kind of message this driver does not
    know (another mlflow_hvd in the ranks): refused loudly, the job fails naming it (it was
    dropped without a word)."""
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(WorkerStarted(0, "h"))
        sink(FromANewerVersion(0))  # type: ignore[arg-type]
        _until_stopped(sink, stop, 0)

    with pytest.raises(BackendError) as info:
        _run(script, np=1)
    assert str(info.value) == (
        "the fake backend cannot run this job: a rank or task sent a message this driver "
        "does not know (FromANewerVersion): the executors run another version of mlflow_hvd than "
        "the driver; install the driver's version there (or ship the environment: "
        "ClusterConfig(ship_environment=True))")
    assert "the driver refuses a message it does not know" in caplog.text


def test_a_pooled_ranks_job_end_ends_the_job_but_is_no_exit() -> None:
    """JobEnded (a pooled rank done with its job, its process up) counts as that rank's
    end of the job."""
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(WorkerStarted(0, "h"))
        sink(WorkerResult(0, cloudpickle.dumps("done")))
        sink(JobEnded(0, "h", time.time()))

    value, _, _ = _run(script, np=1)
    assert value == "done"


def test_tasks_that_disagree_on_the_layout_fail_the_job() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(LayoutReport(1, assign_slots(["h", "other"])))  # task 1 saw other hosts
        stop.wait(10)

    with pytest.raises(BackendError) as info:
        _run(script)
    assert str(info.value) == (
        "the fake backend cannot run this job: task 1 computed a different rank layout than "
        "the first task (hosts seen: h, other); do the executors' hostnames resolve "
        "consistently?"
    )


def test_an_outcome_with_neither_value_nor_error_is_refused() -> None:
    from mlflow_hvd.driver.retry import Failed, FailureKind
    from mlflow_hvd.driver.supervisor import Outcome

    assert Outcome(value=b"v").settled() == b"v"
    late = Failed(FailureKind.START_TIMEOUT, StartTimeoutError("late"))
    assert Outcome(failure=late).settled() is late
    neither = Outcome().settled()
    assert isinstance(neither, Failed) and neither.kind is FailureKind.MISMATCH
    assert isinstance(neither.error, BackendError)
    assert str(neither.error) == "the job ended with neither a value nor an error"


def test_run_returns_only_when_every_admitted_task_is_gone_and_late_tasks_start_nothing() -> None:
    """Spark tasks, played over the real channel: task 1's rank fails while task 0's worker
    has not said hello yet (its task's connection, which the worker shares, stays open a
    while after the stop, as a cancelled Spark task does) and task 2 reports only once the
    job is being stopped: it is told to start no worker, and run() waits for task 0."""
    from mlflow_hvd.protocol.channel import ChannelClient
    from mlflow_hvd.protocol.messages import Launch, StartNoWorker

    answers: dict[int, object] = {}
    order: list[str] = []
    out = io.StringIO()

    def connect() -> ChannelClient:
        assert backend.job is not None
        return ChannelClient(backend.job.driver_host, backend.job.channel_port,
                             backend.job.secret, 10)

    def script(sink: Sink, stop: threading.Event) -> None:
        slots = assign_slots(["h"] * 3)
        task0, task1 = connect(), connect()
        answers[0] = task0.request(LayoutReport(0, slots), 10)
        answers[1] = task1.request(LayoutReport(1, slots), 10)
        worker1 = connect()  # a worker has a connection of its own
        worker1.send(WorkerStarted(1, "h"))
        worker1.send(WorkerError(1, "h", "ValueError: boom", "tb", time.time()))
        worker1.close()
        task1.send(WorkerExited(1, "h", 1, time.time()))
        task1.close()
        if not stop.wait(10):
            raise AssertionError("the driver never stopped the backend")
        late = connect()
        answers[2] = late.request(LayoutReport(2, slots), 10)
        late.close()
        sink(BackendFinished(error="job cancelled"))  # Spark's collect() returns at once
        # ... while task 0 and its worker are still going down: once the driver loop has
        # handled two more messages after the backend's end, it has decided at least once
        # with the backend finished and task 0 still there
        for n in (1, 2):
            sink(OutputLines(0, Stream.LOG, (f"after the end {n}",)))
        wait_until(lambda: "after the end 2" in out.getvalue(), 10, "the driver loop")
        order.append("task 0 gone")
        task0.close()

    class Backend(FakeBackend):
        def close(self) -> None:  # the driver is done with the job (then waits for us)
            order.append("driver done")
            super().close()

    backend = Backend(script)
    with pytest.raises(WorkerFailedError) as info:
        run_job(backend, Job(3, b"", settings(stop_grace=5, report_grace=5), "test"),
                out=out)
    if backend.error is not None:
        raise backend.error
    assert answers == {0: Launch(), 1: Launch(), 2: StartNoWorker()}
    assert order == ["task 0 gone", "driver done"]  # not before task 0 was gone
    assert info.value.rank == 1


def test_task_gate_counts_admitted_tasks_until_they_leave() -> None:
    from mlflow_hvd.driver.tasks import TaskGate

    gate = TaskGate()
    assert gate.admit(1) and gate.admit(0)
    gate.left(1)
    assert gate.remaining() == [0]
    gate.close()
    assert not gate.admit(2)  # refused, and not counted
    assert gate.remaining() == [0]
    gate.left(0)
    assert gate.remaining() == []


def test_a_rank_killed_comes_before_the_ranks_whose_collective_lost_it() -> None:
    """The rank that died is the root cause even when a survivor's failed allreduce reached
    the driver first (a race: the survivor's Gloo notices before the agent's waitpid)."""
    from mlflow_hvd.driver.supervisor import JobRecord

    job = JobRecord(np=3)
    job.errors[1] = WorkerError(1, "node-a", "UnknownError: {{function_node "
                                "__wrapped__HorovodAllreduce_grads_0}} Horovod has been shut "
                                "down. [Op:HorovodAllreduce]", "tb1", 1.0)
    job.exited[1] = WorkerExited(1, "node-a", 1, 1.1)
    job.exited[2] = WorkerExited(2, "node-b", -9, 1.2)
    job.exited[0] = WorkerExited(0, "node-a", 0, 1.3)
    failures, _, _ = job.failures()
    assert [(f.rank, f.lost_a_peer) for f in failures] == [(2, False), (1, True)]
    # a genuine error stays first by time, even if it happened inside a collective's step
    job.errors[0] = WorkerError(0, "node-a", "ValueError: bad batch", "tb0", 0.5)
    job.exited[0] = WorkerExited(0, "node-a", 1, 0.6)
    failures, _, _ = job.failures()
    assert [f.rank for f in failures] == [0, 2, 1]


def test_worker_lines_carry_the_log_prefix() -> None:
    import io

    from mlflow_hvd.driver.supervisor import JobRecord, handle
    from mlflow_hvd.protocol.messages import OutputLines, Stream

    out = io.StringIO()
    shown = settings(verbosity=Verbosity.ALL, log_prefix="[trial 3]")
    handle(OutputLines(1, Stream.STDOUT, ("hello",)), JobRecord(2), shown, out)
    assert out.getvalue() == "[trial 3][1]<stdout>: hello\n"


def test_a_spark_task_reaching_the_driver_holds_the_start_deadline_and_is_named() -> None:
    """On a loaded cluster a barrier stage's tasks may reach the driver late: each one is
    progress, and a start that stalls says whether Spark ran the tasks at all."""
    from mlflow_hvd.driver.supervisor import FailureKind, JobRecord, _check_running

    backend = FakeBackend(lambda sink, stop: None)
    backend.name = "spark"
    limit = settings(start_timeout=0.5)
    job = JobRecord(np=2)
    now = time.monotonic()
    job.tasks.admit(1)  # task 1 reached the driver just now, 2 s into the job
    assert _check_running(job, backend, limit, 2.0, now) is None
    failed = _check_running(job, backend, limit, 2.0, now + 0.6)
    assert failed is not None and failed.kind is FailureKind.START_TIMEOUT
    assert str(failed.error).startswith(
        "0 of 2 ranks started within 0.5s of the last Spark task's arrival (missing ranks: "
        "0, 1; 1 of 2 Spark tasks reached the driver (partitions 1)). Raise ")
    assert backend.stopped.is_set()  # the job's ranks are told to stop

    stuck = JobRecord(np=2)
    failed = _check_running(stuck, backend, limit, 0.6, time.monotonic())
    assert failed is not None and str(failed.error).startswith(
        "0 of 2 ranks started within 0.5s (missing ranks: 0, 1; no Spark task of the stage "
        "reached the driver: check the executors' logs). Raise ")


def test_tasks_feeding_data_hold_the_start_deadline_while_they_progress() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        for rows in range(0, 8000, 1000):  # 8 reports 0.2 s apart: past start_timeout
            sink(FeedProgress(0, rows, rows * 100))
            stop.wait(0.2)
        sink(FeedProgress(0, 8000, 800_000, done=True))
        _ok(sink, 1)
        _ok(sink, 0, "trained")

    value, _, _ = _run(script, start_timeout=0.5)
    assert value == "trained"


def test_a_feed_that_stops_progressing_is_a_start_timeout() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(FeedProgress(1, 0, 0))
        stop.wait(10)

    with pytest.raises(StartTimeoutError, match=r"0 of 2 ranks started within 0.5s of the last "
                                                r"progress feeding the data"):
        _run(script, start_timeout=0.5)


def test_ranks_started_while_their_tasks_feed_wait_under_the_feeds_deadline() -> None:
    """Ranks start while their tasks still write the data (and wait for their shards): a
    feed that keeps progressing holds the deadline; one that stops is a start timeout even
    though every rank started."""
    def progressing(sink: Sink, stop: threading.Event) -> None:
        sink(FeedProgress(0, 0, 0))
        sink(WorkerStarted(0, "h"))
        sink(WorkerStarted(1, "h"))
        for rows in range(1000, 8000, 1000):  # 7 reports 0.2 s apart: past start_timeout
            stop.wait(0.2)
            sink(FeedProgress(0, rows, rows * 100))
        sink(FeedProgress(0, 8000, 800_000, done=True))
        _ok(sink, 1)
        _ok(sink, 0, "trained")

    value, _, _ = _run(progressing, start_timeout=0.5)
    assert value == "trained"

    def stalled(sink: Sink, stop: threading.Event) -> None:
        sink(FeedProgress(0, 0, 0))
        sink(FeedProgress(1, 0, 0))
        sink(FeedProgress(0, 10, 100, done=True))
        sink(WorkerStarted(0, "h"))
        sink(WorkerStarted(1, "h"))
        _until_stopped(sink, stop, 0)
        sink(WorkerExited(1, "h", -15, time.time(), stopped=True))

    with pytest.raises(StartTimeoutError, match=(
            r"^the data feed of task\(s\) 1 made no progress within 0.5s \(every rank "
            r"started and waits for its shard\)")):
        _run(stalled, start_timeout=0.5)


def test_a_feed_failure_after_the_ranks_started_is_the_jobs_error() -> None:
    """Each task says the feed failed before its rank, waiting for its shard, exits (75,
    no error of its own): the job ends with the feed's error, not with the rank's exit."""
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(WorkerStarted(0, "h"))
        sink(WorkerStarted(1, "h"))
        sink(FeedFailed("column 'y' of the DataFrame passed as data= has null values",
                        FeedFault.DATA))
        sink(WorkerExited(1, "h", 75, time.time()))
        _until_stopped(sink, stop, 0)

    with pytest.raises(DataInputError, match=r"^column 'y' .* has null values$"):
        _run(script)


def test_a_feed_failure_is_the_jobs_error_and_stops_the_tasks() -> None:
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(FeedFailed("task 1: column 'y' of the DataFrame passed as data= has null values",
                        FeedFault.DATA))
        if not stop.wait(10):
            raise AssertionError("the driver never stopped the tasks")

    with pytest.raises(DataInputError, match=r"^task 1: column 'y' .* has null values$"):
        _run(script)


def test_an_environment_that_does_not_fit_a_host_is_one_error_naming_it() -> None:
    """A task whose host cannot run the shipped environment reports it; the driver stops
    the tasks and raises one EnvironmentArchiveError naming the host and each difference."""
    def script(sink: Sink, stop: threading.Event) -> None:
        sink(EnvironmentMismatch(1, "node-b", ("python: expected 3.11.7, found 3.12.3",)))
        if not stop.wait(10):
            raise AssertionError("the driver never stopped the tasks")

    with pytest.raises(EnvironmentArchiveError) as info:
        _run(script)
    assert str(info.value).startswith(
        "the environment shipped to the executors does not fit node-b (task 1): python: "
        "expected 3.11.7, found 3.12.3. Pack it where")


def test_an_executor_that_cannot_start_python_is_named_with_what_to_do() -> None:
    """Spark's own words when an executor lacks the interpreter: the driver's
    PYSPARK_PYTHON (nothing shipped), or the shipped venv's link to a missing base Python."""
    import dataclasses

    from mlflow_hvd.backends.spark.backend import summarize_spark_error
    from mlflow_hvd.common.environment import current

    def spark_says(program: str) -> RuntimeError:  # as pyspark 4.3 words a barrier stage's
        return RuntimeError(
            "An error occurred while calling o41.collectToPython.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not "
            "recover from a failed barrier ResultStage. Most recent failure reason: Stage "
            "failed because barrier task ResultTask(0, 0) finished unsuccessfully.\n"
            f"java.io.IOException: Cannot run program \"{program}\": error=2, No such file "
            "or directory\n\tat java.base/java.lang.ProcessBuilder.start(ProcessBuilder.java)\n"
            "Caused by: java.io.IOException: error=2, No such file or directory")

    assert summarize_spark_error(spark_says("/srv/venv/bin/python")) == (
        "an executor cannot start the Python interpreter /srv/venv/bin/python "
        "(PYSPARK_PYTHON when the session started): it does not exist on that node. Ship the "
        "driver's environment to the executors "
        "(HorovodRunner(cluster=ClusterConfig(ship_environment=True)), mlflow "
        "run ... -P ship_environment=true, or spark.archives from python -m "
        "mlflow_hvd.cli.pack_env), or install the same environment at that path on every node")
    shipped = dataclasses.replace(current(with_packages=False), base_python="/opt/py/bin/py3")
    assert summarize_spark_error(spark_says("./environment/bin/python"), shipped) == (
        "an executor cannot start the shipped environment's interpreter "
        "./environment/bin/python: it is a link to /opt/py/bin/py3, which venv-pack does not "
        "copy into the archive. Install that Python at that path on every node (the same "
        "version: pyenv, a system package), or ship an environment that includes its "
        "interpreter (conda-pack)")

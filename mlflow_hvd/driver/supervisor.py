"""The driver loop: consume a job's messages, enforce its deadlines, decide how it ended.

The loop only consumes messages (from the channel or, for local processes, directly from
the agents); it never branches on the backend's type. The job moves through the states of
:class:`JobState`; every transition is a named method of :class:`JobRecord` and says so in
the ``mlflow_hvd.driver.supervisor`` log. The loop ends with an :class:`Outcome`, which
:func:`supervise` returns or raises.
"""

from __future__ import annotations

import collections
import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO, assert_never

from mlflow_hvd.backends.base import Backend
from mlflow_hvd.common.config import ClusterConfig, JobConfig
from mlflow_hvd.driver.events import LoopEvent, TorchStoreFailed, UnknownMessage
from mlflow_hvd.driver.rendezvous import ElasticRefused, LayoutMismatch
from mlflow_hvd.driver.retry import Failed, FailureKind
from mlflow_hvd.driver.tasks import TaskGate
from mlflow_hvd.errors import (
    BackendError,
    JobStopped,
    MlflowHvdError,
    RankFailure,
    RunTimeoutError,
    StartTimeoutError,
    WorkerFailedError,
    unfit_environment,
)
from mlflow_hvd.protocol.credentials import Credentials
from mlflow_hvd.protocol.feed import FeedFault
from mlflow_hvd.protocol.messages import (
    BackendFinished,
    CheckpointCommitted,
    EnvironmentMismatch,
    FeedFailed,
    FeedProgress,
    JobEnded,
    OutputLines,
    RankDisconnected,
    Stream,
    TaskDisconnected,
    WorkerError,
    WorkerExited,
    WorkerResult,
    WorkerStarted,
)

if TYPE_CHECKING:
    from mlflow_hvd.driver.elastic import GrowBack

log = logging.getLogger(__name__)

TAIL_LINES = 100
EXIT_AFTER_ERROR = 2.0  # seconds a rank that reported an error gets to exit by itself


class Verbosity(enum.Enum):
    """``driver_log_verbosity`` of Databricks' HorovodRunner."""

    ALL = "all"
    LOG_CALLBACK_ONLY = "log_callback_only"


@dataclass(frozen=True)
class DriverSettings:
    """Deadlines and output settings of one run (all seconds). The options users set come
    from their groups (:meth:`from_config`), which hold their defaults; only the driver's
    own settings below have defaults here."""

    verbosity: Verbosity
    start_timeout: float
    timeout: float | None  # HorovodRunner(timeout): the whole job's limit
    stop_grace: float
    # A warm rank idle this long between jobs is retired (its Spark slot freed); the next
    # run starts new ranks.
    idle_timeout: float
    max_line_bytes: int
    gloo_iface: str | None
    gpu_resource: str  # Spark resource name of the GPUs ranks get
    horovod_env: tuple[tuple[str, str], ...] = ()  # Horovod's tuning, for every rank
    channel_timeout: float = 60.0  # each rank-to-driver send's deadline
    log_prefix: str = ""  # before every line shown, e.g. "[trial 3]" in a sweep
    # After a failure and stop(), how long the other ranks get to report their exit; also
    # how long exit reports may lag behind a backend that says it finished.
    report_grace: float = 15.0
    # The driver's MLflow client settings, for the job's rank 0 only (repr shows names only)
    credentials: Credentials | None = None

    @classmethod
    def from_config(cls, job: JobConfig, cluster: ClusterConfig, verbosity: Verbosity,
                    horovod_env: tuple[tuple[str, str], ...] = ()) -> DriverSettings:
        """The settings of the options in ``job`` and ``cluster`` (``verbosity``:
        ``HorovodRunner(driver_log_verbosity=...)``)."""
        return cls(verbosity=verbosity, start_timeout=job.start_timeout, timeout=job.timeout,
                   stop_grace=job.stop_grace, idle_timeout=job.idle_timeout,
                   max_line_bytes=job.max_line_bytes, gloo_iface=cluster.gloo_iface,
                   gpu_resource=cluster.gpu_resource, horovod_env=horovod_env)


class JobState(enum.Enum):
    """Where a job is. ``RUNNING -> FAILING -> STOPPING`` after a rank failure;
    ``RUNNING -> ABORTED`` when a deadline passes or the job's machinery fails (the loop
    then ends at once). The loop ends in any state once every rank reported its exit (or a
    deadline of the state passed)."""

    RUNNING = "running"  # no failure seen
    FAILING = "failing"  # a rank failed; erring ranks get EXIT_AFTER_ERROR to exit alone
    STOPPING = "stopping"  # backend.stop() sent; collecting the remaining exit reports
    ABORTED = "aborted"  # backend.stop() sent for a deadline or a fault; the loop ends


@dataclass(frozen=True)
class Outcome:
    """How a job ended: rank 0's cloudpickled value, its failure (the kind and the error),
    or (``grow``) a planned restart on more ranks."""

    value: bytes | None = None
    failure: Failed | None = None
    grow: bool = False

    def settled(self) -> bytes | Failed:
        """The value or the failure (an outcome with neither is a failure of its own)."""
        if self.failure is not None:
            return self.failure
        if self.value is None:  # every constructor sets one or the other
            return Failed(FailureKind.MISMATCH,
                          BackendError("the job ended with neither a value nor an error"))
        return self.value


@dataclass
class JobRecord:
    """Everything the driver has learned about one job, and its state."""

    np: int
    job_id: str = ""  # names the job in the lifecycle log
    state: JobState = JobState.RUNNING
    t0: float = field(default_factory=time.monotonic)
    since: float = field(default_factory=time.monotonic)  # when ``state`` was entered
    started: dict[int, str] = field(default_factory=dict)
    exited: dict[int, WorkerExited] = field(default_factory=dict)
    errors: dict[int, WorkerError] = field(default_factory=dict)
    disconnected: set[int] = field(default_factory=set)
    result: WorkerResult | None = None
    backend_finished: BackendFinished | None = None
    backend_finished_at: float | None = None
    fault: str = ""  # a failure of the job's machinery (e.g. a layout mismatch)
    checkpoint: int | None = None  # the latest epoch whose checkpoint rank 0 committed
    fed_at: float = 0.0  # the latest progress of a task feeding the job's DataFrames
    feeding: set[int] = field(default_factory=set)  # tasks that began feeding, not done
    arrived_at: float = 0.0  # when the latest rank started
    # why no rank can start: the job's DataFrames cannot be fed, or a host cannot run the
    # environment shipped to it
    setup: Failed | None = None
    tasks: TaskGate = field(default_factory=TaskGate)  # Spark tasks that may host a worker
    tails: dict[int, collections.deque[str]] = field(
        default_factory=lambda: collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES)
        )
    )

    # --- transitions -------------------------------------------------------------------
    def fail(self, now: float) -> None:
        """RUNNING -> FAILING: the first rank failure was observed."""
        if self.state is JobState.RUNNING:
            self.state, self.since = JobState.FAILING, now
            log.info("job %s: running -> failing after %.1fs (%s)", self.job_id,
                     now - self.t0, self._failed_ranks())

    def stop(self, backend: Backend) -> None:
        """FAILING -> STOPPING: ask the backend to stop every rank (the only way into
        STOPPING, so a rank is never labelled stopped unless the stop was sent)."""
        if self.state is JobState.FAILING:
            self.tasks.close()
            backend.stop()
            self.state, self.since = JobState.STOPPING, time.monotonic()
            log.info("job %s: failing -> stopping: the %s backend stops every rank (%d of %d "
                     "exited)", self.job_id, backend.name, len(self.exited), self.np)

    def abort(self, backend: Backend, error: MlflowHvdError) -> MlflowHvdError:
        """RUNNING -> ABORTED: a deadline passed or the job's machinery failed before any
        rank did; the backend stops every rank. Returns ``error`` (the job's end)."""
        if self.state is JobState.RUNNING:
            self.tasks.close()
            backend.stop()
            self.state, self.since = JobState.ABORTED, time.monotonic()
            log.info("job %s: running -> aborted after %.1fs by %s: the %s backend stops "
                     "every rank (%d of %d exited)", self.job_id, self.since - self.t0,
                     type(error).__name__, backend.name, len(self.exited), self.np)
        return error

    def _failed_ranks(self) -> str:
        errs = [f"rank {r} raised" for r in sorted(self.errors)]
        exits = [f"rank {r} exited {e.exit_code}" for r, e in sorted(self.exited.items())
                 if e.exit_code != 0 and not e.stopped]
        return ", ".join(errs + exits)

    # --- queries -----------------------------------------------------------------------
    def all_exited(self) -> bool:
        return len(self.exited) >= self.np

    def all_gone(self) -> bool:
        """Every rank that started has closed its connection, and so has every Spark task
        let start a worker: no process of the job is left (a cancelled Spark task can end
        before the worker it hosts, or start one after the job failed)."""
        return set(self.started) <= self.disconnected and not self.tasks.remaining()

    def rank_failed(self) -> bool:
        return bool(self.errors) or any(
            e.exit_code != 0 and not e.stopped for e in self.exited.values()
        )

    def describe_missing(self) -> str:
        """``; no exit report from ranks 2, 3 on node-b`` for ranks that started but never
        reported their exit, grouped by host (empty when there are none)."""
        by_host: dict[str, list[int]] = {}
        for rank, host in sorted(self.started.items()):
            if rank not in self.exited:
                by_host.setdefault(host, []).append(rank)
        if not by_host:
            return ""
        groups = [f"{', '.join(map(str, ranks))} on {host}" for host, ranks in by_host.items()]
        return "; no exit report from ranks " + "; ".join(groups)

    def erring_not_exited(self) -> bool:
        return bool(set(self.errors) - set(self.exited))

    def failures(self) -> tuple[list[RankFailure], list[int], list[int]]:
        """(failures, root cause first, ranks stopped by the driver, ranks never reported).

        Failures are in time order, except that ranks that failed because a peer left a
        collective (:attr:`RankFailure.lost_a_peer`) come after the others.

        A rank without an exit report counts as stopped only if the driver did stop the
        job (cancelling a Spark job ends its tasks before they can report); otherwise its
        fate is unknown and it is listed as unreported.
        """
        out: list[RankFailure] = []
        stopped: list[int] = []
        unreported: list[int] = []
        for rank in range(self.np):
            err, ex = self.errors.get(rank), self.exited.get(rank)
            if err is None and ex is None:
                (stopped if self.state is JobState.STOPPING else unreported).append(rank)
            elif err is None and ex is not None and (ex.exit_code == 0 or ex.stopped):
                if ex.stopped:
                    stopped.append(rank)
            else:
                out.append(self._failure(rank, err, ex))
        # a rank whose collective failed because a peer went away is that peer's victim:
        # whichever failure the driver heard of first, the peer's own comes first
        out.sort(key=lambda f: (f.lost_a_peer, f.timestamp))
        return out, stopped, unreported

    def _failure(self, rank: int, err: WorkerError | None, ex: WorkerExited | None) -> RankFailure:
        host = err.host if err else ex.host if ex else self.started.get(rank, "?")
        return RankFailure(
            rank=rank,
            host=host,
            exit_code=ex.exit_code if ex else None,
            error=err.error if err else "",
            traceback=err.traceback if err else "",
            output_tail=tuple(self.tails[rank]),
            timestamp=err.timestamp if err else ex.timestamp if ex else time.time(),
        )


@dataclass(frozen=True)
class GrowingBack:
    """How a job ends when its elastic controller decided, at a checkpoint rank 0
    committed, to grow back (the missing slots are back, :mod:`mlflow_hvd.driver
    .elastic`): for a planned restart on more ranks from ``epoch``'s checkpoint, not a
    failure; the caller stops its ranks and starts the next attempt."""

    job_id: str
    epoch: int


def supervise(
    job: JobRecord,
    events: queue.Queue[LoopEvent],
    backend: Backend,
    settings: DriverSettings,
    out: TextIO,
    stop: threading.Event,
    grow: GrowBack | None = None,
) -> bytes | GrowingBack | Failed:
    """Run the loop until every rank exited or a deadline ends the job.

    Returns:
        Rank 0's cloudpickled return value, :class:`GrowingBack` once ``grow`` decided to
        restart at a checkpoint (the caller stops the ranks), or how the job failed
        (:class:`~mlflow_hvd.driver.retry.Failed`: ``WorkerFailedError``,
        ``StartTimeoutError``, ``RunTimeoutError``, ``BackendError`` or an input refused,
        with the kind the retry policy decides on).

    Raises:
        JobStopped: ``stop`` was set (the caller stops the ranks, as on Ctrl-C).
    """
    outcome = watch(job, events, backend, settings, out, stop, grow)
    if outcome.grow:
        assert job.checkpoint is not None  # grown at a checkpoint
        log.info("job %s: ends for a restart on more ranks after %.1fs", job.job_id,
                 time.monotonic() - job.t0)
        return GrowingBack(job.job_id, job.checkpoint)
    settled = outcome.settled()
    log.info("job %s: %s after %.1fs", job.job_id,
             f"ended by {type(settled.error).__name__} ({settled.kind.value})"
             if isinstance(settled, Failed) else "succeeded", time.monotonic() - job.t0)
    return settled


def watch(
    job: JobRecord,
    events: queue.Queue[LoopEvent],
    backend: Backend,
    settings: DriverSettings,
    out: TextIO,
    stop: threading.Event,
    grow: GrowBack | None = None,
) -> Outcome:
    """The loop: consume messages until every rank exited, a deadline passed or the job
    failed and its ranks are down; never raises for the job's own failures, only
    :class:`JobStopped` once ``stop`` is set (checked every 0.1 s); ends with
    ``Outcome(grow=True)`` when ``grow``, an elastic attempt's controller, decides at a
    checkpoint rank 0 committed while every rank runs (:func:`_grows_back`)."""
    t0 = job.t0
    wind_down = settings.stop_grace + settings.report_grace
    aborted: Failed | None = None
    while not job.all_exited():
        if stop.is_set():
            raise JobStopped(f"job {job.job_id} was stopped (HorovodRunner.stop)")
        now = time.monotonic()
        if job.state is JobState.RUNNING:
            failure = _check_running(job, backend, settings, now - t0, now)
            if failure is not None:
                if not job.started or failure is not job.setup:
                    return Outcome(failure=failure)
                # the data could not be fed, and ranks started while their tasks fed it: as
                # after a rank failure, run() returns once they are gone (they stop at once)
                aborted = failure
        elif now > job.since + wind_down or (
            job.state in (JobState.STOPPING, JobState.ABORTED)
            and job.backend_finished is not None
            and job.all_gone()
        ):
            # The backend has ended and every rank's process is gone, or the wind-down is
            # over (a lost host never closes its connections): no more reports come.
            break
        try:
            message: LoopEvent | None = events.get(timeout=0.1)
        except queue.Empty:
            message = None
        if message is not None:
            handle(message, job, settings, out)
            if _grows_back(job, message, grow):
                return Outcome(grow=True)
        if job.rank_failed():
            job.fail(time.monotonic())
        exit_alone_until = job.since + EXIT_AFTER_ERROR
        if job.state is JobState.FAILING and (
            not job.erring_not_exited() or time.monotonic() > exit_alone_until
        ):
            # A rank that reported an error exits by itself right after; it got a moment so
            # that its real exit status is reported rather than our SIGTERM.
            job.stop(backend)
    return Outcome(failure=aborted) if aborted is not None else _outcome(job)


def _grows_back(job: JobRecord, message: LoopEvent, grow: GrowBack | None) -> bool:
    """Whether the job ends at the checkpoint ``message`` reports for a restart on more
    ranks: asked of ``grow`` only while no rank failed or ended and rank 0 has not
    returned (a job that finished is never restarted)."""
    return (isinstance(message, CheckpointCommitted) and grow is not None
            and job.state is JobState.RUNNING and job.result is None and not job.exited
            and grow.at_commit(message))


def _tasks_seen(backend: Backend, admitted: list[int], np: int) -> str:
    """Where a Spark job's start stalled: before its tasks reached the driver (Spark had
    not run them), or after (their ranks' processes were slow or stuck)."""
    if backend.name != "spark":
        return ""
    if not admitted:
        return "; no Spark task of the stage reached the driver: check the executors' logs"
    return (f"; {len(admitted)} of {np} Spark tasks reached the driver "
            f"(partitions {', '.join(map(str, admitted))})")


def _check_running(
    job: JobRecord, backend: Backend, settings: DriverSettings, elapsed: float, now: float
) -> Failed | None:
    """The deadlines and faults of a job with no rank failure yet: how the job fails (its
    ranks already told to stop where they run on), or None."""
    np = job.np
    if job.setup is not None:
        job.abort(backend, job.setup.error)
        return job.setup
    # The start deadline counts from the job's latest progress: a Spark task reaching the
    # driver, tasks feeding its data, or a rank arriving (many ranks sharing a node's cores
    # arrive one after another, late but steadily; a job is stuck only when nothing moves
    # for start_timeout).
    admitted, admitted_at = job.tasks.admitted()
    waited = min(elapsed, now - job.fed_at, now - job.arrived_at, now - admitted_at)
    if len(job.started) < np and waited > settings.start_timeout:
        missing = sorted(set(range(np)) - set(job.started))
        latest = max(job.arrived_at, job.fed_at, admitted_at)
        if not latest:
            when = f" within {settings.start_timeout:g}s "
        elif latest == job.arrived_at:
            when = f"; the others not within {settings.start_timeout:g}s of the last one "
        elif latest == job.fed_at:
            when = f" within {settings.start_timeout:g}s of the last progress feeding the data "
        else:
            when = f" within {settings.start_timeout:g}s of the last Spark task's arrival "
        return Failed(FailureKind.START_TIMEOUT, job.abort(backend, StartTimeoutError(
            f"{len(job.started)} of {np} ranks started{when}"
            f"(missing ranks: {', '.join(map(str, missing))}"
            f"{_tasks_seen(backend, admitted, np)}). Raise "
            "HorovodRunner(job=JobConfig(start_timeout=...)) if workers are slow to start, or "
            "check that the cluster has free slots"
        )))
    if len(job.started) == np and job.feeding and now - job.fed_at > settings.start_timeout:
        # the ranks start while their tasks feed, and wait for their shards
        return Failed(FailureKind.START_TIMEOUT, job.abort(backend, StartTimeoutError(
            f"the data feed of task(s) {', '.join(map(str, sorted(job.feeding)))} made no "
            f"progress within {settings.start_timeout:g}s (every rank started and waits for "
            "its shard). Raise HorovodRunner(job=JobConfig(start_timeout=...)) if computing "
            "the DataFrame's partitions takes longer, or check the executors' logs")))
    if settings.timeout is not None and elapsed > settings.timeout:
        return Failed(FailureKind.RUN_TIMEOUT, job.abort(backend, RunTimeoutError(
            f"the job did not finish within {settings.timeout:g}s ({len(job.exited)} of "
            f"{np} ranks exited); raise HorovodRunner(job=JobConfig(timeout=...)) or pass "
            f"timeout=None for no "
            "limit"
        )))
    if job.fault:
        return Failed(FailureKind.MISMATCH, job.abort(backend, BackendError(
            f"the {backend.name} backend cannot run this job: {job.fault}")))
    finished = job.backend_finished
    if finished is None or job.backend_finished_at is None:
        return None
    if finished.error:
        return Failed(FailureKind.BACKEND, BackendError(
            f"the {backend.name} backend failed before all ranks finished "
            f"({len(job.exited)} of {np} exited{job.describe_missing()}): {finished.error}"
        ))
    if now > job.backend_finished_at + settings.report_grace:
        missing = sorted(set(range(np)) - set(job.exited))
        if job.result is not None and not job.errors and set(missing) <= set(job.started):
            # the backend saw every rank end well, each had started, and rank 0's value is
            # here: the job trained; only reports were lost on the way (no failure after it)
            log.warning("mlflow_hvd: ranks %s never reported their exit within %gs of the %s "
                        "backend's clean finish; rank 0's value arrived: the job succeeded",
                        ", ".join(map(str, missing)), settings.report_grace, backend.name)
            for rank in missing:
                job.exited[rank] = WorkerExited(rank, job.started.get(rank, "?"), 0,
                                                time.time())
            return None
        return Failed(FailureKind.BACKEND, BackendError(
            f"the {backend.name} backend finished but ranks {', '.join(map(str, missing))} "
            f"never reported their exit within {settings.report_grace:g}s of it; their output "
            "was lost on the way to the driver"
        ))
    return None


def _outcome(job: JobRecord) -> Outcome:
    if job.rank_failed():
        failures, stopped, unreported = job.failures()
        if failures:
            return Outcome(failure=Failed(FailureKind.RANK, WorkerFailedError(
                failures[0], failures, stopped, unreported)))
    if job.result is None:
        return Outcome(failure=Failed(FailureKind.MISMATCH, BackendError(
            "every rank exited with status 0 but rank 0 sent no return value; "
            "was the worker replaced by another program?"
        )))
    return Outcome(value=job.result.payload)


def handle(message: LoopEvent, job: JobRecord, settings: DriverSettings, out: TextIO) -> None:
    """Record one event of the job; print output lines the verbosity asks for. Every kind
    of :data:`~mlflow_hvd.driver.events.LoopEvent` has its case (checked by the type
    checker: ``assert_never``)."""
    match message:
        case OutputLines():
            tail = job.tails[message.rank]
            show = message.stream is Stream.LOG or settings.verbosity is Verbosity.ALL
            for line in message.lines:
                text = f"{settings.log_prefix}[{message.rank}]<{message.stream.value}>: {line}"
                tail.append(text)
                if show:
                    out.write(text + "\n")
            if show:
                out.flush()
        case WorkerStarted():
            job.started[message.rank] = message.host
            job.arrived_at = time.monotonic()
            log.info("job %s: rank %d started on %s (%d of %d, %.1fs)", job.job_id,
                     message.rank, message.host, len(job.started), job.np,
                     time.monotonic() - job.t0)
        case WorkerResult():
            job.result = message
        case WorkerError():
            job.errors.setdefault(message.rank, message)
        case WorkerExited():
            job.exited[message.rank] = message
            log.info("job %s: rank %d on %s exited with %d%s (%d of %d, %.1fs)", job.job_id,
                     message.rank, message.host, message.exit_code,
                     " (stopped)" if message.stopped else "", len(job.exited), job.np,
                     time.monotonic() - job.t0)
        case JobEnded():  # a pooled rank is done with the job (its process stays up)
            job.exited[message.rank] = WorkerExited(message.rank, message.host, 0,
                                                    message.timestamp)
            log.info("job %s: rank %d on %s finished the job and waits for the next (%d of "
                     "%d, %.1fs)", job.job_id, message.rank, message.host, len(job.exited),
                     job.np, time.monotonic() - job.t0)
        case BackendFinished():
            job.backend_finished, job.backend_finished_at = message, time.monotonic()
        case CheckpointCommitted():
            job.checkpoint = message.epoch
            log.info("job %s: rank 0 committed epoch %d's checkpoint (%.1fs)", job.job_id,
                     message.epoch, time.monotonic() - job.t0)
        case RankDisconnected():
            job.disconnected.add(message.rank)
        case TaskDisconnected():
            pass  # the task gate counted it (routing); it only wakes the loop
        case LayoutMismatch():
            job.fault = job.fault or message.detail
        case UnknownMessage():
            job.fault = job.fault or message.detail()
        case FeedProgress():
            job.fed_at = time.monotonic()
            (job.feeding.discard if message.done else job.feeding.add)(message.partition)
            if message.done:
                log.info("job %s: task %d wrote its %d rows (%.1f MiB in Arrow) in %.1fs",
                         job.job_id, message.partition, message.rows,
                         message.bytes / 2**20, job.fed_at - job.t0)
        case ElasticRefused():
            job.setup = job.setup or Failed(FailureKind.REFUSED, message.error())
        case FeedFailed():  # the data (refused by name) or a host (a full disk)
            job.setup = job.setup or Failed(
                FailureKind.REFUSED if message.fault is FeedFault.DATA else FailureKind.BACKEND,
                message.fault.error(message.error))
        case TorchStoreFailed():
            job.setup = job.setup or Failed(FailureKind.BACKEND, BackendError(message.detail))
        case EnvironmentMismatch():
            job.setup = job.setup or Failed(FailureKind.REFUSED, unfit_environment(
                f"{message.host} (task {message.partition})", message.differences))
        case _:
            assert_never(message)

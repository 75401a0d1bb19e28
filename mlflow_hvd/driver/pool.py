"""Driver side: runs jobs on generations of ranks, cold (one job each) or warm (the ranks
of one generation stay up and run the next job too).

Without warm ranks every ``run`` starts ``np`` fresh Python processes, and each pays for
importing TensorFlow, Horovod and MLflow, for Spark's stage and for its exit. A warm pool
keeps one :class:`~mlflow_hvd.driver.generation.Generation` (one set of local processes,
or one Spark barrier stage whose tasks stay in their worker) with everything imported.

A job that fails (a rank raised, died or was stopped, a deadline passed) ends its
generation: every rank is stopped and the backend released; the next ``run`` starts a new
generation. Closing the pool retires the ranks, waits a bounded time for them and the
backend (a Spark stage frees its slots), and stops the driver's servers, on every path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from mlflow_hvd.backends.base import Backend
from mlflow_hvd.common.deadline import Deadline
from mlflow_hvd.common.phases import PhaseTimeout
from mlflow_hvd.driver.feed import Feed
from mlflow_hvd.driver.generation import Generation
from mlflow_hvd.driver.job import Job
from mlflow_hvd.driver.retry import Failed, FailureKind
from mlflow_hvd.driver.supervisor import GrowingBack, JobRecord, supervise
from mlflow_hvd.errors import (
    BackendError,
    ConfigurationError,
    InsufficientSlotsError,
    JobNotStartedError,
    JobStopped,
    MlflowHvdError,
    WorkerFailedError,
)

log = logging.getLogger(__name__)

MakeBackend = Callable[[Feed | None, int], tuple[Backend, str]]
"""Returns a new backend for the given number of ranks that feeds them the given
DataFrames (if any), and the address workers reach the driver at."""


AttemptEnd = bytes | GrowingBack | Failed
"""How an attempt ends (torch elastic's ``RunResult`` shape): rank 0's cloudpickled value, a
planned restart on more ranks, or its failure."""


def start_failure(error: MlflowHvdError) -> FailureKind:
    """The kind of a failure to start a generation's ranks (its start phases: packing and
    shipping the environment, booting Spark, waiting for slots, the stage's launch)."""
    match error:
        case PhaseTimeout():
            return FailureKind.PHASE_TIMEOUT
        case InsufficientSlotsError():
            return FailureKind.NO_SLOTS
        case ConfigurationError():  # refused by name: an environment, a master, an option
            return FailureKind.REFUSED
        case BackendError():  # Spark failed to run the stage: an executor or host lost
            return FailureKind.BACKEND
        case _:
            return FailureKind.MISMATCH


@dataclass(frozen=True)
class Placement:
    """How one job found its ranks, and how it ended (:attr:`RankPool.history`).

    Attributes:
        job_id: The job.
        generation: The number of the generation that ran it.
        handed: The generation's ranks were warm and took it (False: started for it).
        refused: Why the warm generation before could not take it ("": none refused).
        failure: How the job failed (None: it succeeded or grew back).
    """

    job_id: str
    generation: int
    handed: bool
    refused: str = ""
    failure: FailureKind | None = None


def died_before_starting(record: JobRecord) -> bool:
    """The job failed only because ranks died before starting it (after asking for it),
    e.g. killed while idle: no rank raised, and every rank that failed never started."""
    failed = [r for r, e in record.exited.items() if e.exit_code != 0 and not e.stopped]
    return bool(failed) and not record.errors and not set(failed) & set(record.started)


class RankPool:
    """Runs jobs, each on as many ranks as it says (``Job.np``; see the module docstring).

    Args:
        make_backend: Called for each new generation.
        warm: Keep each generation's ranks for the next job (``with HorovodRunner``);
            False: a generation serves one job and is closed after it.
        stop: Once set, the running job (or the next one to start) ends as on Ctrl-C,
            raising :class:`~mlflow_hvd.errors.JobStopped` (``HorovodRunner.stop``).
    """

    def __init__(self, make_backend: MakeBackend, warm: bool,
                 stop: threading.Event | None = None) -> None:
        self.warm = warm
        self._make_backend = make_backend
        self.stop = stop or threading.Event()
        self._live: Generation | None = None
        self.generations = 0  # how many sets of ranks were started (1 + replacements)
        self.history: list[Placement] = []  # each job's placement, once it ended
        self._refused = ""  # why the live generation could not take the job being placed

    @property
    def live(self) -> Generation | None:
        """The generation whose ranks run the current job or wait for the next (None:
        none)."""
        return self._live

    def run(self, job: Job, out: TextIO) -> AttemptEnd:
        """Run ``job`` on the pool's ranks (starting them if needed): rank 0's cloudpickled
        value, :class:`GrowingBack` when the job ended for a planned restart on more ranks,
        or how it failed (:class:`~mlflow_hvd.driver.retry.Failed`, its kind named where it
        was seen: the start's phases here, the job's run by the driver loop). A job that
        did not succeed ends the generation; the next run starts anew.

        A warm rank that dies while idle is replaced: found before the hand-out (its exit is
        already reported), the job runs on a new generation at once; found after it (the
        rank died having asked for the job but before starting it), the job never ran:
        ``Failed(NOT_STARTED, JobNotStartedError)`` (the retry policy runs it again).

        Raises:
            JobStopped: The pool's ``stop`` was set (as on Ctrl-C).
        """
        self._refused = ""
        ended: AttemptEnd | None = None
        handed = False
        try:
            if self.stop.is_set():
                raise JobStopped(f"job {job.job_id} was stopped before it started")
            try:
                handed = self._hand_out(job)
                if not handed:
                    self._start_generation(job)
            except MlflowHvdError as exc:
                ended = Failed(start_failure(exc), exc)
                return ended
            live = self._live
            assert live is not None  # started or handed
            record = JobRecord(job.np, job.job_id, tasks=live.tasks)
            if job.grow is not None:
                job.grow.start()
            ended = supervise(record, live.events, live.backend, job.settings, out,
                              self.stop, job.grow)
            if (isinstance(ended, Failed) and isinstance(ended.error, WorkerFailedError)
                    and handed and died_before_starting(record)):
                died = ended.error
                ended = Failed(FailureKind.NOT_STARTED, JobNotStartedError(
                    f"ranks of generation {live.number} died after taking job {job.job_id} "
                    f"but before starting it: {died.root_cause.host} rank {died.rank} "
                    f"({died.root_cause.describe_exit()})"))
            return ended
        finally:
            succeeded = isinstance(ended, bytes)
            if ended is not None:
                self.history.append(Placement(
                    job.job_id, self.generations, handed, self._refused,
                    ended.kind if isinstance(ended, Failed) else None))
            if job.grow is not None:
                job.grow.close()
            if not succeeded:
                self._close_live(stop_now=True)
            elif not self.warm:
                self._close_live(stop_now=False)

    def _hand_out(self, job: Job) -> bool:
        """Give ``job`` to the live warm generation; False when there is none, or it
        cannot take it (it is then closed)."""
        live = self._live
        if live is None:
            return False
        if not set(job.feed_key) <= set(live.feed_key):  # data its ranks do not hold
            log.info("job %s: generation %d was fed other DataFrames; starting new ranks",
                     job.job_id, live.number)
            self._close_live(stop_now=False)
            return False
        if live.torch_nodes_are_tasks != job.torch_nodes_are_tasks:
            log.info("job %s numbers torch.distributed's processes otherwise than generation "
                     "%d's; starting new ranks", job.job_id, live.number)
            self._close_live(stop_now=False)
            return False
        if live.np != job.np:
            log.info("job %s runs on %d ranks, generation %d has %d; starting new ranks",
                     job.job_id, job.np, live.number, live.np)
            self._close_live(stop_now=False)
            return False
        try:
            live.hand_out(job, Deadline.after(job.settings.start_timeout))
            return True
        except BackendError as exc:
            self._refused = str(exc)
            log.info("job %s: generation %d cannot take it (%s); starting new ranks",
                     job.job_id, live.number, exc)
            self._close_live(stop_now=True)
            return False

    def _start_generation(self, job: Job) -> None:
        backend, driver_host = self._make_backend(job.feed, job.np)
        self.generations += 1
        self._live = Generation(job.np, backend, driver_host, self.warm, self.generations)
        self._live.launch(job)

    def _close_live(self, stop_now: bool) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.close(stop_now)

    def close(self) -> None:
        """Retire the ranks and release everything; the pool may be used again (it then
        starts a new generation). Idempotent."""
        self._close_live(stop_now=False)


"""A warm pool of ranks: the processes of one job stay up and run the next job too.

Without a pool every ``run`` starts ``np`` fresh Python processes, and each pays for
importing TensorFlow, Horovod and MLflow, for Spark's stage and for its exit. A pool keeps
one generation of ranks (one set of local processes, or one Spark barrier stage whose
tasks stay in their worker) with everything imported. After a job each pooled worker shuts
Horovod down, clears Keras' state and asks the driver for the next job
(:class:`~mlflow_hvd.protocol.messages.AwaitJob`); the driver answers with the next payload, or
``Retire`` when the pool closes.

A job that fails (a rank raised, died or was stopped, a deadline passed) ends its
generation: every rank is stopped and the backend released; the next ``run`` starts a new
generation. Closing the pool retires the ranks, waits a bounded time for them and the
backend (a Spark stage frees its slots), and stops the driver's servers, on every path.
"""

from __future__ import annotations

import enum
import logging
import queue
import secrets
import threading
from collections.abc import Callable
from typing import TextIO

from mlflow_hvd.backends.base import Backend, JobSpec
from mlflow_hvd.common import logs
from mlflow_hvd.common.deadline import Deadline
from mlflow_hvd.driver.job import (
    TrackingWriter,
    credentials_answer,
    layout_answer,
    log_load,
    message_router,
    new_job_id,
    open_channel,
    request_router,
)
from mlflow_hvd.driver.limits import ensure_open_files
from mlflow_hvd.driver.rendezvous import Rendezvous
from mlflow_hvd.driver.supervisor import DriverSettings, JobRecord, supervise
from mlflow_hvd.driver.tasks import TaskGate
from mlflow_hvd.errors import BackendError, JobNotStartedError, WorkerFailedError
from mlflow_hvd.protocol.credentials import Credentials
from mlflow_hvd.protocol.messages import (
    AwaitJob,
    EpochReport,
    NextJob,
    RankDisconnected,
    Retire,
    TrackingWrite,
    UndeliveredTracking,
    WorkerError,
    WorkerExited,
)

RETIRE_WAIT = 15.0  # seconds retired ranks and the backend get to end before being stopped
IDLE_POLL = 1.0  # seconds between checks of an idle rank's limit

log = logging.getLogger(__name__)


class GenerationState(enum.Enum):
    """Where a set of warm ranks is. ``SERVING`` while it runs jobs and its ranks wait for
    the next; ``EXPIRED`` once a rank waited longer than the idle limit (it is retired, and
    the next run replaces the generation); ``RETIRING`` once the pool closes or discards it
    (every waiting rank is answered ``Retire``)."""

    SERVING = "serving"
    EXPIRED = "expired"
    RETIRING = "retiring"


class _Generation:
    """One set of live ranks: the driver's servers, the backend, and the ranks' requests.

    ``state`` moves only through :meth:`_expire` and :meth:`close`, under ``_cond``.
    """

    def __init__(
        self,
        np: int,
        backend: Backend,
        driver_host: str,
        settings: DriverSettings,
        on_undelivered: Callable[[UndeliveredTracking], None] | None,
    ) -> None:
        self.np, self.backend, self.settings = np, backend, settings
        self.events: queue.Queue[object] = queue.Queue()
        ensure_open_files(np)
        self.rendezvous = Rendezvous(abs(np))
        self._cond = threading.Condition()
        self.state = GenerationState.SERVING
        self._waiting: set[int] = set()  # ranks whose AwaitJob is open
        self._handed = 0  # jobs handed out after the first: a waiting rank's ticket
        self._payload = b""
        self.number = 0  # set by the pool: 1 for its first generation
        self.on_tracking_write: TrackingWriter | None = None  # the current job's
        self.tasks = TaskGate()  # the generation's Spark tasks
        route = message_router(self.events, self.rendezvous, on_undelivered, self.tasks)
        self.secret = secrets.token_bytes(32)
        self.credentials: Credentials | None = None  # the current job's, for its rank 0
        answer = request_router(
            lambda request: self._write(request), self._on_request,
            layout_answer(self.tasks, self.rendezvous, self.events),
            credentials_answer(self.secret, lambda: self.credentials))
        try:
            self.channel = open_channel(self.secret, route, driver_host, answer)
            self.port = self.channel.start()
        except BaseException:
            self.rendezvous.stop()
            raise
        self.driver_host = driver_host

    def first_job(self, payload: bytes, job_id: str, description: str) -> JobSpec:
        return JobSpec(
            np=self.np,
            payload=payload,
            secret=self.secret,
            driver_host=self.driver_host,
            channel_port=self.port,
            rendezvous_port=self.rendezvous.port,
            job_id=job_id,
            description=description,
            channel_timeout=self.settings.channel_timeout,
            idle_timeout=self.settings.idle_timeout,
            max_line_bytes=self.settings.max_line_bytes,
            stop_grace=self.settings.stop_grace,
            gloo_iface=self.settings.gloo_iface,
            pooled=True,
            log_level=logs.handed_level(),
            horovod_env=self.settings.horovod_env,
            gpu_resource=self.settings.gpu_resource,
        )

    def _write(self, request: TrackingWrite | EpochReport) -> object:
        """Rank 0's tracking write or epoch report, answered by the current job's writer."""
        writer = self.on_tracking_write
        return writer(request) if writer is not None else Retire()

    def _on_request(self, request: object) -> object:
        """A rank finished its job: hold it until the next job, the pool's close, or the
        idle limit (``settings.idle_timeout``), whichever comes first."""
        if not isinstance(request, AwaitJob):
            return Retire()
        idle = Deadline.after(self.settings.idle_timeout)
        with self._cond:
            self._waiting.add(request.rank)
            self._cond.notify_all()
            handed = self._handed
            while self._handed == handed and self.state is GenerationState.SERVING:
                if idle.passed():
                    self._expire(request.rank, idle)
                    break
                self._cond.wait(idle.slice(IDLE_POLL))
            self._waiting.discard(request.rank)
            if self._handed != handed:
                return NextJob(self._payload)
            return Retire()

    def _expire(self, rank: int, idle: Deadline) -> None:
        """SERVING -> EXPIRED: a rank waited ``idle.seconds`` for a job; retire them all
        (the next run starts a new generation). Called under ``_cond``."""
        self.state = GenerationState.EXPIRED
        self._cond.notify_all()
        log.info("generation %d: rank %d idle for %.0fs (idle limit): retiring its ranks",
                 self.number, rank, idle.seconds)

    def hand_out(self, payload: bytes, deadline: Deadline) -> None:
        """Give ``payload`` to every rank once all wait for it.

        Raises:
            BackendError: A rank died between jobs, or not every rank asked for the next
                job within the deadline (the caller replaces the generation).
        """
        with self._cond:
            while True:
                if self.state is not GenerationState.SERVING:
                    raise BackendError(f"the warm ranks are {self.state.value}")
                gone = self._gone_between_jobs()  # a dead rank's request may still wait
                if gone:
                    raise BackendError(f"a pooled rank ended between jobs: {gone}")
                if len(self._waiting) >= self.np:
                    break
                if deadline.passed():
                    missing = sorted(set(range(self.np)) - self._waiting)
                    raise BackendError(
                        f"pooled ranks {', '.join(map(str, missing))} did not ask for the "
                        "next job in time"
                    )
                self._cond.wait(deadline.slice(0.1))
            self._drain_idle_messages()
            self.rendezvous.reset()  # a fresh round for Horovod's next init
            self._payload = payload
            self._handed += 1
            self._cond.notify_all()

    def _gone_between_jobs(self) -> str:
        """A description of ranks that ended while idle (their exit reports queued)."""
        found = []
        for message in list(self.events.queue):
            if isinstance(message, WorkerExited):
                found.append(f"rank {message.rank} on {message.host} (exit {message.exit_code})")
            elif isinstance(message, RankDisconnected | WorkerError):
                found.append(f"rank {message.rank}")
        return "; ".join(found)

    def _drain_idle_messages(self) -> None:
        """Messages that arrived between jobs (stray output) belong to no job: drop them."""
        while True:
            try:
                self.events.get_nowait()
            except queue.Empty:
                return

    def close(self, retire: bool) -> None:
        """-> RETIRING: retire (or stop) every rank, release the backend, stop the servers."""
        with self._cond:
            self.state = GenerationState.RETIRING
            self._cond.notify_all()
        log.info("generation %d: %s its ranks", self.number,
                 "retiring" if retire else "stopping")
        try:
            if not retire or not self.backend.wait(RETIRE_WAIT):
                self.tasks.close()
                self.backend.stop()
            self.backend.close()
        finally:
            self.rendezvous.stop()
            self.channel.stop()
            log_load(f"generation {self.number}", self.channel.stats(), self.rendezvous.stats())


def died_before_starting(record: JobRecord) -> bool:
    """The job failed only because ranks died before starting it (after asking for it),
    e.g. killed while idle: no rank raised, and every rank that failed never started."""
    failed = [r for r, e in record.exited.items() if e.exit_code != 0 and not e.stopped]
    return bool(failed) and not record.errors and not set(failed) & set(record.started)


class RankPool:
    """Runs jobs of ``np`` ranks on warm processes (see the module docstring).

    Args:
        np: Number of ranks.
        make_backend: Returns a new backend and the address workers reach the driver at;
            called for each generation.
        settings: The driver's deadlines and output settings.
    """

    def __init__(
        self,
        np: int,
        make_backend: Callable[[], tuple[Backend, str]],
        settings: DriverSettings,
    ) -> None:
        self.np = np
        self._make_backend = make_backend
        self._settings = settings
        self._live: _Generation | None = None
        self.generations = 0  # how many sets of ranks were started (1 + replacements)

    def run(
        self,
        payload: bytes,
        description: str,
        out: TextIO,
        job_id: str | None = None,
        on_undelivered: Callable[[UndeliveredTracking], None] | None = None,
        settings: DriverSettings | None = None,
        on_tracking_write: TrackingWriter | None = None,
    ) -> bytes:
        """Run one job on the pool's ranks (starting them if needed) and return rank 0's
        cloudpickled value. A failed job ends the generation; the next run starts anew.
        ``on_tracking_write`` answers this job's tracking writes from rank 0.

        A rank that dies while idle is replaced: found before the hand-out (its exit is
        already reported), the job runs on a new generation at once; found after it (the
        rank died having asked for the job but before starting it), the job never ran and
        :class:`JobNotStartedError` says so (the caller's retry policy runs it again).

        Raises:
            WorkerFailedError, StartTimeoutError, RunTimeoutError, BackendError,
            JobNotStartedError.
        """
        settings = settings or self._settings
        job_id = job_id or new_job_id()
        succeeded = False
        try:
            handed = False
            if self._live is not None:
                self._live.on_tracking_write = on_tracking_write
                self._live.credentials = settings.credentials
                try:
                    self._live.hand_out(payload, Deadline.after(settings.start_timeout))
                    handed = True
                    log.info("job %s: handed to generation %d", job_id, self._live.number)
                except BackendError as exc:
                    log.info("job %s: generation %d cannot take it (%s); starting new ranks",
                             job_id, self._live.number, exc)
                    self._discard()
            if self._live is None:
                self._start_generation(payload, job_id, description, settings, on_undelivered,
                                       on_tracking_write)
            assert self._live is not None
            record = JobRecord(self.np, job_id, tasks=self._live.tasks)
            try:
                value = self._supervise(record, settings, out)
            except WorkerFailedError as exc:
                if not (handed and died_before_starting(record)):
                    raise
                raise JobNotStartedError(
                    f"ranks of generation {self._live.number if self._live else 0} died "
                    f"after taking job {job_id} but before starting it: {exc.root_cause.host}"
                    f" rank {exc.rank} ({exc.root_cause.describe_exit()})"
                ) from exc
            succeeded = True
            return value
        finally:
            if not succeeded:
                self._discard()

    def _start_generation(
        self,
        payload: bytes,
        job_id: str,
        description: str,
        settings: DriverSettings,
        on_undelivered: Callable[[UndeliveredTracking], None] | None,
        on_tracking_write: TrackingWriter | None,
    ) -> None:
        backend, driver_host = self._make_backend()
        self._live = _Generation(self.np, backend, driver_host, settings, on_undelivered)
        self._live.on_tracking_write = on_tracking_write
        self._live.credentials = settings.credentials
        self.generations += 1
        self._live.number = self.generations
        log.info("generation %d: starting %d ranks for job %s", self.generations, self.np,
                 job_id)
        backend.start(self._live.first_job(payload, job_id, description), self._live.events.put)

    def _supervise(self, record: JobRecord, settings: DriverSettings, out: TextIO) -> bytes:
        live = self._live
        assert live is not None
        return supervise(record, live.events, live.backend, settings, out)

    def _discard(self) -> None:
        """Stop the current generation's ranks now (after a failure)."""
        live, self._live = self._live, None
        if live is not None:
            live.close(retire=False)

    def close(self) -> None:
        """Retire the ranks and release everything; the pool may be used again (it then
        starts a new generation). Idempotent."""
        live, self._live = self._live, None
        if live is not None:
            live.close(retire=True)

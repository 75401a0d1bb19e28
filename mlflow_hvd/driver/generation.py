"""Driver side: one generation of ranks — the driver's servers, the backend that started
the ranks, and the answers to what the ranks ask — from set-up to tear-down.

Every job runs on a generation. A cold one (``warm=False``) serves one job: its ranks exit
after it. A warm one (:mod:`mlflow_hvd.driver.pool`'s ``with HorovodRunner(...)``) keeps
its ranks after each job: each shuts Horovod down, clears Keras' state and asks for the next
job (:class:`~mlflow_hvd.protocol.messages.AwaitJob`), answered with the next payload, or
``Retire`` when the generation closes or its ranks waited past the idle limit.
"""

from __future__ import annotations

import enum
import logging
import queue
import secrets
import threading

from mlflow_hvd.backends.base import Backend, JobSpec
from mlflow_hvd.common import logs
from mlflow_hvd.common.deadline import Deadline
from mlflow_hvd.common.layout import job_vars
from mlflow_hvd.common.network import listen_address
from mlflow_hvd.driver.channel_server import ChannelServer, ChannelStats
from mlflow_hvd.driver.events import LoopEvent, TorchStoreFailed
from mlflow_hvd.driver.job import Job
from mlflow_hvd.driver.limits import ensure_open_files
from mlflow_hvd.driver.rendezvous import ElasticRefused, Rendezvous, RendezvousStats
from mlflow_hvd.driver.routing import (
    UndeliveredHandler,
    credentials_answer,
    layout_answer,
    message_router,
    request_router,
    untracked_answer,
)
from mlflow_hvd.driver.tasks import TaskGate
from mlflow_hvd.driver.torch_store import TorchStore, torch_available
from mlflow_hvd.errors import BackendError
from mlflow_hvd.protocol.credentials import Credentials
from mlflow_hvd.protocol.messages import (
    AwaitJob,
    EpochReport,
    FeedAgreed,
    JobEnded,
    NextJob,
    RankDisconnected,
    Retire,
    TrackingWrite,
    WorkerError,
    WorkerExited,
)

RETIRE_WAIT = 15.0  # seconds ranks that end by themselves and the backend get before a stop
IDLE_POLL = 1.0  # seconds between checks of an idle rank's limit

log = logging.getLogger(__name__)


def job_spec(job: Job, np: int, secret: bytes, driver_host: str, channel_port: int,
             rendezvous_port: int, warm: bool, torch_port: int = 0) -> JobSpec:
    """What a generation's ranks are started with, from its first job's settings (the one
    place a :class:`JobSpec` is built); ``torch_port``: the first job's store's (0: none)."""
    settings = job.settings
    return JobSpec(
        np=np,
        payload=job.payload,
        secret=secret,
        driver_host=driver_host,
        channel_port=channel_port,
        rendezvous_port=rendezvous_port,
        job_id=job.job_id,
        description=job.description,
        channel_timeout=settings.channel_timeout,
        max_line_bytes=settings.max_line_bytes,
        stop_grace=settings.stop_grace,
        gloo_iface=settings.gloo_iface,
        pooled=warm,
        log_level=logs.handed_level(),
        idle_timeout=settings.idle_timeout,
        horovod_env=settings.horovod_env,
        gpu_resource=settings.gpu_resource,
        feed=job.feed.spec if job.feed is not None else None,
        job_vars=vars_for(job, torch_port),
        torch_nodes_are_tasks=job.torch_nodes_are_tasks,
    )


def vars_for(job: Job, torch_port: int) -> tuple[tuple[str, str], ...]:
    """The variables every rank has while ``job`` runs, its store on ``torch_port`` (0:
    none), sent with the job (the first in :class:`JobSpec`, a warm rank's next in
    :class:`NextJob`)."""
    return job_vars(job.job_id, torch_port, job.attempt, job.max_restarts, job.rank_env)


class GenerationState(enum.Enum):
    """Where a generation is. ``SERVING`` while it runs jobs (and, warm, its ranks wait for
    the next); ``EXPIRED`` once a warm rank waited longer than the idle limit (the next job
    needs a new generation); ``CLOSED`` once :meth:`Generation.close` began (every waiting
    rank is answered ``Retire``)."""

    SERVING = "serving"
    EXPIRED = "expired"
    CLOSED = "closed"


class Generation:
    """One set of ranks and the driver's servers for them (see the module docstring).

    Servers listen from construction on; :meth:`launch` starts the ranks with a first job,
    :meth:`hand_out` gives warm ranks the next, :meth:`close` tears everything down.
    ``state`` moves only through :meth:`_expire` and :meth:`close`, under ``_cond``; the
    current job (whose handlers answer rank 0) changes only in :meth:`launch` and
    :meth:`hand_out`.
    """

    def __init__(self, np: int, backend: Backend, driver_host: str, warm: bool,
                 number: int = 1) -> None:
        self.np, self.backend, self.driver_host = np, backend, driver_host
        self.warm, self.number = warm, number
        self.name = f"generation {number}"  # a cold one is named for its job at launch
        # the current job's events (a new queue for each job: what arrives for a job that
        # ended goes nowhere), and what ended a rank's process, recorded as it arrives
        self._events: queue.Queue[LoopEvent] = queue.Queue()
        self._lost: dict[int, str] = {}
        self.tasks = TaskGate()  # the generation's Spark tasks
        self.secret = secrets.token_bytes(32)
        self.state = GenerationState.SERVING
        self._cond = threading.Condition()
        self._job: Job | None = None
        self._next_vars: tuple[tuple[str, str], ...] = ()  # the handed job's (vars_for)
        self._waiting: set[int] = set()  # ranks whose AwaitJob is open
        self._idle: set[int] = set()  # ranks whose job ended since the last hand-out
        self._handed = 0  # jobs handed out after the first: a waiting rank's ticket
        ensure_open_files(np)
        # where the channel, the rendezvous and the torch store listen (one choice)
        self.bind_host = listen_address(driver_host)
        self.rendezvous = Rendezvous(np, self.bind_host,
                                     on_elastic=lambda: self._post(ElasticRefused()))
        self._route = message_router(
            self._post, self.rendezvous, self._undelivered, self.tasks, self._fed,
            on_torch_store=self._serve_torch, on_job_end=self._job_ended)
        self._torch: TorchStore | None = None  # the current job's torch.distributed store
        answer = request_router(
            self._tracking, layout_answer(self.tasks, self.rendezvous, self._post),
            credentials_answer(self.secret, self._credentials),
            self._await_job if warm else None)
        channel: ChannelServer | None = None
        try:
            channel = ChannelServer(self.secret, self._route, self.bind_host, answer)
            self.port = channel.start()
        except BaseException:  # no channel, no job: the rendezvous server must not outlive it
            if channel is not None:
                channel.stop()
            self.rendezvous.stop()
            raise
        self.channel = channel
        # what the ranks were started with (launch); before that no rank can wait
        self._idle_timeout = 0.0
        self.feed_key: tuple[tuple[str, int], ...] = ()  # the DataFrames its ranks were fed
        self.torch_nodes_are_tasks = False  # how its ranks' torchrun variables number them
        self.split: FeedAgreed | None = None  # how they were split over the ranks

    # --- what it is doing, for callers that wait on it -------------------------------------
    @property
    def jobs(self) -> int:
        """How many jobs were given to the ranks (the first at launch, then each hand-out)."""
        with self._cond:
            return self._handed + (self._job is not None)

    @property
    def waiting(self) -> frozenset[int]:
        """The ranks that asked for the next job and wait for it."""
        with self._cond:
            return frozenset(self._waiting)

    @property
    def lost(self) -> dict[int, str]:
        """The ranks whose process ended between jobs, each with what ended it (a copy)."""
        with self._cond:
            return dict(self._lost)

    # --- the current job's events ---------------------------------------------------------
    @property
    def events(self) -> queue.Queue[LoopEvent]:
        """The current job's events (what its driver loop consumes)."""
        with self._cond:
            return self._events

    def _post(self, event: LoopEvent) -> None:
        """Hand ``event`` to the current job, and note a rank's process ending (its exit,
        its connection closing, its error) for :meth:`hand_out`, under the lock that
        hands out the next job: a rank that ends between two jobs is seen by the next
        hand-out or reaches the next job's loop, never neither."""
        with self._cond:
            match event:
                case WorkerExited():
                    self._lost[event.rank] = (f"rank {event.rank} on {event.host} "
                                              f"(exit {event.exit_code})")
                    self._say_ended(event)
                case RankDisconnected() | WorkerError():
                    self._lost.setdefault(event.rank, f"rank {event.rank}")
                case _:
                    pass
            self._events.put(event)

    # --- the current job's handlers ------------------------------------------------------
    def _tracking(self, request: TrackingWrite | EpochReport) -> object:
        job = self._job
        if job is None or job.on_tracking_write is None:
            return untracked_answer(request)
        if job.grow is not None and job.grow.restart.is_set():
            return job.grow.dropped(request)  # the next attempt does that work again
        return job.on_tracking_write(request)

    def _credentials(self) -> Credentials | None:
        job = self._job
        return job.settings.credentials if job is not None else None

    def _fed(self, split: FeedAgreed) -> None:
        """How the DataFrames were split: kept for the generation's later jobs, and told to
        the current job (its dataset inputs)."""
        self.split = split
        job = self._job
        if job is not None and job.on_fed is not None:
            job.on_fed(split)

    def _undelivered(self) -> UndeliveredHandler | None:
        job = self._job
        return job.on_undelivered if job is not None else None

    # --- lifecycle -----------------------------------------------------------------------
    def launch(self, job: Job) -> None:
        """Start the ranks with ``job`` as their first (returns once the backend started)."""
        self._job = job
        if not self.warm:
            self.name = f"job {job.job_id}"
        log.info("%s: starting %d ranks on the %s backend for job %s (%s)", self.name,
                 self.np, self.backend.name, job.job_id, job.description)
        spec = job_spec(job, self.np, self.secret, self.driver_host, self.port,
                        self.rendezvous.port, self.warm, self._new_torch_store())
        self._idle_timeout = spec.idle_timeout
        self.feed_key = job.feed_key
        self.torch_nodes_are_tasks = job.torch_nodes_are_tasks
        self.backend.start(spec, self._route)  # what the backend itself reports, routed

    def hand_out(self, job: Job, deadline: Deadline) -> None:
        """Give ``job`` to every warm rank once all wait for it.

        Raises:
            BackendError: A rank died between jobs, or not every rank asked for the next
                job within the deadline (the caller replaces the generation).
        """
        with self._cond:
            while True:
                if self.state is not GenerationState.SERVING:
                    raise BackendError(f"the warm ranks are {self.state.value}")
                if self._lost:  # a dead rank's request may still wait
                    gone = "; ".join(self._lost[rank] for rank in sorted(self._lost))
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
            self._events = queue.Queue()  # what came between jobs belongs to no job
            self._idle.clear()
            self.rendezvous.reset()  # a fresh round for Horovod's next init
            # and a fresh store for torch.distributed's
            self._next_vars = vars_for(job, self._new_torch_store())
            self._job = job
            self._handed += 1
            self._cond.notify_all()
        log.info("job %s: handed to %s", job.job_id, self.name)
        if self.split is not None and job.on_fed is not None:
            job.on_fed(self.split)  # its ranks hold the data they were fed at the start

    def _await_job(self, request: AwaitJob) -> object:
        """A warm rank finished its job: hold it until the next job, the generation's close,
        or the idle limit the ranks were started with, whichever comes first."""
        idle = Deadline.after(self._idle_timeout)
        log.debug("%s: rank %d asks for the next job", self.name, request.rank)
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
            if self._handed != handed and self._job is not None:
                return NextJob(self._job.payload, self._next_vars)
            return Retire()

    def _expire(self, rank: int, idle: Deadline) -> None:
        """SERVING -> EXPIRED: a rank waited ``idle.seconds`` for a job; retire them all
        (the next run starts a new generation). Called under ``_cond``."""
        self.state = GenerationState.EXPIRED
        self._cond.notify_all()
        log.info("%s: rank %d idle for %.0fs (idle limit): retiring its ranks",
                 self.name, rank, idle.seconds)

    def _new_torch_store(self) -> int:
        """Replace the last job's torch.distributed store by a new one (a port bound now,
        served once a rank asks: :mod:`mlflow_hvd.driver.torch_store`); its port, 0 when
        this driver has no torch."""
        if self._torch is not None:
            self._torch.close()
            self._torch = None
        if not torch_available():
            return 0
        self._torch = TorchStore(self.bind_host, self.rendezvous.admission,
                                 on_failure=lambda why: self._post(TorchStoreFailed(why)))
        return self._torch.port

    def _serve_torch(self) -> None:
        """A rank imported torch.distributed: the current job's store starts serving."""
        store = self._torch
        if store is not None:
            store.serve()

    def _job_ended(self, message: JobEnded) -> None:
        """A pooled rank's job ended: it waits, or is about to wait, for the next job."""
        self._idle.add(message.rank)

    def _say_ended(self, message: WorkerExited) -> None:
        """A log line when a rank whose job ended ends itself (the next ``hand_out`` then
        refuses this generation); not once the generation retires its ranks. Called under
        ``_cond``."""
        if self.state is GenerationState.SERVING and (
                message.rank in self._waiting or message.rank in self._idle):
            log.info("%s: rank %d on %s ended between jobs (exit %d); the next job "
                     "starts new ranks", self.name, message.rank, message.host,
                     message.exit_code)

    def close(self, stop_now: bool) -> None:
        """-> CLOSED: let the ranks end by themselves (a cold job's ranks after their job,
        within the backend's own bounded wait; warm ranks answered ``Retire``, within
        ``RETIRE_WAIT`` seconds), or stop them now (``stop_now``: after a failure, a
        deadline or Ctrl-C); release the backend and stop the servers, on every path.
        Idempotent."""
        with self._cond:
            if self.state is GenerationState.CLOSED:
                return
            self.state = GenerationState.CLOSED
            self._cond.notify_all()
        log.info("%s: %s its ranks", self.name, "stopping" if stop_now else "releasing")
        try:
            if stop_now or (self.warm and not self.backend.wait(RETIRE_WAIT)):
                self.tasks.close()
                self.backend.stop()
            self.backend.close()
        finally:
            self.rendezvous.stop()
            self.channel.stop()
            if self._torch is not None:
                self._torch.close()
            log_load(self.name, self.channel.stats(), self.rendezvous.stats())


def log_load(what: str, channel: ChannelStats, rendezvous: RendezvousStats) -> None:
    """The lifecycle log's account of what a generation's ranks asked of the driver's
    servers."""
    log.info("%s: the channel handled %d connections (%d open at most) and %d messages; "
             "the rendezvous server %d requests in %.1fs (%d not there yet, %d refused), "
             "%.1f MiB sent",
             what, channel.connections, channel.max_open, channel.messages,
             rendezvous.requests, rendezvous.seconds, rendezvous.not_found,
             rendezvous.refused, rendezvous.bytes_sent / 2**20)

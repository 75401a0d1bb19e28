"""One job's lifetime on the driver: servers up, backend started, supervised, all stopped."""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import sys
import uuid
from collections.abc import Callable
from typing import TextIO

from mlflow_hvd.backends.base import Backend, JobSpec
from mlflow_hvd.common import logs
from mlflow_hvd.driver.channel_server import ChannelServer, ChannelStats
from mlflow_hvd.driver.limits import ensure_open_files
from mlflow_hvd.driver.rendezvous import Rendezvous, RendezvousStats
from mlflow_hvd.driver.supervisor import DriverSettings, JobRecord, supervise
from mlflow_hvd.driver.tasks import TaskGate
from mlflow_hvd.protocol.credentials import Credentials, seal
from mlflow_hvd.protocol.messages import (
    AskCredentials,
    EpochReport,
    Launch,
    LayoutReport,
    Retire,
    TaskDisconnected,
    TrackingWrite,
    UndeliveredTracking,
)

log = logging.getLogger(__name__)

# Answers rank 0's tracking requests: a TrackingWrite (-> TrackingWritten) and, in a job
# that prunes, an EpochReport (-> EpochVerdict); Retire for what it does not handle
TrackingWriter = Callable[[TrackingWrite | EpochReport], object]


def run_job(
    np: int,
    payload: bytes,
    backend: Backend,
    settings: DriverSettings,
    driver_host: str,
    description: str,
    out: TextIO | None = None,
    job_id: str | None = None,
    on_undelivered: Callable[[UndeliveredTracking], None] | None = None,
    on_tracking_write: TrackingWriter | None = None,
) -> bytes:
    """Run one job to completion and return rank 0's cloudpickled return value.

    Starts the channel and rendezvous servers and the backend, supervises the job, and
    always stops all three before returning or raising. Tracking records rank 0 could not
    deliver are passed to ``on_undelivered`` as they arrive; ``on_tracking_write`` answers
    rank 0's writes (:mod:`mlflow_hvd.driver.tracking.relay`; None for a job that does not track).

    Raises:
        WorkerFailedError: A rank raised, exited non-zero or was killed.
        StartTimeoutError: Not every rank started within ``settings.start_timeout``.
        RunTimeoutError: The job exceeded ``settings.run_timeout``.
        BackendError: The backend failed outside the user's code.
    """
    events: queue.Queue[object] = queue.Queue()
    job_id = job_id or new_job_id()
    ensure_open_files(np)
    rendezvous = Rendezvous(abs(np))
    tasks = TaskGate()
    on_message = message_router(events, rendezvous, on_undelivered, tasks)
    secret = secrets.token_bytes(32)
    try:
        channel = open_channel(secret, on_message, driver_host, request_router(
            on_tracking_write, on_layout=layout_answer(tasks, rendezvous, events),
            on_credentials=credentials_answer(secret, lambda: settings.credentials)))
    except BaseException:  # no channel, no job: the rendezvous server must not outlive it
        rendezvous.stop()
        raise
    try:
        job = JobSpec(
            np=np,
            payload=payload,
            secret=secret,
            driver_host=driver_host,
            channel_port=channel.start(),
            rendezvous_port=rendezvous.port,
            job_id=job_id,
            description=description,
            channel_timeout=settings.channel_timeout,
            max_line_bytes=settings.max_line_bytes,
            stop_grace=settings.stop_grace,
            gloo_iface=settings.gloo_iface,
            log_level=logs.handed_level(),
            horovod_env=settings.horovod_env,
            gpu_resource=settings.gpu_resource,
        )
        log.info("job %s: starting %d ranks on the %s backend (%s)", job.job_id, np,
                 backend.name, description)
        finished = False
        try:
            backend.start(job, on_message)
            record = JobRecord(np, job.job_id, tasks=tasks)
            value = supervise(record, events, backend, settings, out or sys.stdout)
            finished = True
            return value
        finally:
            if not finished:  # failure, deadline or Ctrl-C: stop now, don't wait
                tasks.close()
                backend.stop()
            backend.close()
    finally:
        rendezvous.stop()
        channel.stop()
        log_load(f"job {job_id}", channel.stats(), rendezvous.stats())


def log_load(what: str, channel: ChannelStats, rendezvous: RendezvousStats) -> None:
    """The lifecycle log's account of what a job's ranks asked of the driver's servers."""
    log.info("%s: the channel handled %d connections (%d open at most) and %d messages; "
             "the rendezvous server %d requests in %.1fs (%d not there yet), %.1f MiB sent",
             what, channel.connections, channel.max_open, channel.messages,
             rendezvous.requests, rendezvous.seconds, rendezvous.not_found,
             rendezvous.bytes_sent / 2**20)


def open_channel(
    secret: bytes,
    on_message: Callable[[object], None],
    driver_host: str,
    on_request: Callable[[object], object] | None = None,
) -> ChannelServer:
    """The channel server, listening only where workers connect (loopback for local
    processes); on every interface when ``driver_host`` is not an address of this host
    (e.g. behind NAT)."""
    try:
        return ChannelServer(secret, on_message, driver_host, on_request)
    except OSError:
        return ChannelServer(secret, on_message, "", on_request)


def message_router(
    events: queue.Queue[object],
    rendezvous: Rendezvous,
    on_undelivered: Callable[[UndeliveredTracking], None] | None,
    tasks: TaskGate | None = None,
) -> Callable[[object], None]:
    """Where each incoming message goes: a layout the local backend sinks to the
    rendezvous (a mismatch, and everything else but undelivered tracking, to the driver
    loop's queue); a Spark task's departure also to ``tasks``."""

    def on_message(message: object) -> None:
        if isinstance(message, LayoutReport):
            mismatch = rendezvous.on_layout(message)
            if mismatch is not None:
                events.put(mismatch)
        elif isinstance(message, TaskDisconnected):
            if tasks is not None:
                tasks.left(message.partition)
            events.put(message)  # wakes the driver loop
        elif isinstance(message, UndeliveredTracking):
            if on_undelivered is not None:
                on_undelivered(message)
        else:
            events.put(message)

    return on_message


def request_router(
    on_tracking_write: TrackingWriter | None,
    on_other: Callable[[object], object] | None = None,
    on_layout: Callable[[LayoutReport], object] | None = None,
    on_credentials: Callable[[AskCredentials], object] | None = None,
) -> Callable[[object], object]:
    """Who answers each request: rank 0's tracking writes and epoch reports go to
    ``on_tracking_write``, a Spark task's layout to ``on_layout``, rank 0's request for the
    driver's MLflow client settings to ``on_credentials``, others to ``on_other``;
    ``Retire`` when nobody handles it (rank 0 then reports its records refused, or trains
    on; a task starts no worker; rank 0 goes on without settings)."""

    def on_request(request: object) -> object:
        if isinstance(request, TrackingWrite | EpochReport):
            return on_tracking_write(request) if on_tracking_write is not None else Retire()
        if isinstance(request, LayoutReport):
            return on_layout(request) if on_layout is not None else Retire()
        if isinstance(request, AskCredentials):
            return on_credentials(request) if on_credentials is not None else Retire()
        return on_other(request) if on_other is not None else Retire()

    return on_request


def credentials_answer(
    secret: bytes, current: Callable[[], Credentials | None]
) -> Callable[[AskCredentials], object]:
    """Rank 0's request for the driver's MLflow client settings: the current job's, sealed
    with the job's secret; :class:`Retire` for any other rank, or when there are none."""

    def answer(request: AskCredentials) -> object:
        credentials = current()
        if request.rank != 0 or credentials is None:
            return Retire()
        log.info("rank 0 gets the driver's MLflow client settings: %s",
                 ", ".join(credentials.names()))
        return seal(secret, credentials)

    return answer


def layout_answer(
    tasks: TaskGate, rendezvous: Rendezvous, events: queue.Queue[object]
) -> Callable[[LayoutReport], object]:
    """The answer to a Spark task's layout: :class:`Launch` once the task is counted and
    the rendezvous initialised (a mismatch goes to the driver loop), :class:`Retire` when
    the job is already being stopped."""

    def answer(report: LayoutReport) -> object:
        if not tasks.admit(report.partition):
            log.info("task %d reported after the job began stopping: it starts no worker",
                     report.partition)
            return Retire()
        mismatch = rendezvous.on_layout(report)
        if mismatch is not None:
            events.put(mismatch)
        return Launch()

    return answer


def new_job_id() -> str:
    """A unique id for one run; also its Spark job group."""
    return f"mlflow-hvd-{uuid.uuid4().hex[:12]}"


def resolve_host(host: str) -> str:
    """IPv4 address of ``host`` (workers and Gloo connect to the driver by address)."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host

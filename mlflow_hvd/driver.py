"""The driver loop: start a job on a backend, relay its output, and decide how it ended.

The loop only consumes messages (from the channel or, for local processes, directly from
the agents); it never branches on the backend's type. It owns every deadline: the start
deadline, the optional run deadline, and the bounded wind-down after a failure.
"""

from __future__ import annotations

import collections
import enum
import queue
import secrets
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from horovod.runner.http.http_server import RendezvousServer

from mlflow_hvd.backends.base import Backend, JobSpec
from mlflow_hvd.channel import ChannelServer
from mlflow_hvd.errors import (
    BackendError,
    RankFailure,
    RunTimeoutError,
    StartTimeoutError,
    WorkerFailedError,
)
from mlflow_hvd.layout import to_slot_infos
from mlflow_hvd.messages import (
    BackendFinished,
    LayoutReport,
    OutputLines,
    RankSlot,
    Stream,
    WorkerError,
    WorkerExited,
    WorkerResult,
    WorkerStarted,
)

TAIL_LINES = 100
EXIT_AFTER_ERROR = 2.0  # seconds a rank that reported an error gets to exit by itself


class Verbosity(enum.Enum):
    """``driver_log_verbosity`` of Databricks' HorovodRunner."""

    ALL = "all"
    LOG_CALLBACK_ONLY = "log_callback_only"


@dataclass(frozen=True)
class DriverSettings:
    """Deadlines and output settings of one run (all seconds)."""

    verbosity: Verbosity = Verbosity.LOG_CALLBACK_ONLY
    start_timeout: float = 60.0
    run_timeout: float | None = None
    stop_grace: float = 5.0
    channel_timeout: float = 60.0
    max_line_bytes: int = 16384
    gloo_iface: str | None = None
    # After a failure and stop(), how long the other ranks get to report their exit.
    report_grace: float = 15.0


class _Rendezvous:
    """horovod's RendezvousServer, initialised exactly once from the first layout report."""

    def __init__(self) -> None:
        self.server = RendezvousServer()
        self.port = int(self.server.start())
        self._lock = threading.Lock()
        self.slots: tuple[RankSlot, ...] | None = None
        self.mismatch: str = ""

    def on_layout(self, report: LayoutReport) -> None:
        with self._lock:
            if self.slots is None:
                self.slots = report.slots
                self.server.init(to_slot_infos(report.slots))
            elif report.slots != self.slots and not self.mismatch:
                self.mismatch = (
                    f"task {report.partition} computed a different rank layout than task 0; "
                    "were tasks placed on hosts with inconsistent hostnames?"
                )

    def stop(self) -> None:
        self.server.stop()


class _State:
    def __init__(self, np: int) -> None:
        self.np = np
        self.started: dict[int, str] = {}
        self.exited: dict[int, WorkerExited] = {}
        self.errors: dict[int, WorkerError] = {}
        self.result: WorkerResult | None = None
        self.backend_error = ""
        self.backend_done = False
        self.tails: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES)
        )
        self.first_failure_at: float | None = None

    def failed(self) -> bool:
        return bool(self.errors) or any(
            e.exit_code != 0 and not e.stopped for e in self.exited.values()
        )

    def failures(self) -> tuple[list[RankFailure], list[int]]:
        out: list[RankFailure] = []
        stopped: list[int] = []
        for rank in range(self.np):
            err = self.errors.get(rank)
            ex = self.exited.get(rank)
            failed = err is not None or (ex is not None and ex.exit_code != 0 and not ex.stopped)
            if not failed:
                if ex is None or ex.stopped:
                    stopped.append(rank)
                continue
            out.append(
                RankFailure(
                    rank=rank,
                    host=(err.host if err else ex.host if ex else self.started.get(rank, "?")),
                    exit_code=ex.exit_code if ex else None,
                    error=err.error if err else "",
                    traceback=err.traceback if err else "",
                    output_tail=tuple(self.tails[rank]),
                    timestamp=err.timestamp if err else ex.timestamp if ex else time.time(),
                )
            )
        out.sort(key=lambda f: f.timestamp)
        return out, stopped


def run_job(
    np: int,
    payload: bytes,
    backend: Backend,
    settings: DriverSettings,
    driver_host: str,
    description: str,
    out: TextIO | None = None,
    on_event: Callable[[object], None] | None = None,
    job_id: str | None = None,
) -> bytes:
    """Run one job to completion and return rank 0's cloudpickled return value.

    Starts the channel and rendezvous servers, the backend, and supervises until every rank
    exited or a failure / deadline ends the job. Always stops the servers and the backend
    before returning or raising.

    Raises:
        WorkerFailedError: A rank raised, exited non-zero or was killed.
        StartTimeoutError: Not every rank started within ``settings.start_timeout``.
        RunTimeoutError: The job exceeded ``settings.run_timeout``.
        BackendError: The backend failed outside the user's code.
    """
    events: queue.Queue[object] = queue.Queue()
    rendezvous = _Rendezvous()

    def on_message(message: object) -> None:
        if isinstance(message, LayoutReport):
            rendezvous.on_layout(message)
        else:
            events.put(message)

    secret = secrets.token_bytes(32)
    channel = ChannelServer(secret, on_message)
    job_id = job_id or new_job_id()
    try:
        channel_port = channel.start()
        job = JobSpec(
            np=np,
            payload=payload,
            secret=secret,
            driver_host=driver_host,
            channel_port=channel_port,
            rendezvous_port=rendezvous.port,
            job_id=job_id,
            description=description,
            channel_timeout=settings.channel_timeout,
            max_line_bytes=settings.max_line_bytes,
            stop_grace=settings.stop_grace,
            gloo_iface=settings.gloo_iface,
        )
        finished = False
        try:
            backend.start(job, on_message)
            payload = _supervise(np, events, backend, settings, out or sys.stdout, on_event)
            finished = True
            return payload
        finally:
            if not finished:  # failure, deadline or Ctrl-C: stop now, don't wait
                backend.stop()
            backend.close()
    finally:
        # horovod's server polls for shutdown every 0.5 s: stop it alongside the channel
        stopper = threading.Thread(target=rendezvous.stop, name="mlflow-hvd-rdv-stop")
        stopper.start()
        channel.stop()
        stopper.join(timeout=10)


def _supervise(
    np: int,
    events: queue.Queue[object],
    backend: Backend,
    settings: DriverSettings,
    out: TextIO,
    on_event: Callable[[object], None] | None,
) -> bytes:
    state = _State(np)
    t0 = time.monotonic()
    start_deadline = t0 + settings.start_timeout
    run_deadline = t0 + settings.run_timeout if settings.run_timeout else None
    # After a failure: how long to wait for the other ranks to report before giving up.
    wind_down = settings.stop_grace + settings.report_grace
    stop_sent = False
    while len(state.exited) < np:
        now = time.monotonic()
        if state.first_failure_at is not None and (
            now > state.first_failure_at + wind_down or (stop_sent and state.backend_done)
        ):
            break  # the backend has ended: no further reports can come
        if state.first_failure_at is None:
            if len(state.started) < np and now > start_deadline:
                backend.stop()
                missing = sorted(set(range(np)) - set(state.started))
                raise StartTimeoutError(
                    f"{len(state.started)} of {np} ranks started within "
                    f"{settings.start_timeout:.0f}s (missing ranks: "
                    f"{', '.join(map(str, missing))}). Raise HorovodRunner(start_timeout=...) "
                    "if workers are slow to start, or check that the cluster has free slots"
                )
            if run_deadline is not None and now > run_deadline:
                backend.stop()
                raise RunTimeoutError(
                    f"the job did not finish within {settings.run_timeout:.0f}s "
                    f"({len(state.exited)} of {np} ranks exited); raise "
                    "HorovodRunner(timeout=...) or pass timeout=None for no limit"
                )
            if state.backend_done and state.backend_error:
                raise BackendError(
                    f"the {backend.describe().get('backend', '')} backend failed before all "
                    f"ranks finished ({len(state.exited)} of {np} exited): "
                    f"{state.backend_error}"
                )
        try:
            message: object = events.get(timeout=0.1)
        except queue.Empty:
            message = None
        if message is not None:
            _handle(message, state, settings, out)
            if on_event is not None:
                on_event(message)
        if state.first_failure_at is None and state.failed():
            state.first_failure_at = time.monotonic()
        if state.first_failure_at is not None and not stop_sent:
            # A rank that reported an error exits by itself right after; give it a moment so
            # its real exit status is reported rather than our SIGTERM.
            erring = set(state.errors) - set(state.exited)
            if not erring or time.monotonic() > state.first_failure_at + EXIT_AFTER_ERROR:
                stop_sent = True
                backend.stop()
    if state.failed() or state.first_failure_at is not None:
        failures, stopped = state.failures()
        if failures:
            raise WorkerFailedError(failures[0], failures, stopped)
    if state.result is None:
        raise BackendError(
            "every rank exited with status 0 but rank 0 sent no return value; "
            "was the worker replaced by another program?"
        )
    return state.result.payload


def _handle(message: object, state: _State, settings: DriverSettings, out: TextIO) -> None:
    if isinstance(message, OutputLines):
        tail = state.tails[message.rank]
        show = message.stream is Stream.LOG or settings.verbosity is Verbosity.ALL
        for line in message.lines:
            text = f"[{message.rank}]<{message.stream.value}>: {line}"
            tail.append(text)
            if show:
                out.write(text + "\n")
        if show:
            out.flush()
    elif isinstance(message, WorkerStarted):
        state.started[message.rank] = message.host
    elif isinstance(message, WorkerResult):
        state.result = message
    elif isinstance(message, WorkerError):
        state.errors.setdefault(message.rank, message)
    elif isinstance(message, WorkerExited):
        state.exited[message.rank] = message
    elif isinstance(message, BackendFinished):
        state.backend_done = True
        state.backend_error = message.error


def new_job_id() -> str:
    """A unique id for one run; also its Spark job group."""
    return f"mlflow-hvd-{uuid.uuid4().hex[:12]}"


def resolve_host(host: str) -> str:
    """IPv4 address of ``host`` (workers and Gloo connect to the driver by address)."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


__all__ = ["DriverSettings", "Verbosity", "new_job_id", "resolve_host", "run_job"]

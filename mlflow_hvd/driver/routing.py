"""Driver side: where each message from a rank or a Spark task goes, and who answers each
request (every request type has its own answer types, :mod:`mlflow_hvd.protocol.messages`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from mlflow_hvd.driver.events import LoopEvent, UnknownMessage
from mlflow_hvd.driver.rendezvous import Rendezvous
from mlflow_hvd.driver.tasks import TaskGate
from mlflow_hvd.protocol.credentials import Credentials, seal
from mlflow_hvd.protocol.messages import (
    AskCredentials,
    AwaitJob,
    BackendFinished,
    CheckpointCommitted,
    EnvironmentMismatch,
    EpochReport,
    FeedAgreed,
    FeedFailed,
    FeedProgress,
    JobEnded,
    Launch,
    LayoutReport,
    NoCredentials,
    NotJudged,
    OutputLines,
    RankDisconnected,
    StartNoWorker,
    TaskDisconnected,
    TorchStoreWanted,
    TrackingWrite,
    TrackingWritten,
    Unanswered,
    UndeliveredTracking,
    WorkerError,
    WorkerExited,
    WorkerResult,
    WorkerStarted,
)

log = logging.getLogger(__name__)

# Answers rank 0's tracking requests: a TrackingWrite (-> TrackingWritten) and, in a job
# that prunes, an EpochReport (-> EpochVerdict or NotJudged)
TrackingWriter = Callable[[TrackingWrite | EpochReport], object]
UndeliveredHandler = Callable[[UndeliveredTracking], None]
Post = Callable[[LoopEvent], None]  # hands an event to the current job's driver loop


def message_router(
    post: Post,
    rendezvous: Rendezvous,
    on_undelivered: Callable[[], UndeliveredHandler | None],
    tasks: TaskGate,
    on_fed: Callable[[FeedAgreed], None] = lambda _: None,
    on_torch_store: Callable[[], None] = lambda: None,
    on_job_end: Callable[[JobEnded], None] = lambda _: None,
) -> Callable[[object], None]:
    """The one dispatch of what peers send and the channel and backends note (not requests:
    :func:`request_router`): a layout the local backend sinks to the rendezvous; a Spark
    task's departure to ``tasks``; how the job's DataFrames were split to ``on_fed``;
    undelivered tracking to the current job's handler (``on_undelivered()``); a rank's
    word that it imported torch.distributed to ``on_torch_store``; a pooled rank's job end
    to ``on_job_end``. What the driver loop needs goes to ``post`` (the current job's
    events, where the generation also notes a rank's end); a kind of message this driver
    does not know goes there as :class:`UnknownMessage` (the job fails, naming it)."""

    def on_message(message: object) -> None:
        match message:
            case LayoutReport():
                mismatch = rendezvous.on_layout(message)
                if mismatch is not None:
                    post(mismatch)
            case TaskDisconnected():
                tasks.left(message.partition)
                post(message)  # wakes the driver loop
            case FeedAgreed():
                on_fed(message)
            case UndeliveredTracking():
                handler = on_undelivered()
                if handler is None:
                    log.warning("mlflow_hvd: %d tracking records rank 0 could not deliver "
                                "arrived with no job to keep them; they are lost",
                                len(message.records))
                else:
                    handler(message)
            case TorchStoreWanted():
                on_torch_store()
            case JobEnded():
                on_job_end(message)
                post(message)
            case (WorkerExited() | WorkerStarted() | OutputLines() | WorkerResult() | WorkerError()
                  | BackendFinished() | FeedProgress() | FeedFailed() | EnvironmentMismatch()
                  | RankDisconnected() | CheckpointCommitted()):
                post(message)
            case _:
                log.error("mlflow_hvd: the driver refuses a message it does not know: %s",
                          type(message).__qualname__)
                post(UnknownMessage(type(message).__qualname__))

    return on_message


def request_router(
    on_tracking_write: Callable[[TrackingWrite | EpochReport], object],
    on_layout: Callable[[LayoutReport], object],
    on_credentials: Callable[[AskCredentials], object],
    on_await_job: Callable[[AwaitJob], object] | None = None,
) -> Callable[[object], object]:
    """Who answers each request: rank 0's tracking writes and epoch reports go to
    ``on_tracking_write``, a Spark task's layout to ``on_layout``, rank 0's request for the
    driver's MLflow client settings to ``on_credentials``, a warm rank's request for the
    next job to ``on_await_job`` (one match over :data:`~mlflow_hvd.protocol.messages
    .DriverRequest`); anything else is :class:`Unanswered`, and an unknown kind is logged as
    an error (the peer runs another version of mlflow_hvd)."""

    def on_request(request: object) -> object:
        match request:
            case TrackingWrite() | EpochReport():
                return on_tracking_write(request)
            case LayoutReport():
                return on_layout(request)
            case AskCredentials():
                return on_credentials(request)
            case AwaitJob() if on_await_job is not None:
                return on_await_job(request)
            case AwaitJob():  # a generation that keeps no ranks warm has no next job
                return Unanswered("this driver does not answer AwaitJob")
            case _:
                log.error("a rank or task sent a request this driver does not know (%s): "
                          "it runs another version of mlflow_hvd", type(request).__name__)
                return Unanswered(f"this driver does not answer {type(request).__name__}")

    return on_request


def untracked_answer(request: TrackingWrite | EpochReport) -> object:
    """The answer to rank 0's tracking request in a job the driver does not track."""
    if isinstance(request, EpochReport):
        return NotJudged("the job does not prune")
    return TrackingWritten(error=f"the driver keeps no MLflow run for this job (rank 0 "
                                 f"wrote to run {request.run_id})", outage=False)


def credentials_answer(
    secret: bytes, current: Callable[[], Credentials | None]
) -> Callable[[AskCredentials], object]:
    """Rank 0's request for the driver's MLflow client settings: the current job's, sealed
    with the job's secret; :class:`NoCredentials` for any other rank, or when there are
    none."""

    def answer(request: AskCredentials) -> object:
        credentials = current()
        if request.rank != 0 or credentials is None:
            return NoCredentials()
        log.info("rank 0 gets the driver's MLflow client settings: %s",
                 ", ".join(credentials.names()))
        return seal(secret, credentials)

    return answer


def layout_answer(
    tasks: TaskGate, rendezvous: Rendezvous, post: Post
) -> Callable[[LayoutReport], object]:
    """The answer to a Spark task's layout: :class:`Launch` once the task is counted and
    the rendezvous initialised (a mismatch goes to the driver loop), :class:`StartNoWorker`
    when the job is already being stopped."""

    def answer(report: LayoutReport) -> object:
        if not tasks.admit(report.partition):
            log.info("task %d reported after the job began stopping: it starts no worker",
                     report.partition)
            return StartNoWorker()
        mismatch = rendezvous.on_layout(report)
        if mismatch is not None:
            post(mismatch)
        return Launch()

    return answer

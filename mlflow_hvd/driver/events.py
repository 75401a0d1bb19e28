"""Driver side: what reaches the driver loop (:func:`mlflow_hvd.driver.supervisor.watch`),
as one closed union, :data:`LoopEvent`: the ranks', the tasks' and the backend's messages
about the job (rank 0's word that a checkpoint is committed among them) and what the driver
notes itself - a rank's
or a Spark task's connection closed, two tasks' layouts that disagree, Horovod elastic
refused, the job's torch.distributed store failed to start, and a message of a kind this
driver does not know (refused: the ranks run another
version of mlflow_hvd).

Every message a peer sends goes through one dispatch (:func:`mlflow_hvd.driver.routing
.message_router`); the loop's own (:func:`mlflow_hvd.driver.supervisor.handle`) matches
every kind of :data:`LoopEvent`, checked exhaustively by the type checker.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow_hvd.driver.rendezvous import ElasticRefused, LayoutMismatch
from mlflow_hvd.protocol.messages import (
    BackendFinished,
    CheckpointCommitted,
    EnvironmentMismatch,
    FeedFailed,
    FeedProgress,
    JobEnded,
    OutputLines,
    RankDisconnected,
    TaskDisconnected,
    WorkerError,
    WorkerExited,
    WorkerResult,
    WorkerStarted,
)


@dataclass(frozen=True)
class UnknownMessage:
    """A peer that holds the job's secret sent a message this driver does not know: its
    rank or task runs another version of mlflow_hvd. The job fails, naming it."""

    kind: str

    def detail(self) -> str:
        return (f"a rank or task sent a message this driver does not know ({self.kind}): "
                "the executors run another version of mlflow_hvd than the driver; install "
                "the driver's version there (or ship the environment: ClusterConfig("
                "ship_environment=True))")


@dataclass(frozen=True)
class TorchStoreFailed:
    """The job's torch.distributed store could not start (``detail`` says why): its ranks
    would wait in ``init_process_group`` for torch's 30 minutes. The job fails at once."""

    detail: str


LoopEvent = (
    WorkerStarted | OutputLines | WorkerResult | WorkerError | WorkerExited | JobEnded
    | BackendFinished | FeedProgress | FeedFailed | EnvironmentMismatch | RankDisconnected
    | TaskDisconnected | LayoutMismatch | ElasticRefused | UnknownMessage | CheckpointCommitted
    | TorchStoreFailed
)

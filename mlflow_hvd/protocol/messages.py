"""Typed values that cross process boundaries: driver -> agent -> worker, and every
message from a worker or Spark task back to the driver.

All are frozen dataclasses of plain values so that they pickle small and compare by value.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from mlflow_hvd.protocol.feed import Agreed, FeedFault
from mlflow_hvd.protocol.records import Record


class Stream(enum.Enum):
    """Where a line of worker output came from."""

    STDOUT = "stdout"
    STDERR = "stderr"
    LOG = "log"  # sent with mlflow_hvd.log_to_driver


@dataclass(frozen=True)
class Bootstrap:
    """What a worker reads from its stdin at start (kept off the command line and env):
    the agent writes it, :mod:`mlflow_hvd.rank.worker` reads it."""

    secret_hex: str
    driver_host: str
    driver_port: int
    payload_path: str
    parent_pid: int
    channel_timeout: float
    pooled: bool  # after a job, ask the driver for the next one (a warm pool)
    idle_timeout: float  # seconds a pooled rank waits for the next job
    shards: str = ""  # the rank's manifest of DataFrame shards (protocol/feed.py), if any
    job_vars: dict[str, str] = field(default_factory=dict)  # the first job's (NextJob.env)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Bootstrap:
        return Bootstrap(**json.loads(text))


@dataclass(frozen=True)
class TrackingTarget:
    """The driver's MLflow run, as workers need it (explicitly: ``mlflow.start_run()`` on
    the driver removes ``MLFLOW_RUN_ID`` from the environment)."""

    tracking_uri: str
    run_id: str
    experiment_id: str
    system_metrics: bool  # TrackingConfig(log_system_metrics)
    tracking_timeout: float  # TrackingConfig(tracking_timeout): rank 0's final delivery
    # What the driver read of the run just before this attempt, so that rank 0 need not ask
    # the server before training (None: unknown, rank 0 asks)
    facts: RunFacts | None = None
    # The run's artifact directory when it is a path on the driver's disk (a local store),
    # which the driver creates so rank 0 can tell whether its host sees it; "" otherwise
    local_artifacts: str = ""
    # Whether the driver hands rank 0 MLflow client settings (credentials): only rank 0
    # can then write, so the other nodes log no system metrics
    authenticated: bool = False
    # The metric whose per-epoch values rank 0 reports to the driver as they are logged
    # (:class:`EpochReport`: a sweep that prunes trials); "" for a job without pruning
    prune_metric: str = ""
    # The driver's Model Registry (``mlflow.get_registry_uri()``): rank 0's registry reads
    registry_uri: str = ""
    # The run as MLflow describes it, so every rank answers reads of it without the server
    run_name: str = ""
    user_id: str = ""
    start_time: int = 0
    artifact_uri: str = ""


@dataclass(frozen=True)
class RunFacts:
    """The run as the driver read it before the job: its params (a param logged again
    must keep its value), its ``mlflow.source.*`` tags (a logged model names the driver's
    program) and whether it has a checkpoint to resume from."""

    params: dict[str, str] = field(default_factory=dict)
    source_tags: dict[str, str] = field(default_factory=dict)
    has_checkpoint: bool = True


@dataclass(frozen=True)
class Code:
    """``main`` and its kwargs, cloudpickled once on the driver (``pickled``), with what
    gives code sent by value its file names and source lines back
    (:mod:`mlflow_hvd.common.code_sources`), so that a worker's traceback shows them instead of
    cloudpickle's anonymous ``<dynamic-code>``."""

    pickled: bytes = field(repr=False)
    code_files: dict[tuple[str, str, int], str] = field(default_factory=dict)
    code_texts: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Payload:
    """What every rank runs for one job: the code, the driver's MLflow run, the attempt."""

    code: Code
    tracking: TrackingTarget | None = None
    attempt: int = 0  # 0 for the first run of the job, k for its k-th restart


@dataclass(frozen=True)
class RankSlot:
    """The position of one rank in the job, as Horovod's host assignment computes it."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


class Request:
    """Base of the messages the driver answers with a message of its own (not just an
    ack); the sender waits for that answer."""


@dataclass(frozen=True)
class LayoutReport(Request):
    """A Spark task reports the layout it computed from the barrier's task addresses, and
    asks whether to start its rank's worker.

    The driver initialises the rendezvous server with the first report (before any rank
    starts, because the task waits for the answer) and checks the others agree. It answers
    :class:`Launch`, or :class:`StartNoWorker` once the job is being stopped: a task the
    driver has not counted never starts a worker. (The local backend sinks the report
    directly; nobody answers it there.)
    """

    partition: int
    slots: tuple[RankSlot, ...]


@dataclass(frozen=True)
class Launch:
    """Driver -> Spark task: start the worker. The task's connection then stays open
    until the task and its worker are both gone (the worker holds a copy of it)."""


@dataclass(frozen=True)
class StartNoWorker:
    """Driver -> Spark task: the job is already being stopped; end without starting the
    worker (the answer to a :class:`LayoutReport` that came too late)."""


@dataclass(frozen=True)
class TaskDisconnected:
    """Driver-internal: the connection of the Spark task that reported ``partition``'s
    layout closed, so neither the task nor its worker is left. The channel emits it."""

    partition: int


@dataclass(frozen=True)
class FromRank:
    """Base of every message about one rank (sent by its worker or its agent)."""

    rank: int


@dataclass(frozen=True)
class TorchStoreWanted(FromRank):
    """Rank -> driver: the rank imported ``torch.distributed``; the job's store (whose port
    every rank has as ``MASTER_PORT``) should serve. Sent once per job by each such rank."""


@dataclass(frozen=True)
class CheckpointCommitted(FromRank):
    """Rank 0 -> driver, once a checkpoint's commit is written into the job's run (its
    files, then the latest-checkpoint tag): the job can resume from ``epoch``. ``last``:
    the training loop said this checkpoint is its last (True), that more epochs follow
    (False), or did not say (None). An elastic job's controller decides on it whether to
    grow back here (:mod:`mlflow_hvd.driver.elastic`)."""

    epoch: int
    last: bool | None = None


@dataclass(frozen=True)
class WorkerStarted(FromRank):
    """The worker process of ``rank`` is running and has reached the driver."""

    host: str


@dataclass(frozen=True)
class OutputLines(FromRank):
    """Lines of a rank's output, in order, each without its newline."""

    stream: Stream
    lines: tuple[str, ...]


@dataclass(frozen=True)
class WorkerResult(FromRank):
    """Rank 0's return value, cloudpickled."""

    payload: bytes


@dataclass(frozen=True)
class WorkerError(FromRank):
    """The user's function raised in ``rank``; sent before the worker exits non-zero."""

    host: str
    error: str
    traceback: str
    timestamp: float


@dataclass(frozen=True)
class WorkerExited(FromRank):
    """The worker process of ``rank`` ended; negative ``exit_code`` is a signal number."""

    host: str
    exit_code: int
    timestamp: float
    stopped: bool = False  # True when the agent ended it because it was asked to stop


@dataclass(frozen=True)
class JobEnded(FromRank):
    """A pooled worker of ``rank`` finished its job and stays up for the next one (not an
    exit: its process lives on); every line it printed during the job was forwarded
    before this."""

    host: str
    timestamp: float


@dataclass(frozen=True)
class RankDisconnected(FromRank):
    """Driver-internal: the connection of a rank's own process closed (the process is
    gone). Not sent by peers; the channel emits it."""


@dataclass(frozen=True)
class UndeliveredTracking:
    """Rank 0 -> driver: tracking records the server did not take before the deadline, in
    order. Artifact records name keys of ``files``, which carry the files' bytes (rank 0's
    disk is not the driver's). The driver saves them for replay."""

    run_id: str
    tracking_uri: str
    host: str
    records: tuple[Record, ...]
    files: tuple[tuple[str, bytes], ...]
    reason: str


@dataclass(frozen=True)
class AskCredentials(Request, FromRank):
    """Rank 0 -> driver, before its job's first MLflow call: the driver's MLflow client
    settings. Answered with a :class:`~mlflow_hvd.protocol.credentials.Sealed` for rank 0 of
    a job whose driver has any, :class:`NoCredentials` otherwise."""


@dataclass(frozen=True)
class NoCredentials:
    """Driver -> rank: the answer to :class:`AskCredentials` when the driver hands this
    rank no MLflow client settings (not rank 0, or the driver has none): it goes on with
    its own environment."""


@dataclass(frozen=True)
class AwaitJob(Request, FromRank):
    """A pooled worker finished its job (Horovod shut down, state cleared) and asks for the
    next one. Answered with :class:`NextJob` or :class:`Retire`."""


@dataclass(frozen=True)
class NextJob:
    """Driver -> pooled worker: run this pickled :class:`Payload` next, with ``env`` set
    while it runs (:func:`mlflow_hvd.common.layout.job_vars`: its torchrun variables, its
    store's port among them)."""

    payload: bytes = field(repr=False)
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Retire:
    """Driver -> pooled worker: the answer to :class:`AwaitJob` when no next job comes
    (the pool closes, or the ranks waited past the idle limit): exit."""


@dataclass(frozen=True)
class Unanswered:
    """Driver -> sender: the request had no handler on this driver, or its handler failed
    (``reason`` says which); the sender treats it as refused."""

    reason: str


@dataclass(frozen=True)
class TrackingWrite(Request):
    """Rank 0 -> driver: write these records (metric, param and tag batches, a checkpoint's
    commit; see :mod:`mlflow_hvd.protocol.records`) into the job's run. The driver makes
    the MLflow call and answers :class:`TrackingWritten` once the store took them, so
    rank 0's process spends no CPU on MLflow's client for them."""

    run_id: str
    records: tuple[Record, ...]


@dataclass(frozen=True)
class TrackingWritten:
    """Driver -> rank 0: the answer to :class:`TrackingWrite`. ``error`` empty: stored;
    else ``outage`` says whether to retry (server unreachable or slow) or not (refused)."""

    error: str = ""
    outage: bool = False


@dataclass(frozen=True)
class EpochReport(Request):
    """Rank 0 -> driver: the job's pruning metric (``TrackingTarget.prune_metric``) was
    logged at ``step`` with ``value``; may training go on? Answered with
    :class:`EpochVerdict`, or :class:`NotJudged` by a driver that does not prune this run
    (rank 0 then trains on)."""

    run_id: str
    key: str
    step: int
    value: float


@dataclass(frozen=True)
class EpochVerdict:
    """Driver -> rank 0: the answer to :class:`EpochReport`. ``prune``: stop training at
    this epoch boundary; ``epoch``: how many epochs the trial has completed (the report's
    rank among its distinct steps); ``reason`` says why, for the log."""

    prune: bool
    epoch: int
    reason: str = ""


@dataclass(frozen=True)
class NotJudged:
    """Driver -> rank 0: the answer to an :class:`EpochReport` that no pruning rule judges
    (the job does not prune, the report names another run, or the judge failed: ``reason``
    says which); training goes on."""

    reason: str


JOB_END_MARK = "\x00mlflow_hvd: job done\x00"
"""A pooled worker prints this line on stdout and stderr after each job's last output; its
agent then reports the job's end for that rank (all output of the job precedes it)."""


@dataclass(frozen=True)
class BackendFinished:
    """The backend (e.g. the Spark barrier job) ended; ``error`` is empty on success."""

    error: str = ""


@dataclass(frozen=True)
class FeedProgress:
    """Spark task -> driver while it writes its partition of the job's DataFrames (at the
    start, every few seconds, and once ``done``): the start deadline counts from the
    latest, so a big or skewed partition is not a start timeout while it progresses."""

    partition: int
    rows: int
    bytes: int
    done: bool = False


@dataclass(frozen=True)
class FeedAgreed:
    """Spark task 0 (or the local backend) -> driver: how the job's DataFrames were split
    over the ranks, once the tasks agreed (before any rank starts)."""

    arguments: tuple[Agreed, ...]


@dataclass(frozen=True)
class FeedFailed:
    """Spark task 0 -> driver: the job's DataFrames cannot be fed (the same verdict on every
    task after their exchange); no rank starts. ``fault`` says which error the driver
    raises: the data's (as is) or a host's (a full disk)."""

    error: str
    fault: FeedFault


@dataclass(frozen=True)
class EnvironmentMismatch:
    """Spark task -> driver: the environment shipped to the executors (``spark.archives``)
    does not match what this task's host has (each item 'what: expected X, found Y'); its
    rank does not start."""

    partition: int
    host: str
    differences: tuple[str, ...]


Message = (
    LayoutReport
    | WorkerStarted
    | OutputLines
    | WorkerResult
    | WorkerError
    | WorkerExited
    | JobEnded
    | BackendFinished
    | FeedProgress
    | FeedAgreed
    | FeedFailed
    | EnvironmentMismatch
)

DriverRequest = LayoutReport | TrackingWrite | EpochReport | AskCredentials | AwaitJob
"""Every :class:`Request` the driver answers (:func:`mlflow_hvd.driver.routing
.request_router` matches each)."""

Sink = Callable[[Message], None]
"""Where a backend or an agent delivers messages: the driver's queue, or the channel."""

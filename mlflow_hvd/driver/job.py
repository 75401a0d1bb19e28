"""Driver side: one job as the driver runs it (:class:`Job`), and the ids and addresses
jobs need. A job runs on a :class:`~mlflow_hvd.driver.generation.Generation` of ranks,
through :class:`~mlflow_hvd.driver.pool.RankPool` (cold: one job per generation; warm:
many)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlflow_hvd.driver.routing import TrackingWriter, UndeliveredHandler
from mlflow_hvd.driver.supervisor import DriverSettings
from mlflow_hvd.protocol.messages import FeedAgreed

if TYPE_CHECKING:
    from mlflow_hvd.driver.elastic import GrowBack
    from mlflow_hvd.driver.feed import Feed


def new_job_id() -> str:
    """A unique id for one run; also its Spark job group."""
    return f"mlflow-hvd-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class Job:
    """One job on the driver: what every rank runs, under which deadlines, and who answers
    what its ranks send (driver-only: never pickled).

    Attributes:
        np: How many ranks run it (an elastic job's attempt may run on fewer than the
            runner's ``np``).
        payload: A pickled :class:`~mlflow_hvd.protocol.messages.Payload`.
        settings: The job's deadlines and output settings; the first job of a generation
            also fixes what its ranks are started with (``JobSpec``).
        description: Human-readable (Spark UI, log).
        job_id: Unique id; also the Spark job group.
        on_tracking_write: Answers rank 0's tracking writes and epoch reports
            (:mod:`mlflow_hvd.driver.tracking.relay`); None for a job that does not track.
        on_undelivered: Keeps the tracking records rank 0 could not deliver.
        feed: The job's DataFrame arguments (:mod:`mlflow_hvd.driver.feed`), fed to a
            generation's ranks when it starts; None: the job has none.
        on_fed: Told how the DataFrames were split over the ranks (records them in the
            job's run), once the generation's tasks agreed.
        attempt: 0 for the job's first run, k for its k-th restart
            (``TORCHELASTIC_RESTART_COUNT``).
        max_restarts: Restarts the job may have (``TORCHELASTIC_MAX_RESTARTS``).
        rank_env: Variables every rank has while the job runs beside torchrun's
            (:func:`mlflow_hvd.common.layout.job_vars`).
        torch_nodes_are_tasks: Each task is a torchrun node of its own (pyspark's
            TorchDistributor's numbering); warm ranks numbered otherwise do not take it.
        grow: The controller of an elastic attempt below ``np`` (its looks for the missing
            slots run while the job runs; the driver loop asks it at each checkpoint whether
            the job ends there to grow back, :mod:`mlflow_hvd.driver.elastic`); None
            otherwise.
    """

    np: int
    payload: bytes = field(repr=False)
    settings: DriverSettings
    description: str = ""
    job_id: str = field(default_factory=new_job_id)
    on_tracking_write: TrackingWriter | None = None
    on_undelivered: UndeliveredHandler | None = None
    feed: Feed | None = None
    on_fed: Callable[[FeedAgreed], None] | None = None
    grow: GrowBack | None = None
    attempt: int = 0
    max_restarts: int = 0
    rank_env: tuple[tuple[str, str], ...] = ()
    torch_nodes_are_tasks: bool = False

    @property
    def feed_key(self) -> tuple[tuple[str, int], ...]:
        """Which DataFrames the job's ranks must have been fed (empty: none)."""
        return self.feed.key if self.feed is not None else ()

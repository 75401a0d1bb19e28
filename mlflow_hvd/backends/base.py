"""The small interface every launch backend implements (driver side). The job description
it gets, :class:`~mlflow_hvd.protocol.job.JobSpec`, is part of the shared protocol."""

from __future__ import annotations

from typing import Any, Protocol

from mlflow_hvd.protocol.job import JobSpec
from mlflow_hvd.protocol.messages import Sink

__all__ = ["Backend", "FrameSource", "JobSpec", "Placement"]


class Backend(Protocol):
    """Starts the ranks of a job somewhere and stops them on request.

    The driver never branches on the backend's type: everything it learns arrives as messages
    through ``sink`` (including the rank layout, as a ``LayoutReport``, before any worker
    starts).
    """

    name: str

    def start(self, job: JobSpec, sink: Sink) -> None:
        """Launch the job without waiting for it; raise ConfigurationError if it cannot run."""

    def stop(self) -> None:
        """Ask every rank to stop; returns at once. Idempotent."""

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the backend to wind down; True if it has."""

    def close(self) -> None:
        """Stop, wait a bounded time, and release every resource. Idempotent."""

    def describe(self) -> dict[str, str]:
        """Facts for tags and messages, e.g. ``{"backend": "spark", "spark_master": ...}``."""


class FrameSource(Protocol):
    """A job's DataFrame arguments, as a placement feeds them to a new generation
    (:class:`mlflow_hvd.driver.feed.Feed`)."""

    def check_session(self, spark: Any) -> None:
        """Refuse DataFrames of another SparkSession than ``spark``."""

    def fed_frame(self, np: int) -> Any:
        """The one DataFrame of ``np`` partitions the tasks write for their ranks."""


class Placement(Protocol):
    """Where a runner's jobs run, asked before any job starts: processes on the driver
    (``np < 0``, :class:`~mlflow_hvd.backends.local.LocalPlacement`) or a Spark barrier
    stage (``np > 0``, :class:`~mlflow_hvd.backends.spark.placement.SparkPlacement`). The
    runner holds one and never branches on the sign of ``np``."""

    def new_run(self) -> None:
        """A new ``run`` begins: forget what the last one chose (Spark's master)."""

    def prepare(self) -> None:
        """Start what jobs need ahead of them (Spark's JVM); returns at once."""

    def describe(self) -> dict[str, str]:
        """Facts for the run's tags, without starting anything."""

    def task_slots(self) -> tuple[int, str]:
        """How many tasks can run at once, and where (for messages)."""

    def elastic_size(self, least: int) -> int:
        """How many ranks an attempt of an elastic job (``JobConfig(min_np=least)``) runs
        on: the runner's ``np`` once there are as many slots, else as many as there are
        after a bounded wait, if at least ``least``; raises ``InsufficientSlotsError``
        otherwise."""

    def slots_back(self, running: int) -> bool:
        """Whether the runner's ``np`` slots are there now, ``running`` of them taken by the
        job that asks (an elastic job running below ``np``)."""

    def backend(self, feed: FrameSource | None, np: int) -> tuple[Backend, str]:
        """A backend for a new generation of ``np`` ranks (fed ``feed``'s DataFrames, if
        any, split into ``np`` shards), and the driver's address as its ranks reach it."""

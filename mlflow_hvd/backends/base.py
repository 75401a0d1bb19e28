"""The small interface every launch backend implements (driver side). The job description
it gets, :class:`~mlflow_hvd.protocol.job.JobSpec`, is part of the shared protocol."""

from __future__ import annotations

from typing import Protocol

from mlflow_hvd.protocol.job import JobSpec
from mlflow_hvd.protocol.messages import Sink

__all__ = ["Backend", "JobSpec"]


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

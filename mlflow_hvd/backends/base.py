"""The small interface every launch backend implements, and the job description it gets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from mlflow_hvd.messages import Sink


@dataclass(frozen=True)
class JobSpec:
    """One distributed run, as the driver hands it to a backend (and a backend to its
    Spark tasks: the same object travels in the barrier task's closure).

    Attributes:
        np: Number of ranks (positive).
        payload: A pickled :class:`~mlflow_hvd.messages.Payload`.
        secret: Per-run HMAC secret; excluded from ``repr`` so it never lands in a log.
        driver_host: Address workers use to reach the driver's channel and rendezvous.
        channel_port: Port of the driver's authenticated channel.
        rendezvous_port: Port of horovod's Gloo rendezvous server.
        job_id: Unique id; also the Spark job group.
        description: Human-readable description (Spark UI).
        channel_timeout: Deadline of each worker-to-driver send, in seconds.
        max_line_bytes: Output lines longer than this are truncated with a marker.
        stop_grace: Seconds between SIGTERM and SIGKILL when stopping a worker.
        gloo_iface: Network interface for Gloo; None picks the one that routes to the driver.
        pooled: Workers stay up after the job and ask the driver for the next one
            (:mod:`mlflow_hvd.driver.pool`).
    """

    np: int
    payload: bytes = field(repr=False)
    secret: bytes = field(repr=False)
    driver_host: str
    channel_port: int
    rendezvous_port: int
    job_id: str
    description: str
    channel_timeout: float = 60.0
    max_line_bytes: int = 16384
    stop_grace: float = 5.0
    gloo_iface: str | None = None
    pooled: bool = False


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

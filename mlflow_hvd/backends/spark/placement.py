"""``np > 0``: where a runner's jobs run on Spark — the session given to the runner, or the
one it chooses and boots (:class:`~.boot.SessionBoot`) — and a :class:`~.backend.SparkBackend`
on it for each new generation of ranks."""

from __future__ import annotations

import threading
from typing import Any

from mlflow_hvd.backends.base import Backend, FrameSource
from mlflow_hvd.backends.spark.api import session_api
from mlflow_hvd.backends.spark.backend import SparkBackend, session_facts
from mlflow_hvd.backends.spark.boot import SessionBoot
from mlflow_hvd.backends.spark.session import elastic_slots, session_slots, slots_back
from mlflow_hvd.common.config import ClusterConfig, JobConfig
from mlflow_hvd.common.network import resolve_host


class SparkPlacement:
    """One barrier stage of ``np`` tasks per generation, on ``spark`` (None: the session
    the runner's options choose: the active one, the configured master's, else an embedded
    ``local[max(np, cores)]``)."""

    def __init__(self, np: int, spark: Any, job: JobConfig, cluster: ClusterConfig,
                 stop: threading.Event | None = None) -> None:
        self.np, self.spark, self.job, self.cluster = np, spark, job, cluster
        self.stop = stop  # the runner's stop request, for the backend's waits
        self._boot = SessionBoot(np, cluster, job.slot_timeout, stop)

    def new_run(self) -> None:
        self._boot.new_run()  # the master is resolved once per run

    def prepare(self) -> None:
        if self.spark is None:
            self._boot.start()

    def session(self) -> Any:
        """The session jobs run on (the one booting waited for, up to ``start_timeout``)."""
        if self.spark is not None:
            return self.spark
        return self._boot.session(self.job.start_timeout)

    def describe(self) -> dict[str, str]:
        if self.spark is not None:
            return session_facts(session_api(self.spark))
        return {"backend": SparkBackend.name, "spark_master": self._boot.choice()[1]}

    def task_slots(self) -> tuple[int, str]:
        count, master = session_slots(self.session(), self.np, self.job.slot_timeout)
        return count, f"the Spark cluster (master {master})"

    def elastic_size(self, least: int) -> int:
        return elastic_slots(session_api(self.session()), self.np, least,
                             self.job.slot_timeout, self.stop)

    def slots_back(self, running: int) -> bool:
        return slots_back(session_api(self.session()), self.np, running)

    def backend(self, feed: FrameSource | None, np: int) -> tuple[Backend, str]:
        spark = self.session()
        frame = None
        if feed is not None:
            feed.check_session(spark)
            frame = feed.fed_frame(np)
        backend = SparkBackend(spark, self.job, self.cluster, frame, self.stop)
        return backend, resolve_host(session_api(spark).driver_host())

"""Driver side of the Spark backend: submit, watch and cancel the barrier stage."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from mlflow_hvd.agent.spark_task import RESULT_SCHEMA, barrier_task
from mlflow_hvd.backends.spark.environment import prepare_executors
from mlflow_hvd.backends.spark.failures import summarize_spark_error
from mlflow_hvd.backends.spark.session import (
    check_barrier_supported,
    check_executor_env,
    shipped_environment,
    wait_for_slots,
)
from mlflow_hvd.protocol.job import JobSpec
from mlflow_hvd.protocol.messages import BackendFinished, Sink


class SparkBackend:
    """Submits ``frame.mapInArrow(task, barrier=True)`` under a job group, over a DataFrame
    of exactly ``np`` partitions: ``spark.range(np)`` for a job without data (one row per
    task), else the job's DataFrames projected into one (``frame``, from
    :mod:`mlflow_hvd.driver.feed`), whose partitions the tasks write locally for their
    ranks (as ``JobSpec.feed`` says). The DataFrame API's barrier
    stage is the one Spark Connect sessions have too.

    ``stop`` cancels the job group; Spark then kills the tasks' Python workers, whose own
    worker processes die with them (parent-death signal).
    """

    name = "spark"

    def __init__(self, spark: Any, slot_timeout: float = 30.0, frame: Any = None,
                 environment_timeout: float = 600.0) -> None:
        self._spark = spark
        self._frame = frame  # the job's data, in exactly np partitions (None: no data)
        self._sc = spark.sparkContext
        self._slot_timeout = slot_timeout
        self._environment_timeout = environment_timeout
        self._thread: threading.Thread | None = None
        self._job_id: str | None = None

    def start(self, job: JobSpec, sink: Sink) -> None:
        check_barrier_supported(self._sc.getConf())
        check_executor_env(self._sc.getConf())
        slots = wait_for_slots(self._sc, job.np, self._slot_timeout)
        self._job_id = job.job_id
        # an environment shipped with the session: unpacked on every executor first (not
        # against the start deadline), and every task checks it fits its host
        environment = shipped_environment(self._sc.getConf())
        if environment is not None:
            prepare_executors(self._sc, environment, slots, self._environment_timeout)
        job = dataclasses.replace(job, environment=environment)
        self._thread = threading.Thread(
            target=self._submit,
            args=(job, sink),
            name=f"mlflow-hvd-spark-{job.job_id}",
            daemon=True,
        )
        self._thread.start()

    def _submit(self, job: JobSpec, sink: Sink) -> None:
        try:
            # Job group properties are thread-local: set them in the submitting thread.
            self._sc.setJobGroup(job.job_id, job.description, interruptOnCancel=True)
            frame = (self._frame if self._frame is not None
                     else self._spark.range(0, job.np, 1, job.np))
            frame.mapInArrow(barrier_task(job), RESULT_SCHEMA, barrier=True).collect()
        except Exception as exc:
            sink(BackendFinished(error=summarize_spark_error(exc, job.environment)))
        else:
            sink(BackendFinished())

    def stop(self) -> None:
        if self._job_id is not None:
            self._sc.cancelJobGroup(self._job_id)

    def wait(self, timeout: float) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        # After a clean finish the tasks return right after their last report: let the job
        # succeed instead of cancelling it, so the Spark UI tells the truth.
        if not self.wait(10.0):
            self.stop()
            self.wait(60.0)

    def describe(self) -> dict[str, str]:
        return {"backend": self.name, "spark_master": str(self._sc.master)}

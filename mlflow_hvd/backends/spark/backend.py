"""Driver side of the Spark backend: submit, watch and cancel the barrier stage."""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any

from mlflow_hvd.agent.spark_task import RESULT_SCHEMA, barrier_task
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

    def __init__(self, spark: Any, slot_timeout: float = 30.0, frame: Any = None) -> None:
        self._spark = spark
        self._frame = frame  # the job's data, in exactly np partitions (None: no data)
        self._sc = spark.sparkContext
        self._slot_timeout = slot_timeout
        self._thread: threading.Thread | None = None
        self._job_id: str | None = None

    def start(self, job: JobSpec, sink: Sink) -> None:
        check_barrier_supported(self._sc.getConf())
        check_executor_env(self._sc.getConf())
        wait_for_slots(self._sc, job.np, self._slot_timeout)
        self._job_id = job.job_id
        # an environment shipped with the session: every task checks it fits its host
        job = dataclasses.replace(job, environment=shipped_environment(self._sc.getConf()))
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
            sink(BackendFinished(error=summarize_spark_error(exc)))
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


def summarize_spark_error(exc: BaseException) -> str:
    """The useful line of a Spark job failure: the Python error raised in the task if any.

    A failing task surfaces on the driver as a Py4JJavaError whose first line only says
    ``An error occurred while calling ...collectAndServe``; the task's own Python error is a
    line like ``ValueError: ...`` inside the embedded traceback.
    """
    text = str(exc)
    python_errors = [
        line.strip()
        for line in text.splitlines()
        if re.match(r"^\s*[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:", line)
        and not line.strip().startswith(("at ", "org.apache", "py4j", "java."))
    ]
    if python_errors:
        return python_errors[-1]
    for line in text.splitlines():  # why Spark gave up, e.g. a lost executor or worker
        at = line.find("Job aborted due to stage failure:")
        if at >= 0:
            return line[at:].strip()[:1000]
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}"

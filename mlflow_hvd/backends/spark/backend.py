"""Driver side of the Spark backend: submit, watch and cancel the barrier stage."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from mlflow_hvd.agent.spark_task import RESULT_SCHEMA, barrier_partition_task, barrier_task
from mlflow_hvd.backends.spark.api import SessionApi, session_api
from mlflow_hvd.backends.spark.boot import archive_of
from mlflow_hvd.backends.spark.environment import prepare_executors, ship_to_connect
from mlflow_hvd.backends.spark.failures import summarize_spark_error, task_raised
from mlflow_hvd.backends.spark.session import (
    check_barrier_supported,
    check_executor_env,
    shipped_environment,
    stopped_message,
    wait_for_slots,
)
from mlflow_hvd.common.config import ClusterConfig, JobConfig
from mlflow_hvd.errors import ChannelError
from mlflow_hvd.protocol.job import JobSpec
from mlflow_hvd.protocol.messages import BackendFinished, Sink


class SparkBackend:
    """Submits one barrier stage of ``np`` tasks under the job's id (a job group on a
    classic session, an operation tag on a Spark Connect one; :mod:`.api`). A job with data
    runs ``frame.mapInArrow(task, barrier=True)`` over its DataFrames projected into one of
    exactly ``np`` partitions (``frame``, from :mod:`mlflow_hvd.driver.feed`), whose
    partitions the tasks write locally for their ranks (as ``JobSpec.feed`` says). A job
    without data runs the same task as an RDD barrier stage over ``range(np)`` on a classic
    session (on a new JVM its tasks start sooner than through the DataFrame API:
    docs/benchmarks.md), over ``spark.range(np)`` on a Connect one.

    ``stop`` cancels the job group (interrupts the tag); Spark then kills the tasks' Python
    workers, whose own worker processes die with them (parent-death signal).
    """

    name = "spark"

    def __init__(self, spark: Any, job: JobConfig, cluster: ClusterConfig,
                 frame: Any = None, stop: threading.Event | None = None) -> None:
        self._spark = spark
        self._frame = frame  # the job's data, in exactly np partitions (None: no data)
        self._api = session_api(spark)
        self._slot_timeout = job.slot_timeout
        self._environment_timeout = cluster.environment_timeout
        self._ship = cluster.ship_environment  # a Connect session is given it here
        self._thread: threading.Thread | None = None
        self._job_id: str | None = None
        # the runner's stop request: the waits before the stage (slots, the environment
        # unpacked on the executors) end on it
        self._stop = stop

    def start(self, job: JobSpec, sink: Sink) -> None:
        conf = self._api.conf()
        check_barrier_supported(conf)
        check_executor_env(conf)
        slots = wait_for_slots(self._api, job.np, self._slot_timeout, self._stop)
        self._job_id = job.job_id
        # an environment shipped with the session (to a Connect one: now): unpacked on
        # every executor first (not against the start deadline), and every task checks it
        # fits its host
        if self._api.ships_with_jobs and self._ship is not False:
            environment = ship_to_connect(self._api, archive_of(self._ship),
                                          self._environment_timeout, self._stop)
        else:
            environment = shipped_environment(conf)
        if environment is not None:
            prepare_executors(self._api, environment, slots, self._environment_timeout,
                              self._stop)
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
            # job groups and tags are thread-local: set in the submitting thread
            with self._api.tagged(job.job_id, job.description):
                self._api.run_barrier(job.np, self._frame, barrier_partition_task(job),
                                      barrier_task(job), RESULT_SCHEMA)
        except Exception as exc:
            error = stopped_message(self._api, "ran its barrier stage") or summarize_spark_error(
                exc, job.environment, connect=self._api.remote,
                removed=self._api.removed_executors())
            if task_raised(exc, ChannelError):
                error += self._api.unreachable_hint(job.driver_host)
            sink(BackendFinished(error=error))
        else:
            sink(BackendFinished())

    def stop(self) -> None:
        if self._job_id is not None:
            self._api.cancel(self._job_id)

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
        return session_facts(self._api)


def session_facts(api: SessionApi) -> dict[str, str]:
    """A Spark backend's facts for tags and messages: its master, and a Connect session's
    server."""
    return {"backend": SparkBackend.name, **api.facts()}

"""The one place that decides what happens after a job fails: run it again, restart it as
a new attempt, or give up.

Two cases, one policy:

* the job never ran: warm ranks died after taking it but before starting it (a rank killed
  while idle); it runs again on new ranks, once, without counting as a failed attempt;
* it ran and failed (a rank raised, exited or was killed, or the backend failed): it is
  restarted whole, up to ``HorovodRunner(job=JobConfig(max_failures=N))`` times, each a new
  attempt in the same MLflow run.

An elastic job's planned restarts (growing back, :mod:`mlflow_hvd.driver.elastic`) are new
attempts too, and no failures.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mlflow_hvd.errors import BackendError, JobNotStartedError, WorkerFailedError

RERUNS_PER_ATTEMPT = 1  # a job that never ran is run again at most this often


class Decision(enum.Enum):
    RERUN = "rerun"  # the job never ran: again, on new ranks, the same attempt
    RESTART = "restart"  # a new attempt
    GIVE_UP = "give up"  # raise


@dataclass(frozen=True)
class RetryPolicy:
    """``max_failures`` restarts of a failed job
    (``HorovodRunner(job=JobConfig(max_failures=...))``)."""

    max_failures: int

    def decide(self, error: BaseException, failed: int, reruns: int) -> Decision:
        """What to do after ``error`` ended an attempt, when ``failed`` attempts failed
        before it (planned restarts of an elastic job are no failures), and it was already
        run again ``reruns`` times because it never started."""
        if isinstance(error, JobNotStartedError) and reruns < RERUNS_PER_ATTEMPT:
            return Decision.RERUN
        if isinstance(error, WorkerFailedError | BackendError) and failed < self.max_failures:
            return Decision.RESTART
        return Decision.GIVE_UP

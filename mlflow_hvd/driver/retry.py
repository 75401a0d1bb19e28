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
from dataclasses import dataclass, field
from typing import assert_never

from mlflow_hvd.errors import BackendError, JobNotStartedError, WorkerFailedError

RERUNS_PER_ATTEMPT = 1  # a job that never ran is run again at most this often


class Decision(enum.Enum):
    """What follows an attempt that did not return a value."""

    RERUN = "rerun"  # the job never ran: again, on new ranks, the same attempt
    RESTART = "restart"  # it failed: a new attempt
    GROW = "grow back"  # its missing slots are back: a new attempt on np ranks, no failure
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


@dataclass
class Attempts:
    """Where one ``run``'s attempts stand, moved only by :meth:`failed` and :meth:`grew`
    (the one place their counters change).

    Attributes:
        attempt: The attempt that runs next (0: the first).
        reruns: How often this attempt was run again because it never started.
        failures: The errors of the attempts that failed, in order.
    """

    policy: RetryPolicy
    attempt: int = 0
    reruns: int = 0
    failures: list[BaseException] = field(default_factory=list)

    @property
    def starting(self) -> bool:
        """The next run starts a new attempt (not one that never started, run again)."""
        return self.reruns == 0

    def failed(self, error: BaseException) -> Decision:
        """The attempt ended with ``error``: the policy's decision, applied."""
        decision = self.policy.decide(error, len(self.failures), self.reruns)
        match decision:
            case Decision.RERUN:
                self.reruns += 1
            case Decision.RESTART:
                self.failures.append(error)
                self.attempt, self.reruns = self.attempt + 1, 0
            case Decision.GIVE_UP:
                self.failures.append(error)
            case Decision.GROW:  # never decided for an error
                raise AssertionError(decision)
            case _ as unknown:
                assert_never(unknown)
        return decision

    def grew(self) -> Decision:
        """The attempt ended for a planned restart on more ranks: the next attempt, no
        failure."""
        self.attempt, self.reruns = self.attempt + 1, 0
        return Decision.GROW

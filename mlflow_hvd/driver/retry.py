"""The one place that decides what happens after an attempt fails: run it again, restart it
as a new attempt, or give up - on what failed (:class:`FailureKind`, named where the driver
observed it), never on an exception's class.

An attempt ends with a value (:data:`~mlflow_hvd.driver.pool.AttemptEnd`, the shape of
torch elastic's ``RunResult``): rank 0's value, a planned restart on more ranks (growing back,
:mod:`mlflow_hvd.driver.elastic`), or :class:`Failed`, its kind and the error ``run`` raises
if it gives up. :data:`RETRIED` is the table:

* a job that never ran (warm ranks died after taking it, before starting it) runs again on
  new ranks, once, without counting as a failed attempt;
* a rank, host or executor lost, before or during the run (a rank that raised, exited or
  was killed, a Spark stage that failed, ranks that did not start or a run that hung past
  its timeout) is restarted whole, up to ``HorovodRunner(job=JobConfig(max_failures=N))``
  times, each a new attempt in the same MLflow run;
* what would fail again the same way is not retried, and the log says why: the executors
  run another version of mlflow_hvd or disagree on the layout, input or an environment
  refused by name, a start phase past its deadline, fewer slots than ``min_np``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import assert_never

from mlflow_hvd.errors import MlflowHvdError

RERUNS_PER_ATTEMPT = 1  # a job that never ran is run again at most this often


class FailureKind(enum.Enum):
    """What ended an attempt, as the driver saw it."""

    RANK = "a rank failed"  # raised, exited non-zero, was killed or lost with its host
    BACKEND = "the backend failed"  # the Spark stage failed (an executor lost, a task killed)
    START_TIMEOUT = "ranks did not start in time"  # a lost executor, slots taken meanwhile
    RUN_TIMEOUT = "the job ran past its timeout"  # a hang: a host gone dark mid-collective
    NOT_STARTED = "warm ranks died before starting it"
    MISMATCH = "the executors run another version of mlflow_hvd or disagree on the layout"
    REFUSED = "input, an environment or the configuration was refused by name"
    PHASE_TIMEOUT = "a start phase passed its deadline"
    NO_SLOTS = "Spark offers fewer slots than the job needs"


# kind -> retried (a new attempt while max_failures allows), or why not
RETRIED: dict[FailureKind, bool | str] = {
    FailureKind.RANK: True,
    FailureKind.BACKEND: True,
    FailureKind.START_TIMEOUT: True,
    FailureKind.RUN_TIMEOUT: True,
    FailureKind.NOT_STARTED: True,  # first run again as the same attempt (RERUN)
    FailureKind.MISMATCH: "another attempt meets the same executors",
    FailureKind.REFUSED: "another attempt gets the same input",
    FailureKind.PHASE_TIMEOUT: "another attempt waits as long (raise the phase's deadline)",
    FailureKind.NO_SLOTS: "another attempt finds the same slots",
}


@dataclass(frozen=True)
class Failed:
    """How an attempt failed: its kind, and the error ``run`` raises if it gives up."""

    kind: FailureKind
    error: MlflowHvdError


class Decision(enum.Enum):
    """What follows an attempt that did not return a value."""

    RERUN = "rerun"  # the job never ran: again, on new ranks, the same attempt
    RESTART = "restart"  # it failed: a new attempt
    GROW = "grow back"  # its missing slots are back: a new attempt on np ranks, no failure
    GIVE_UP = "give up"  # raise


@dataclass(frozen=True)
class RetryPolicy:
    """``max_failures`` restarts of a failed job
    (``HorovodRunner(job=JobConfig(max_failures=...))``), for the kinds :data:`RETRIED`
    says."""

    max_failures: int

    def decide(self, failure: Failed, failed: int, reruns: int) -> Decision:
        """What to do after ``failure`` ended an attempt, when ``failed`` attempts failed
        before it (planned restarts of an elastic job are no failures), and it was already
        run again ``reruns`` times because it never started."""
        if failure.kind is FailureKind.NOT_STARTED and reruns < RERUNS_PER_ATTEMPT:
            return Decision.RERUN
        if RETRIED[failure.kind] is True and failed < self.max_failures:
            return Decision.RESTART
        return Decision.GIVE_UP

    def why_not(self, failure: Failed, failed: int) -> str:
        """Why a failure the policy gave up on was not retried (for the log)."""
        reason = RETRIED[failure.kind]
        if reason is not True:
            return f"not retried: {failure.kind.value}, and {reason}"
        return f"{failed} of max_failures={self.max_failures} attempts failed"


@dataclass
class Attempts:
    """Where one ``run``'s attempts stand, moved only by :meth:`failed` and :meth:`grew`
    (the one place their counters change).

    Attributes:
        attempt: The attempt that runs next (0: the first).
        reruns: How often this attempt was run again because it never started.
        failures: The failures of the attempts that failed, in order.
    """

    policy: RetryPolicy
    attempt: int = 0
    reruns: int = 0
    failures: list[Failed] = field(default_factory=list)

    @property
    def starting(self) -> bool:
        """The next run starts a new attempt (not one that never started, run again)."""
        return self.reruns == 0

    def failed(self, failure: Failed) -> Decision:
        """The attempt ended with ``failure``: the policy's decision, applied."""
        decision = self.policy.decide(failure, len(self.failures), self.reruns)
        match decision:
            case Decision.RERUN:
                self.reruns += 1
            case Decision.RESTART:
                self.failures.append(failure)
                self.attempt, self.reruns = self.attempt + 1, 0
            case Decision.GIVE_UP:
                self.failures.append(failure)
            case Decision.GROW:  # never decided for a failure
                raise AssertionError(decision)
            case _ as unknown:
                assert_never(unknown)
        return decision

    def grew(self) -> Decision:
        """The attempt ended for a planned restart on more ranks: the next attempt, no
        failure."""
        self.attempt, self.reruns = self.attempt + 1, 0
        return Decision.GROW

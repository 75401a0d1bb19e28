"""The retry policy (:mod:`mlflow_hvd.driver.retry`): what follows a failed attempt, decided
on the failure's kind."""

from __future__ import annotations

from mlflow_hvd.driver.retry import RETRIED, Attempts, Decision, Failed, FailureKind, RetryPolicy
from mlflow_hvd.errors import (
    BackendError,
    ConfigurationError,
    JobNotStartedError,
    RankFailure,
    StartTimeoutError,
    WorkerFailedError,
)


def _failure(rank: int, code: int | None) -> RankFailure:
    return RankFailure(rank, f"host{rank}", code, "", "", (), 1.0)


def crashed(rank: int = 1, code: int = 1) -> Failed:
    return Failed(FailureKind.RANK, WorkerFailedError(_failure(rank, code)))


NEVER_RAN = Failed(FailureKind.NOT_STARTED, JobNotStartedError("died before starting it"))


def test_the_policy_reruns_a_job_that_never_ran_once_and_restarts_up_to_the_limit() -> None:
    """``failed``: the attempts that failed before (an elastic job's planned restarts are
    none)."""
    policy = RetryPolicy(max_failures=1)
    assert policy.decide(NEVER_RAN, failed=0, reruns=0) is Decision.RERUN
    assert policy.decide(NEVER_RAN, failed=0, reruns=1) is Decision.RESTART  # rerun used
    assert policy.decide(NEVER_RAN, failed=1, reruns=1) is Decision.GIVE_UP
    assert policy.decide(crashed(), failed=0, reruns=0) is Decision.RESTART
    assert policy.decide(crashed(), failed=1, reruns=0) is Decision.GIVE_UP
    assert RetryPolicy(max_failures=0).decide(crashed(), failed=0, reruns=0) is Decision.GIVE_UP
    assert RetryPolicy(max_failures=0).decide(NEVER_RAN, failed=0, reruns=0) is Decision.RERUN


def test_what_is_lost_is_retried_and_what_would_fail_again_is_not_whatever_its_class() -> None:
    """A rank, host or executor lost before or during the run (including ranks that did not
    start and a run that hung past its timeout) is retried; a version or layout mismatch,
    input refused by name, a start phase past its deadline and too few slots are not, with
    the reason. The exception's class does not matter: a start phase's timeout is a
    BackendError, and is not retried."""
    policy = RetryPolicy(max_failures=3)
    retried = {FailureKind.RANK, FailureKind.BACKEND, FailureKind.START_TIMEOUT,
               FailureKind.RUN_TIMEOUT, FailureKind.NOT_STARTED}
    assert {kind for kind, verdict in RETRIED.items() if verdict is True} == retried
    assert set(RETRIED) == set(FailureKind)
    for kind in FailureKind:
        failure = Failed(kind, BackendError("x"))
        decision = policy.decide(failure, failed=0, reruns=1)
        assert decision is (Decision.RESTART if kind in retried else Decision.GIVE_UP), kind
    started_late = Failed(FailureKind.START_TIMEOUT, StartTimeoutError("1 of 2 ranks started"))
    assert policy.decide(started_late, failed=0, reruns=0) is Decision.RESTART
    phase = Failed(FailureKind.PHASE_TIMEOUT, BackendError("booting Spark took too long"))
    assert policy.decide(phase, failed=0, reruns=0) is Decision.GIVE_UP
    assert policy.why_not(phase, 0) == (
        "not retried: a start phase passed its deadline, and another attempt waits as long "
        "(raise the phase's deadline)")
    mismatch = Failed(FailureKind.MISMATCH, BackendError("another version"))
    assert policy.why_not(mismatch, 0).startswith(
        "not retried: the executors run another version of mlflow_hvd or disagree on the "
        "layout")
    refused = Failed(FailureKind.REFUSED, ConfigurationError("bad input"))
    assert policy.decide(refused, failed=0, reruns=0) is Decision.GIVE_UP
    assert policy.why_not(crashed(), 3) == "3 of max_failures=3 attempts failed"


def test_a_runs_attempts_move_only_through_failures_and_planned_growth() -> None:
    """The counters of one run's attempts (:class:`Attempts`): a job that never ran is run
    again as the same attempt; a failure is counted and starts the next; growing back starts
    the next without counting; the policy's limit then gives up, keeping every failure."""
    state = Attempts(RetryPolicy(max_failures=1))
    assert (state.attempt, state.starting, state.failures) == (0, True, [])
    assert state.failed(NEVER_RAN) is Decision.RERUN
    assert (state.attempt, state.reruns, state.starting) == (0, 1, False)
    assert state.grew() is Decision.GROW
    assert (state.attempt, state.reruns, state.failures) == (1, 0, [])
    first = crashed()
    assert state.failed(first) is Decision.RESTART
    assert (state.attempt, state.starting, state.failures) == (2, True, [first])
    second = crashed(0, 137)
    assert state.failed(second) is Decision.GIVE_UP
    assert (state.attempt, state.failures) == (2, [first, second])

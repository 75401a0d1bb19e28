"""The retry policy (:mod:`mlflow_hvd.driver.retry`): what follows a failed attempt."""

from __future__ import annotations

from mlflow_hvd.errors import RankFailure, WorkerFailedError


def _failure(rank: int, code: int | None) -> RankFailure:
    return RankFailure(rank, f"host{rank}", code, "", "", (), 1.0)


def test_the_retry_policy_reruns_a_job_that_never_ran_once_and_restarts_up_to_the_limit() -> None:
    """``failed``: the attempts that failed before (an elastic job's planned restarts are
    none)."""
    from mlflow_hvd.driver.retry import Decision, RetryPolicy
    from mlflow_hvd.errors import BackendError, ConfigurationError, JobNotStartedError

    crashed = WorkerFailedError(_failure(1, 1))
    never_ran = JobNotStartedError("ranks died before starting it")
    policy = RetryPolicy(max_failures=1)
    assert policy.decide(never_ran, failed=0, reruns=0) is Decision.RERUN
    assert policy.decide(never_ran, failed=0, reruns=1) is Decision.RESTART  # rerun used
    assert policy.decide(never_ran, failed=1, reruns=1) is Decision.GIVE_UP
    assert policy.decide(crashed, failed=0, reruns=0) is Decision.RESTART
    assert policy.decide(BackendError("stage failed"), failed=0, reruns=0) is Decision.RESTART
    assert policy.decide(crashed, failed=1, reruns=0) is Decision.GIVE_UP
    assert policy.decide(ConfigurationError("bad"), failed=0, reruns=0) is Decision.GIVE_UP
    assert RetryPolicy(max_failures=0).decide(crashed, failed=0, reruns=0) is Decision.GIVE_UP
    assert RetryPolicy(max_failures=0).decide(never_ran, failed=0, reruns=0) is Decision.RERUN


def test_a_runs_attempts_move_only_through_failures_and_planned_growth() -> None:
    """The counters of one run's attempts (:class:`Attempts`): a job that never ran is run
    again as the same attempt; a failure is counted and starts the next; growing back starts
    the next without counting; the policy's limit then gives up, keeping every failure."""
    from mlflow_hvd.driver.retry import Attempts, Decision, RetryPolicy
    from mlflow_hvd.errors import JobNotStartedError

    state = Attempts(RetryPolicy(max_failures=1))
    assert (state.attempt, state.starting, state.failures) == (0, True, [])
    never_ran = JobNotStartedError("ranks died before starting it")
    assert state.failed(never_ran) is Decision.RERUN
    assert (state.attempt, state.reruns, state.starting) == (0, 1, False)
    assert state.grew() is Decision.GROW
    assert (state.attempt, state.reruns, state.failures) == (1, 0, [])
    first = WorkerFailedError(_failure(1, 1))
    assert state.failed(first) is Decision.RESTART
    assert (state.attempt, state.starting, state.failures) == (2, True, [first])
    second = WorkerFailedError(_failure(0, 137))
    assert state.failed(second) is Decision.GIVE_UP
    assert (state.attempt, state.failures) == (2, [first, second])

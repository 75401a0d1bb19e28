"""The exception hierarchy: pickling and the messages users read."""

from __future__ import annotations

import pickle

import pytest

from mlflow_hvd import errors
from mlflow_hvd.errors import LIFECYCLE_HINT, RankFailure, WorkerFailedError


def _failure(rank: int, code: int | None, tb: str = "", tail: tuple[str, ...] = ()) -> RankFailure:
    return RankFailure(rank, f"host{rank}", code, "ValueError: boom" if tb else "", tb, tail, 1.0)


def _exceptions() -> list[type[BaseException]]:
    """Every exception class :mod:`mlflow_hvd.errors` defines, found by walking it."""
    return [v for v in vars(errors).values() if isinstance(v, type)
            and issubclass(v, BaseException) and v.__module__ == errors.__name__]


def _example(cls: type[BaseException]) -> BaseException:
    if cls is errors.RetriesExhaustedError:
        return cls([errors.BackendError("lost"), ValueError("boom")])
    if cls is WorkerFailedError:
        return cls(_failure(1, 1, tb="tb"))
    return cls(f"a {cls.__name__}")


def test_every_error_is_a_mlflow_hvd_error_and_pickles() -> None:
    found = _exceptions()
    assert len(found) >= 16  # the walk found the hierarchy, not an empty module
    for cls in found:
        exc = _example(cls)
        # Terminated and JobStopped are KeyboardInterrupts: they unwind the driver as Ctrl-C
        assert isinstance(exc, errors.MlflowHvdError) or cls in (errors.Terminated,
                                                                 errors.JobStopped), cls
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc), cls
    assert isinstance(errors.ConfigurationError("x"), ValueError)
    assert isinstance(errors.StartTimeoutError("x"), TimeoutError)
    assert isinstance(errors.IncompatibleImportError("x"), ImportError)
    assert isinstance(errors.Terminated("x"), KeyboardInterrupt)
    assert isinstance(errors.JobStopped("x"), KeyboardInterrupt)


def test_retries_exhausted_lists_every_attempt() -> None:
    exc = errors.RetriesExhaustedError([errors.BackendError("executor lost"), ValueError("boom")])
    assert str(exc) == (
        "the job failed on all 2 attempts:\n"
        "attempt 0: BackendError: executor lost\n"
        "attempt 1: ValueError: boom\n"
        "Last attempt in full:\nboom"
    )
    assert exc.last.args == ("boom",)


def test_worker_failed_error_message_and_pickle() -> None:
    root = _failure(1, 1, tb="Traceback (most recent call last):\n  ...\nValueError: boom\n")
    other = RankFailure(0, "host0", 1, "HorovodInternalError: peer gone", "tb0", (), 2.0)
    exc = WorkerFailedError(root, [root, other], stopped_ranks=[2])
    assert str(exc) == (
        "Rank 1 on host host1 failed (exit code 1) [root cause]: ValueError: boom\n"
        "Traceback of rank 1:\n"
        "Traceback (most recent call last):\n  ...\nValueError: boom\n"
        "Also failed afterwards: rank 0 on host host0 (exit code 1): "
        "HorovodInternalError: peer gone\n"
        "Stopped by the driver after the root cause: ranks 2\n" + LIFECYCLE_HINT
    )
    back = pickle.loads(pickle.dumps(exc))
    assert str(back) == str(exc)
    assert (back.rank, back.host, back.exit_code) == (1, "host1", 1)


def test_failure_without_traceback_shows_output_tail() -> None:
    exc = WorkerFailedError(_failure(1, -9, tail=("[1]<stdout>: step 1", "[1]<stdout>: step 2")))
    assert str(exc) == (
        "Rank 1 on host host1 failed (killed by signal SIGKILL) [root cause]\n"
        "Last 2 lines of output of rank 1:\n"
        "[1]<stdout>: step 1\n"
        "[1]<stdout>: step 2\n" + LIFECYCLE_HINT
    )


@pytest.mark.parametrize(
    ("code", "text"),
    [(None, "no exit status"), (3, "exit code 3"), (-15, "killed by signal SIGTERM"),
     (-200, "killed by signal 200")],
)
def test_describe_exit(code: int | None, text: str) -> None:
    assert _failure(0, code).describe_exit() == text


def test_failure_with_neither_traceback_nor_output_says_so() -> None:
    assert str(WorkerFailedError(_failure(2, 3))).endswith(
        "Rank 2 wrote no traceback and no output.\n" + LIFECYCLE_HINT
    )

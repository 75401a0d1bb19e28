"""Integration: real Horovod ranks as local processes (np < 0)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import workers
from conftest import assert_no_workers_left
from driver_jobs import run_job, settings

from mlflow_hvd import (
    HorovodRunner,
    JobConfig,
    StartTimeoutError,
    TrackingConfig,
    WorkerFailedError,
)
from mlflow_hvd.backends.local import LocalBackend
from mlflow_hvd.driver import Job
from mlflow_hvd.errors import LIFECYCLE_HINT


@pytest.mark.new_end
@pytest.mark.ranks
@pytest.mark.old_end
def test_two_local_ranks_run_real_collectives(capsys: pytest.CaptureFixture[str]) -> None:
    result = HorovodRunner(np=-2).run(workers.collectives, scale=2.0)
    assert result["rank"] == 0  # rank 0's value comes back
    assert (result["size"], result["local_size"], result["cross_size"]) == (2, 2, 1)
    assert result["sum"] == [6.0]  # (1 + 2) * 2.0: kwargs arrived
    assert result["mean"] == [0.5]
    assert result["gathered"] == [0, 1, 10, 11]
    assert result["broadcast"] == [100.0]
    out = capsys.readouterr().out
    # log_callback_only: the log_to_driver lines of both ranks, prefixed; no plain stdout
    assert "[1]<log>: rank 1 of 2 says hi\n" in out
    assert "[0]<log>: rank 0 of 2 says hi\n" in out
    assert "hello from rank" not in out
    assert_no_workers_left()


def test_np_minus_one_is_a_single_process_and_verbosity_all_streams_stdout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runner = HorovodRunner(np=-1, driver_log_verbosity="all", job=JobConfig(max_line_bytes=100))
    assert runner.run(workers.long_line, nbytes=1000) == 1000
    out = capsys.readouterr().out
    assert f"[0]<stdout>: {'x' * 100} ...[line truncated: 900 more bytes]\n" in out
    assert "[0]<stdout>: after the long line\n" in out
    echoed = runner.run(workers.echo, a=1, b=[2, 3])
    assert (echoed["kwargs"], echoed["rank"]) == ({"a": 1, "b": [2, 3]}, 0)


def test_ranks_leave_without_atexit_hooks_and_lose_no_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank ends with os._exit once its result is delivered (documented: atexit hooks of
    user code do not run); its buffered stdout is still flushed and shown."""
    runner = HorovodRunner(np=-2, driver_log_verbosity="all", tracking=TrackingConfig(track=False))
    hook = tmp_path / "atexit-ran"
    assert runner.run(workers.register_atexit, path=str(hook)) == "returned"
    out = capsys.readouterr().out
    assert "[0]<stdout>: printed just before returning\n" in out
    assert "[1]<stdout>: printed just before returning\n" in out
    assert not hook.exists()


@pytest.mark.old_end
def test_exception_on_rank_1_is_the_root_cause_with_its_traceback() -> None:
    with pytest.raises(WorkerFailedError) as info:
        HorovodRunner(np=-2, job=JobConfig(stop_grace=2)).run(workers.raise_on_rank_1)
    exc = info.value
    tb = exc.root_cause.traceback
    assert tb.startswith("Traceback (most recent call last):\n")
    assert f'File "{workers.__file__}", line' in tb
    assert 'raise ValueError("boom from rank 1")' in tb
    assert tb.endswith("ValueError: boom from rank 1\n")
    assert str(exc) == (
        "Rank 1 on host localhost failed (exit code 1) [root cause]: "
        "ValueError: boom from rank 1\n"
        f"Traceback of rank 1:\n{tb.rstrip()}\n"
        "Stopped by the driver after the root cause: ranks 0\n" + LIFECYCLE_HINT
    )
    assert_no_workers_left()


def test_exit_code_3_on_rank_1_shows_its_last_output() -> None:
    with pytest.raises(WorkerFailedError) as info:
        HorovodRunner(np=-2, job=JobConfig(stop_grace=2)).run(workers.exit_3_on_rank_1)
    assert str(info.value) == (
        "Rank 1 on host localhost failed (exit code 3) [root cause]\n"
        "Last 1 lines of output of rank 1:\n"
        "[1]<stdout>: rank 1 about to exit with status 3\n"
        "Stopped by the driver after the root cause: ranks 0\n" + LIFECYCLE_HINT
    )
    assert info.value.exit_code == 3
    assert_no_workers_left()


def test_sigkill_on_rank_1_is_reported_as_a_signal() -> None:
    with pytest.raises(WorkerFailedError) as info:
        HorovodRunner(np=-2, job=JobConfig(stop_grace=2)).run(workers.sigkill_on_rank_1)
    assert str(info.value) == (
        "Rank 1 on host localhost failed (killed by signal SIGKILL) [root cause]\n"
        "Last 1 lines of output of rank 1:\n"
        "[1]<stdout>: rank 1 about to SIGKILL itself\n"
        "Stopped by the driver after the root cause: ranks 0\n" + LIFECYCLE_HINT
    )
    assert_no_workers_left()


def test_ranks_that_never_start_hit_the_start_deadline(tmp_path: Path) -> None:
    """A real backend whose workers hang before reaching the driver: a clear error within
    the deadline, and the hung processes are ended."""
    fake_python = tmp_path / "python"
    fake_python.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import signal; signal.pause()' \"$@\"\n"
    )
    fake_python.chmod(0o755)
    with pytest.raises(StartTimeoutError) as info:
        run_job(LocalBackend(python=str(fake_python)),
                Job(2, b"", settings(start_timeout=3, stop_grace=1), "hang"))
    assert str(info.value) == (
        "0 of 2 ranks started within 3s (missing ranks: 0, 1). Raise "
        "HorovodRunner(job=JobConfig(start_timeout=...)) if workers are slow to start, or check "
        "that the "
        "cluster has free slots"
    )
    assert_no_workers_left()


def test_tracebacks_name_the_script_and_the_notebook_cell_with_their_lines(
    tmp_path: Path,
) -> None:
    """cloudpickle sends __main__'s functions as anonymous <dynamic-code>; ranks give them
    their file (or Jupyter cell) name and source lines back."""
    cell = "/tmp/ipykernel_4242/2817.py"  # how ipykernel names a cell's code
    script = tmp_path / "my_training.py"
    script.write_text(
        "import linecache, sys\n"
        "import __main__\n"
        "from mlflow_hvd import HorovodRunner, WorkerFailedError, TrackingConfig\n"
        f"CELL = {cell!r}\n"
        "SRC = 'def scale(x):\\n    return 10 / x\\n'\n"
        "linecache.cache[CELL] = (len(SRC), None, SRC.splitlines(True), CELL)\n"
        "exec(compile(SRC, CELL, 'exec'), __main__.__dict__)\n"
        "\n"
        "def train():\n"
        "    return scale(0)\n"
        "\n"
        "try:\n"
        "    HorovodRunner(np=-1, tracking=TrackingConfig(track=False)).run(train)\n"
        "except WorkerFailedError as exc:\n"
        "    print(exc.root_cause.traceback)\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    ).stdout
    assert f'  File "{script}", line 10, in train\n    return scale(0)\n' in out, out
    assert f'  File "{cell}", line 2, in scale\n    return 10 / x\n' in out, out
    assert "<dynamic-code>" not in out


def test_the_lifecycle_log_follows_a_job_and_reaches_the_ranks(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="mlflow_hvd")
    out = HorovodRunner(np=-2, driver_log_verbosity="all",
        tracking=TrackingConfig(track=False)).run(
        workers.log_level_seen)
    assert out == "INFO"  # the driver's level reached rank 0's process
    said = [r.getMessage() for r in caplog.records if r.name.startswith("mlflow_hvd.driver")]
    job = said[0].split(":")[0]
    assert said[0].startswith("job ") and ": starting 2 ranks on the local backend" in said[0]
    assert sum(m.startswith(f"{job}: rank ") and " started on localhost " in m
               for m in said) == 2
    assert sum(m.startswith(f"{job}: rank ") and " exited with 0 " in m for m in said) == 2
    assert said[-3].startswith(f"{job}: succeeded after ")
    assert said[-2] == f"{job}: releasing its ranks"  # they exit by themselves
    # the load the job put on the driver's servers
    load = re.fullmatch(
        rf"{job}: the channel handled (\d+) connections \((\d+) open at most\) and (\d+) "
        r"messages; the rendezvous server (\d+) requests in [\d.]+s \((\d+) not there yet, "
        r"(\d+) refused\), ([\d.]+) MiB sent", said[-1])
    assert load, said[-1]
    connections, most, messages, requests = (int(load[i]) for i in range(1, 5))
    assert connections == 2 and 1 <= most <= 2 and messages >= 3  # 2 started, a value
    assert requests == 0 and load[6] == "0"  # nobody called hvd.init(), nobody refused


def test_a_bad_log_level_names_the_variable() -> None:
    from mlflow_hvd.common import logs

    with pytest.raises(ValueError, match=r"^MLFLOW_HVD_LOG_LEVEL='loud' is not a logging level"):
        logs.enable("loud")


def test_a_job_that_fails_every_attempt_lists_each_cause() -> None:
    from mlflow_hvd.errors import RetriesExhaustedError

    runner = HorovodRunner(np=-2, job=JobConfig(max_failures=1, stop_grace=2),
        tracking=TrackingConfig(track=False))
    with pytest.raises(RetriesExhaustedError) as info:
        runner.run(workers.raise_on_rank_1)
    failures = info.value.failures
    assert [type(f).__name__ for f in failures] == ["WorkerFailedError", "WorkerFailedError"]
    assert all(f.rank == 1 for f in failures)  # type: ignore[attr-defined]
    message = str(info.value).splitlines()
    assert message[:3] == [
        "the job failed on all 2 attempts:",
        "attempt 0: WorkerFailedError: Rank 1 on host localhost failed (exit code 1) [root "
        "cause]: ValueError: boom from rank 1",
        "attempt 1: WorkerFailedError: Rank 1 on host localhost failed (exit code 1) [root "
        "cause]: ValueError: boom from rank 1",
    ]
    assert message[3] == "Last attempt in full:"
    assert_no_workers_left()


def test_a_run_that_refuses_rank_0s_records_fails_the_job_naming_them() -> None:
    with pytest.raises(WorkerFailedError) as info:
        HorovodRunner(np=-1).run(workers.log_into_a_deleted_run)
    assert info.value.root_cause.error.startswith(
        "TrackingError: the tracking store refused 1 metric value for run "
    )
    assert "(not logged)" in info.value.root_cause.error

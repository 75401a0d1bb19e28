"""Faults with real processes, a real ``mlflow server`` and real signals: the driver never
hangs on MLflow, signals end the run KILLED, concurrent drivers share a new store."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import workers
from conftest import assert_no_workers_left
from services import start_mlflow_server, stop_group

from mlflow_hvd import HorovodRunner, WorkerFailedError

TESTS = str(Path(__file__).parent)


def _driver_script(tmp_path: Path, uri: str, body: str) -> Path:
    script = tmp_path / "driver.py"
    script.write_text(
        "import sys, mlflow\n"
        f"sys.path.insert(0, {TESTS!r})\n"
        "import workers\n"
        "from mlflow_hvd import HorovodRunner\n"
        f"mlflow.set_tracking_uri({uri!r})\n" + body
    )
    return script


@pytest.mark.parametrize(
    ("sig", "reason"),
    [(signal.SIGINT, "interrupted by the user"), (signal.SIGTERM, "terminated by SIGTERM")],
)
def test_a_signal_to_the_driver_ends_the_run_killed(
    tmp_path: Path, sig: signal.Signals, reason: str
) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    script = _driver_script(
        tmp_path,
        uri,
        "r = HorovodRunner(np=-2)\n"
        "try:\n"
        "    r.run(workers.sleep_forever)\n"
        "except KeyboardInterrupt as exc:\n"
        "    print('interrupted', type(exc).__name__, r.last_run_id, flush=True)\n",
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    seen = 0
    while seen < 2:  # both ranks are up
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "driver ended before the ranks started"
        seen += "<log>: ready" in line
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    kind, run_id = out.split("interrupted ")[1].split()[:2]
    assert kind == ("Terminated" if sig == signal.SIGTERM else "KeyboardInterrupt")
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["mlflow_hvd.status_reason"] == reason
    assert_no_workers_left()


def test_two_drivers_create_the_same_new_sqlite_store_at_once(tmp_path: Path) -> None:
    """MLflow's schema creation races (seen failing 6 of 6 times without the lock)."""
    uri = f"sqlite:///{tmp_path}/new.db"
    go = tmp_path / "go"
    script = tmp_path / "open_store.py"
    script.write_text(
        "import os, sys, time, mlflow\n"
        "from mlflow_hvd.tracking.driver_run import driver_run\n"
        f"mlflow.set_tracking_uri({uri!r})\n"
        "open(sys.argv[1], 'w').close()\n"
        "deadline = time.monotonic() + 60\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.001)\n"
        "with driver_run(-1, {'backend': 'local'}) as target:\n"
        "    print(target.run_id)\n"
    )
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in ready
    ]
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # both start creating the store now
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    client = mlflow.MlflowClient(tracking_uri=uri)
    for out, _ in outs:
        assert client.get_run(out.strip()).info.status == "FINISHED"


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_tracking_server_gone_at_the_end_bounds_the_drivers_bookkeeping(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fails: bool
) -> None:
    """The server dies during the job: run() still returns rank 0's value, or raises the
    job's own error, within ``tracking_timeout``, warning what was not recorded."""
    server, url = start_mlflow_server("127.0.0.1", tmp_path / "server")
    mlflow.set_tracking_uri(url)
    runner = HorovodRunner(np=-1, tracking_timeout=3)
    try:
        with caplog.at_level(logging.WARNING):
            t0 = time.monotonic()
            if fails:
                with pytest.raises(WorkerFailedError) as info:
                    runner.run(workers.kill_group_then_raise, pgid=server.pid)
                assert info.value.root_cause.error == "RuntimeError: the job's own error"
            else:
                assert runner.run(workers.kill_group_then_return, pgid=server.pid, value=41) == 41
            took = time.monotonic() - t0
    finally:
        stop_group(server)
        mlflow.set_tracking_uri("")
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and r.name.startswith("mlflow_hvd")
    ]
    not_recorded = (
        "tags mlflow_hvd.error, mlflow_hvd.failed_host, mlflow_hvd.failed_rank, "
        "mlflow_hvd.root_cause; error.txt; status FAILED"
        if fails
        else "status FINISHED"
    )
    assert warnings == [
        f"mlflow_hvd: the tracking server did not answer within 3s while ending run "
        f"{runner.last_run_id}; not recorded: {not_recorded} (the run stays RUNNING in MLflow)"
    ]
    assert took < 40, took  # a job of ~15 s on 2 cores; MLflow's own retries take minutes

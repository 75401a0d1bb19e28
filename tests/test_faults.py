"""Faults with real processes, a real ``mlflow server`` and real signals: the driver never
hangs on MLflow, signals end the run KILLED, concurrent drivers share a new store."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers
from conftest import assert_no_workers_left
from services import Program, wait_until

from mlflow_hvd import HorovodRunner, JobConfig, JobStopped, TrackingConfig, WorkerFailedError

TESTS = str(Path(__file__).parent)
# beyond the configured deadlines: a rank's interpreter exit (1-1.6 s with MLflow loaded on
# a fast day, STACK.md) and the driver's teardown (servers polled every 0.5 s), with room for
# a day 2.5x slower
RANK_EXIT = 15.0


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


def _scratch(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("mlflow-hvd-"))


@pytest.mark.parametrize(
    ("sig", "reason"),
    [
        (signal.SIGINT, "interrupted by the user"),
        (signal.SIGTERM, "terminated by SIGTERM"),
        (signal.SIGKILL, ""),
    ],
    ids=["SIGINT", "SIGTERM", "SIGKILL"],
)
def test_a_signal_to_the_driver_ends_the_run_killed_and_leaves_no_files(
    tmp_path: Path, sig: signal.Signals, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tmpdir = tmp_path / "tmp"  # the driver's and its workers' TMPDIR
    tmpdir.mkdir()
    script = _driver_script(
        tmp_path,
        uri,
        # what an interactive shell gives: Ctrl-C raises (a background job inherits SIGINT
        # ignored, and Python then keeps ignoring it)
        "import signal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "r = HorovodRunner(np=-2)\n"
        "try:\n"
        "    r.run(workers.sleep_forever)\n"
        "except KeyboardInterrupt as exc:\n"
        "    print('interrupted', type(exc).__name__, r.last_run_id, flush=True)\n",
    )
    with Program([sys.executable, str(script)], cwd=tmp_path,
                 env={**os.environ, "TMPDIR": str(tmpdir)}) as driver:
        for _ in range(2):  # both ranks are up
            driver.wait_for_line("<log>: ready", 120)
        assert len(_scratch(tmpdir)) == 1  # the job's payload directory
        driver.proc.send_signal(sig)
        driver.finish(60)
        proc = driver.proc
        out = "\n".join(driver.lines)
    assert_no_workers_left()
    if sig == signal.SIGKILL:  # nothing runs in the driver: its directory stays, until...
        (orphan,) = _scratch(tmpdir)
        assert orphan.startswith(f"mlflow-hvd-job-{proc.pid}-")
        monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
        assert HorovodRunner(np=-1, tracking=TrackingConfig(track=False)).run(workers.echo,
            x=1)["kwargs"] == {"x": 1}
        assert _scratch(tmpdir) == []  # ...the next job on this host removes it
        return
    assert proc.returncode == 0, out
    kind, run_id = out.split("interrupted ")[1].split()[:2]
    assert kind == ("Terminated" if sig == signal.SIGTERM else "KeyboardInterrupt")
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["mlflow_hvd.status_reason"] == reason
    assert _scratch(tmpdir) == []


@pytest.mark.ranks
def test_stop_from_another_thread_ends_the_job_as_ctrl_c_does(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """HorovodRunner.stop(): the thread in run() gets JobStopped, the ranks are gone, the
    run is KILLED with its reason; a stop with no job running stops the next run at once,
    and the runner runs again after that."""
    runner = HorovodRunner(np=-2, job=JobConfig(stop_grace=2))
    shown: list[str] = []
    ended: dict[str, BaseException] = {}

    def run() -> None:
        try:
            runner.run(workers.sleep_forever)
        except BaseException as exc:  # JobStopped is a KeyboardInterrupt
            ended["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: shown.append(capsys.readouterr().out) or
               "".join(shown).count("<log>: ready") == 2, 120, "both ranks up")
    runner.stop()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert type(ended["error"]) is JobStopped
    assert_no_workers_left()
    run_info = mlflow.MlflowClient().get_run(str(runner.last_run_id))
    assert run_info.info.status == "KILLED"
    assert run_info.data.tags["mlflow_hvd.status_reason"] == "stopped by HorovodRunner.stop()"
    runner.stop()  # nothing runs: the next run is stopped as it starts
    with pytest.raises(JobStopped, match="was stopped before it started"):
        runner.run(workers.echo, x=1)
    assert runner.run(workers.echo, x=2)["kwargs"] == {"x": 2}


def test_two_drivers_create_the_same_new_sqlite_store_at_once(tmp_path: Path) -> None:
    """MLflow's schema creation races (seen failing 6 of 6 times without the lock)."""
    uri = f"sqlite:///{tmp_path}/new.db"
    go = tmp_path / "go"
    script = tmp_path / "open_store.py"
    script.write_text(
        "import os, sys, time, mlflow\n"
        "from mlflow_hvd import TrackingConfig\n"
        "from mlflow_hvd.driver.tracking.run import driver_run\n"
        f"mlflow.set_tracking_uri({uri!r})\n"
        "open(sys.argv[1], 'w').close()\n"
        "deadline = time.monotonic() + 60\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.001)\n"
        "with driver_run(-1, {'backend': 'local'}, TrackingConfig()) as target:\n"
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
    wait_until(lambda: all(r.exists() for r in ready), 60, "both processes to be ready")
    go.touch()  # both start creating the store now
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    client = mlflow.MlflowClient(tracking_uri=uri)
    for out, _ in outs:
        assert client.get_run(out.strip()).info.status == "FINISHED"


def _mlflow_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and r.name.startswith("mlflow_hvd")
    ]


@pytest.mark.slow
def test_tracking_server_down_for_10s_mid_run_loses_and_repeats_nothing(
    tmp_path: Path, loopback_server: Any
) -> None:
    """Rank 0 logs through both APIs, ``mlflow_hvd.tracking`` and MLflow's own fluent
    functions (every other value), across a real outage of the server."""
    server = loopback_server
    mlflow.set_tracking_uri(server.url)
    client = mlflow.MlflowClient()
    runner = HorovodRunner(np=-1,
        tracking=TrackingConfig(undelivered_dir=str(tmp_path / "undelivered")))
    n = 250
    done: dict[str, object] = {}

    back = tmp_path / "server-is-back"  # the job outlasts the outage, however slow a restart

    def job() -> None:
        done["value"] = runner.run(workers.log_steadily, n=n, interval=0.1, until=str(back),
                                   api="both")

    thread = threading.Thread(target=job)
    try:
        thread.start()
        wait_until(
            lambda: runner.last_run_id
            and len(client.get_metric_history(runner.last_run_id, "x")) >= 20,
            120,
            "the first 20 values on the server",
        )
        server.kill()
        time.sleep(10)  # the outage itself, not a synchronisation
        server.restart()
        back.touch()
        thread.join(timeout=180)
        assert not thread.is_alive()
        assert done["value"] == n
        run = client.get_run(str(runner.last_run_id))
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "x")]
        values = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "x")}
        artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "mid")]
    finally:
        back.touch()  # a failed wait must not leave the job running
        thread.join(timeout=60)
    assert sorted(steps) == list(range(n))  # every value once: none lost, none repeated
    assert all(values[i] == float(i) for i in range(n))
    assert run.info.status == "FINISHED"
    assert run.data.tags["half"] == "yes" and run.data.params["p"] == "at-half"
    assert artifacts == ["mid/state.json"]
    assert not (tmp_path / "undelivered").exists()  # nothing had to be saved for later


@pytest.mark.slow
def test_an_outage_longer_than_rank_0s_memory_spills_to_disk_and_loses_nothing(
    tmp_path: Path, loopback_server: Any
) -> None:
    """More values than rank 0 keeps in memory (MEMORY_LIMIT) are logged while the real
    server is down: the rest go to the spill file, and all arrive, in order, once it is back."""
    from mlflow_hvd.rank.tracking.delivery import MEMORY_LIMIT

    server = loopback_server
    mlflow.set_tracking_uri(server.url)
    client = mlflow.MlflowClient()
    n = MEMORY_LIMIT + 2000
    down, spilled, back = (str(tmp_path / name) for name in ("down", "spilled", "back"))
    runner = HorovodRunner(np=-1, tracking=TrackingConfig(tracking_timeout=120,
        undelivered_dir=str(tmp_path / "undelivered")))
    done: dict[str, object] = {}
    thread = threading.Thread(target=lambda: done.update(value=runner.run(
        workers.burst_during_outage, n=n, down=down, spilled=spilled, back=back)))
    try:
        thread.start()
        wait_until(lambda: runner.last_run_id
                   and client.get_metric_history(runner.last_run_id, "before"), 120,
                   "rank 0's first value on the server")
        server.kill()
        Path(down).touch()
        wait_until(lambda: os.path.exists(spilled), 120, "rank 0 spilling to disk")
        server.restart()
        Path(back).touch()
        thread.join(timeout=300)
        assert not thread.is_alive()
    finally:
        for path in (down, back):  # a failed wait must not leave the job waiting
            Path(path).touch()
        thread.join(timeout=60)
    assert done["value"] == n - MEMORY_LIMIT  # records past the memory limit went to disk
    history = client.get_metric_history(str(runner.last_run_id), "x")
    assert sorted(m.step for m in history) == list(range(n))  # none lost, none repeated
    assert all(m.value == float(m.step) for m in history)
    assert client.get_run(str(runner.last_run_id)).info.status == "FINISHED"
    assert not (tmp_path / "undelivered").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_tracking_server_gone_at_the_end_bounds_run_and_saves_a_replayable_bundle(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fails: bool, loopback_server: Any
) -> None:
    """The server dies during the job and stays down: run() returns rank 0's value, or
    raises the job's own error, within 2 x tracking_timeout of the job's end, warning what
    was not delivered and where it is; the bundle replays once the server is back."""
    server = loopback_server
    url = server.url
    mlflow.set_tracking_uri(url)
    saved = tmp_path / "undelivered"
    tracking_timeout = 3
    runner = HorovodRunner(np=-1, tracking=TrackingConfig(tracking_timeout=tracking_timeout,
        undelivered_dir=str(saved)))
    ended = tmp_path / "ended"
    with caplog.at_level(logging.WARNING):
        if fails:
            with pytest.raises(WorkerFailedError) as info:
                runner.run(workers.kill_group_then_raise, pgid=server.proc.pid,
                           ended=str(ended))
            assert info.value.root_cause.error == "RuntimeError: the job's own error"
        else:
            value = runner.run(workers.kill_group_then_return, pgid=server.proc.pid,
                               value=41, log_n=50, ended=str(ended))
            assert value == 41
        # from the end of the job's function to run()'s return
        took = time.time() - float(ended.read_text())
    run_id = str(runner.last_run_id)
    bundle = saved / run_id
    warnings = _mlflow_warnings(caplog)
    not_recorded = (
        "tags mlflow_hvd.error, mlflow_hvd.failed_host, mlflow_hvd.failed_rank, "
        "mlflow_hvd.root_cause; error.txt; status FAILED"
        if fails
        else "status FINISHED"
    )
    ending = (
        f"mlflow_hvd: the tracking server did not answer within 3s while ending run {run_id}"
        f"; not recorded: {not_recorded} (the run stays RUNNING in MLflow until then). "
        f"Saved in {bundle}; send with: python -m mlflow_hvd.tracking.replay {bundle}"
    )
    if fails:
        assert warnings == [ending]
    else:
        assert len(warnings) == 2, warnings
        assert warnings[0].startswith(
            "mlflow_hvd: 50 metric values, 1 tag and 1 artifact file logged by rank 0 on "
            f"host localhost did not reach the tracking server {url} (the tracking server "
            f"at {url} has been unreachable since "
        )
        assert warnings[0].endswith(
            f"Saved in {bundle}; send with: python -m mlflow_hvd.tracking.replay {bundle}"
        )
        assert warnings[1] == ending
    # bounded by the setting, not by MLflow's own retries (minutes): rank 0's last delivery
    # and the run's end each wait at most tracking_timeout, plus the rank's exit
    assert took < 2 * tracking_timeout + RANK_EXIT, took

    server.restart()
    replay = subprocess.run(
        [sys.executable, "-m", "mlflow_hvd.tracking.replay", str(bundle)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert replay.returncode == 0, replay.stderr
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    history = client.get_metric_history(run_id, "y")
    artifacts = [a.path for a in client.list_artifacts(run_id, "late")]
    errors = [a.path for a in client.list_artifacts(run_id) if a.path == "error.txt"]
    assert not bundle.exists()
    if fails:
        assert (
            replay.stdout.strip().splitlines()[-1]
            == f"replayed 4 tags, 1 artifact file and 1 run status into run {run_id}"
        )
        assert run.info.status == "FAILED"
        assert run.data.tags["mlflow_hvd.root_cause"] == "RuntimeError: the job's own error"
        assert errors == ["error.txt"]
    else:
        assert replay.stdout.strip().splitlines()[-1] == (
            f"replayed 50 metric values, 1 tag, 1 artifact file and 1 run status into run {run_id}"
        )
        assert run.info.status == "FINISHED"
        assert sorted(m.step for m in history) == list(range(50))
        assert run.data.tags["after"] == "kill"
        assert artifacts == ["late/n.json"]


@pytest.mark.slow
@pytest.mark.parametrize("max_failures", [1, 0])
def test_rank_sigkilled_mid_epoch_restarts_from_the_last_checkpoint(
    store: str, max_failures: int
) -> None:
    """kill -9 of rank 1 half-way through epoch 3 of 5, on the first attempt only."""
    import digits_keras

    runner = HorovodRunner(np=-2, job=JobConfig(max_failures=max_failures))
    if max_failures == 0:
        with pytest.raises(WorkerFailedError) as info:
            runner.run(digits_keras.train, epochs=5, kill_at_epoch=3, log_model=False)
        assert str(info.value).startswith(
            "Rank 1 on host localhost failed (killed by signal SIGKILL)"
        )
    else:
        result = runner.run(
            digits_keras.train, epochs=5, kill_at_epoch=3, log_model=False, log_every_n_steps=10
        )
        assert result["epochs"] == 5
    client = mlflow.MlflowClient()
    run_id = str(runner.last_run_id)
    run = client.get_run(run_id)
    attempts = client.get_metric_history(run_id, "mlflow_hvd.attempt")
    errors = [a.path for a in client.list_artifacts(run_id, "attempts")]
    losses = client.get_metric_history(run_id, "loss")
    if max_failures == 0:  # no restart: the run looks as it always did, no attempt records
        assert run.info.status == "FAILED"
        assert run.data.tags["mlflow_hvd.failed_rank"] == "1"
        assert (attempts, errors) == ([], [])
        assert sorted(m.step for m in losses) == [0, 1, 2]  # epochs done before the kill
        return
    first_error = client.download_artifacts(run_id, "attempts/attempt_0_error.txt")
    assert Path(first_error).read_text().startswith(
        "WorkerFailedError: Rank 1 on host localhost failed (killed by signal SIGKILL) "
        "[root cause]"
    )
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in sorted(attempts, key=lambda m: m.step)] == [
        (0, 0.0),
        (1, 1.0),
    ]
    assert errors == ["attempts/attempt_0_error.txt"]
    # resumed from the last checkpoint before the kill (epoch 2): no epoch lost or repeated
    assert run.data.tags["mlflow_hvd.resumed_from"] == f"{run_id}@epoch_2"
    assert sorted(m.step for m in losses) == [0, 1, 2, 3, 4]
    # per-step values: the restart skips the steps its predecessor already logged
    step_losses = sorted(m.step for m in client.get_metric_history(run_id, "step_loss"))
    assert step_losses == list(range(10, step_losses[-1] + 1, 10)), step_losses
    assert step_losses[-1] >= 80  # 5 epochs of about 18 steps


@pytest.mark.slow
def test_a_model_logged_during_an_outage_fails_within_mlflows_retries_and_loses_nothing_else(
    tmp_path: Path, loopback_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A logged model's id comes from the server: during an outage ``log_model`` on rank 0
    raises TrackingError once MLflow's HTTP retries are over (bounded by its settings, here
    no retry and 5 s per request); the job goes on and its queued metric is delivered."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    server = loopback_server
    mlflow.set_tracking_uri(server.url)
    runner = HorovodRunner(np=-1)
    done: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: done.update(
        value=runner.run(workers.log_model_in_an_outage, folder=str(tmp_path))))
    try:
        thread.start()
        wait_until(lambda: (tmp_path / "ready").exists(), 120, "the job to start")
        server.kill()
        (tmp_path / "down").touch()
        wait_until(lambda: (tmp_path / "tried").exists(), 120, "rank 0 to try log_model")
        server.restart()
    finally:
        (tmp_path / "back").touch()
        thread.join(timeout=180)
    assert not thread.is_alive()
    said, waited = done["value"]["said"], done["value"]["waited"]
    assert said.startswith(
        "logging a model (its id comes from the server) needs the tracking server at "
        f"{server.url}, which does not answer: ")
    assert said.endswith("The job's metrics, params, tags and artifacts are queued and "
                         "delivered when it is back; this call's result is not")
    assert waited < 30, waited
    client = mlflow.MlflowClient(server.url)
    run = client.get_run(str(runner.last_run_id))
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "during")] == [
        (3, 1.0)]
    assert client.search_logged_models(  # none half-made
        experiment_ids=[run.info.experiment_id],
        filter_string=f"source_run_id = '{run.info.run_id}'").to_list() == []


@pytest.mark.ranks
def test_a_rank_of_another_version_fails_the_job_once_without_a_retry(
    store: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A fault that would repeat is not retried, whatever max_failures says: a rank that
    sends what this driver does not know (another mlflow_hvd version) fails the attempt,
    recorded in the run, and run() raises at once, saying why it did not retry."""
    from mlflow_hvd.errors import BackendError

    caplog.set_level(logging.INFO, logger="mlflow_hvd")
    runner = HorovodRunner(np=-2, job=JobConfig(max_failures=2, stop_grace=2))
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        runner.run(workers.speaks_another_version)
    assert time.monotonic() - started < 30  # not three attempts of a 60 s sleep
    assert "a rank or task sent a message this driver does not know (NoCredentials)" in str(
        info.value)
    assert ("not retried: the executors run another version of mlflow_hvd or disagree on "
            "the layout, and another attempt meets the same executors") in caplog.text
    client = mlflow.MlflowClient()
    run_id = str(runner.last_run_id)
    assert client.get_run(run_id).info.status == "FAILED"
    assert [m.value for m in client.get_metric_history(run_id, "mlflow_hvd.attempt")] == [0.0]
    assert [a.path for a in client.list_artifacts(run_id, "attempts")] == [
        "attempts/attempt_0_error.txt"]
    assert_no_workers_left()

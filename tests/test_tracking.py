"""Tracking: driver-owned run, rank-0-only logging, statuses, a real MLflow server."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers
from driver_jobs import tracking_target
from services import wait_until

from mlflow_hvd import HorovodRunner, JobConfig, TrackingConfig, WorkerFailedError, tracking
from mlflow_hvd.driver.tracking.run import absolute_tracking_uri, driver_run
from mlflow_hvd.errors import TrackingError
from mlflow_hvd.protocol.records import Metric


def _tensorflow_version() -> str:
    """``tf.__version__`` as a fresh interpreter imports it (upstream's own answer)."""
    out = subprocess.run([sys.executable, "-c", "import tensorflow as tf; print(tf.__version__)"],
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("sqlite:///mlflow.db", "sqlite:////base/mlflow.db"),
        ("sqlite:////abs/x.db", "sqlite:////abs/x.db"),
        ("mlruns", "file:///base/mlruns"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("databricks", "databricks"),
    ],
)
def test_relative_store_uris_become_absolute(uri: str, expected: str) -> None:
    assert absolute_tracking_uri(uri, cwd="/base") == expected


def test_api_is_a_no_op_outside_a_job() -> None:
    assert not tracking.is_logging_rank()
    tracking.log_params({"a": 1})
    tracking.log_metrics({"m": 1.0}, step=1)
    tracking.set_tags({"t": "v"})
    tracking.flush()
    assert tracking.log_model(object()) is None
    assert tracking.run_id() is None


@pytest.mark.old_end
def test_only_rank_0_logs_into_the_driver_run(store: str) -> None:
    runner = HorovodRunner(np=-2)
    run_id = runner.run(workers.log_some, n_steps=3)
    assert run_id == runner.last_run_id
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"alpha": "0.5", "rank_that_logged": "0"}
    history = client.get_metric_history(run_id, "m")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 10.0), (2, 20.0)]
    tags = run.data.tags
    assert tags["who"] == "rank0"
    assert (tags["mlflow_hvd.np"], tags["mlflow_hvd.backend"]) == ("-2", "local")
    assert tags["mlflow_hvd.horovod_version"] == "0.28.1"
    # the version the rank imported is the one TensorFlow itself reports here
    assert tags["mlflow_hvd.tensorflow_version"] == _tensorflow_version()
    from importlib.metadata import PackageNotFoundError, version

    try:  # the old end's environment has no PyTorch: the tag is then empty
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = ""
    assert tags["mlflow_hvd.torch_version"] == torch_version
    assert [a.path for a in client.list_artifacts(run_id, "info")] == ["info/rank.json"]
    assert mlflow.active_run() is None  # the run the runner started is ended


def test_workers_get_the_runs_params_source_and_checkpoint_state_from_the_driver(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What rank 0 would otherwise ask the server before training: read by the driver."""
    from mlflow_hvd.protocol.checkpoint_layout import LATEST_TAG

    with driver_run(1, {"backend": "local"}, TrackingConfig()) as target:
        assert target.facts is not None and not target.facts.has_checkpoint
        assert target.facts.params == {}
        assert "pytest" in target.facts.source_tags["mlflow.source.name"]  # the driver's program
    with mlflow.start_run() as active:
        # logged to after the caller started its run: the driver reads the run again
        mlflow.log_param("lr", "0.1")
        mlflow.set_tag(LATEST_TAG, "checkpoints/epoch_3/checkpoint.keras")
        with driver_run(1, {"backend": "local"}, TrackingConfig()) as target:
            assert target.run_id == active.info.run_id
            assert target.facts is not None and target.facts.has_checkpoint
            assert target.facts.params == {"lr": "0.1"}
    earlier = mlflow.MlflowClient().create_run("0").info.run_id
    mlflow.MlflowClient().log_param(earlier, "np", "2")
    monkeypatch.setenv("MLFLOW_RUN_ID", earlier)  # as `mlflow run` resumes its run
    with driver_run(1, {"backend": "local"}, TrackingConfig()) as target:
        assert target.run_id == earlier
        assert target.facts is not None and not target.facts.has_checkpoint
        assert target.facts.params == {"np": "2"}


def test_active_run_is_used_and_left_open(store: str) -> None:
    with mlflow.start_run() as run:
        assert HorovodRunner(np=-1).run(workers.log_some, n_steps=1) == run.info.run_id
        assert mlflow.MlflowClient().get_run(run.info.run_id).info.status == "RUNNING"
    assert mlflow.MlflowClient().get_run(run.info.run_id).info.status == "FINISHED"


def test_failure_marks_the_run_failed_with_rank_and_root_cause(store: str) -> None:
    runner = HorovodRunner(np=-2, job=JobConfig(stop_grace=2))
    with pytest.raises(WorkerFailedError):
        runner.run(workers.raise_on_rank_1)
    client = mlflow.MlflowClient()
    assert runner.last_run_id is not None
    run = client.get_run(runner.last_run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["mlflow_hvd.failed_rank"] == "1"
    assert run.data.tags["mlflow_hvd.root_cause"] == "ValueError: boom from rank 1"
    error = mlflow.artifacts.load_text(f"runs:/{runner.last_run_id}/error.txt")
    assert error.startswith("WorkerFailedError: Rank 1 on host localhost failed (exit code 1)")
    assert "ValueError: boom from rank 1" in error


@pytest.mark.ranks
def test_param_changed_value_is_refused_clearly(store: str) -> None:
    def relog() -> None:
        import horovod.tensorflow as hvd

        from mlflow_hvd import tracking as t

        hvd.init()
        t.log_params({"lr": 0.1})
        t.log_params({"lr": 0.2})

    with pytest.raises(WorkerFailedError) as info:
        HorovodRunner(np=-1).run(relog)
    assert info.value.root_cause.error == (
        "ConfigurationError: param 'lr' was already logged as '0.1'; MLflow refuses to change "
        "it to '0.2'. Log changing values as metrics or tags instead"
    )


@pytest.mark.old_end
@pytest.mark.slow
def test_logging_through_a_real_mlflow_server(loopback_server: Any, tmp_path: Path) -> None:
    import digits_keras

    old = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(loopback_server.url)
    try:
        runner = HorovodRunner(np=-2)
        result = runner.run(digits_keras.train, epochs=2, log_model=False)
        client = mlflow.MlflowClient()
        assert runner.last_run_id is not None
        run = client.get_run(runner.last_run_id)
        assert run.info.status == "FINISHED"
        assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # proxied over HTTP
        assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1]
        ckpt = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints/epoch_1")]
        assert ckpt == [
            "checkpoints/epoch_1/checkpoint.keras",
            "checkpoints/epoch_1/checkpoint_metrics.json",
        ]
        assert result["test_accuracy"] > 0.5
    finally:
        mlflow.set_tracking_uri(old)


def test_system_metrics_are_logged_once_per_node(store: str) -> None:
    key = "system/localhost/cpu_utilization_percentage"
    runner = HorovodRunner(np=-2, tracking=TrackingConfig(log_system_metrics=True))
    seen = runner.run(workers.wait_for_metric_values, key=key, count=3)
    assert seen >= 3
    client = mlflow.MlflowClient()
    metrics = client.get_run(runner.last_run_id).data.metrics
    system = sorted(k for k in metrics if k.startswith("system/"))
    # two ranks on one node: prefixed by the node, one series per metric ...
    assert key in system
    assert all(k.startswith("system/localhost/") for k in system)
    # ... written by one monitor: a second one would log each step again
    steps = [m.step for m in client.get_metric_history(runner.last_run_id, key)]
    assert steps == list(range(len(steps))), steps


class _SlowValue:
    """A metric value whose conversion blocks the logging thread until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __float__(self) -> float:
        self.release.wait(30)
        return 1.0


def test_flush_that_cannot_drain_names_the_store_and_the_wait(store: str, tmp_path: Path) -> None:
    from mlflow_hvd.rank.tracking.delivery import Delivery

    client = mlflow.MlflowClient()
    run = client.create_run("0")
    logger = Delivery(tracking_target(store, run.info.run_id), _direct(client, run.info.run_id),
                      str(tmp_path))
    stuck = _SlowValue()
    logger.put(Metric("m", stuck, 0, 0))
    with pytest.raises(TrackingError) as info:
        logger.flush(timeout=0.3)
    assert str(info.value) == (
        f"MLflow logging did not drain within 0.3s: 1 record still queued for run "
        f"{run.info.run_id}; the tracking server at {store} is slow to answer"
    )
    stuck.release.set()
    logger.flush(timeout=30)  # once unblocked, the value lands
    assert [m.value for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, "m")] == [
        1.0
    ]


def test_a_failed_background_send_is_raised_by_the_next_flush(store: str, tmp_path: Path) -> None:
    from mlflow_hvd.rank.tracking.delivery import Delivery

    client = mlflow.MlflowClient()
    run = client.create_run("0")
    logger = Delivery(tracking_target(store, run.info.run_id), _direct(client, run.info.run_id),
                      str(tmp_path))
    client.delete_run(run.info.run_id)  # the store now refuses writes to it
    logger.put(Metric("m", 1.0, 0, 0))
    logger.put(Metric("m", 2.0, 0, 1))
    with pytest.raises(TrackingError) as info:
        logger.flush(timeout=30)
    assert str(info.value).startswith(
        f"the tracking store refused 2 metric values for run {run.info.run_id} (not logged): "
    )
    assert "must be in the 'active' state" in str(info.value)


def _direct(client: Any, run_id: str) -> Callable[[Sequence[Any]], None]:
    """A delivery's sender that makes the MLflow calls itself (no driver in between)."""
    from mlflow_hvd.protocol import records

    return lambda batch: records.send(client, run_id, batch)


class _ServerDown:
    """A real MLflow client behind a switch: while ``down``, every call fails the way a
    dead server does (MlflowException INTERNAL_ERROR), without waiting for MLflow's retries."""

    def __init__(self, client: Any) -> None:
        self.client, self.down = client, True

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                from mlflow.exceptions import MlflowException

                raise MlflowException("Connection refused (test outage)")
            return real(*args, **kwargs)

        return call


def test_an_outage_spills_past_the_memory_limit_and_delivers_in_order(
    store: str, tmp_path: Path
) -> None:
    from mlflow_hvd.rank.tracking.delivery import Delivery

    real = mlflow.MlflowClient()
    run = real.create_run("0")
    server = _ServerDown(real)
    logger = Delivery(
        tracking_target(store, run.info.run_id), _direct(server, run.info.run_id),
        str(tmp_path), memory_limit=10,
    )
    for i in range(100):
        logger.put(Metric("m", float(i), 1000 + i, i))
    spill = tmp_path / "pending.jsonl"
    wait_until(
        lambda: spill.exists() and len(spill.read_text().splitlines()) == 91,
        30,
        "90 records spilled to disk, after the file's header",
    )
    assert json.loads(spill.read_text().splitlines()[0]) == {
        "format": "mlflow_hvd.records", "version": 2}
    with pytest.raises(TrackingError, match="has been unreachable since"):
        logger.flush(timeout=1)
    server.down = False
    logger.flush(timeout=60)
    history = real.get_metric_history(run.info.run_id, "m")
    assert [(m.step, m.value) for m in history] == [(i, float(i)) for i in range(100)]
    assert not spill.exists()
    undelivered, refusal = logger.close(5, "h")
    assert (undelivered, refusal) == (None, "")


def test_a_run_in_mlflows_default_store_says_where_once(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import workers\n"
        "from mlflow_hvd import HorovodRunner\n"
        "for _ in range(2):\n"
        "    HorovodRunner(np=-1).run(workers.echo)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    told = [line for line in proc.stderr.splitlines() if line.startswith("mlflow_hvd: no MLflow")]
    assert told == [
        "mlflow_hvd: no MLflow tracking URI set (MLFLOW_TRACKING_URI or mlflow.set_tracking_uri)"
        f": logging to MLflow's default store {uri}; open it with: mlflow ui "
        f"--backend-store-uri {uri}"
    ]
    runs = mlflow.MlflowClient(tracking_uri=uri).search_runs(["0"])
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]  # both jobs, one message


def test_attempt_records_an_unreachable_server_missed_are_saved_for_replay(
    store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow_hvd.driver.tracking import attempts, undelivered

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run_id = mlflow.MlflowClient().create_run("0").info.run_id
    gone = tracking_target("http://127.0.0.1:9", run_id)  # nothing listens on port 9
    root = str(tmp_path / "undelivered")
    attempts.started(gone, 0, 4, 2.0, root)
    attempts.failed(gone, 0, RuntimeError("rank 1 was killed"), 2.0, root)
    bundle = undelivered.bundle_dir(root, run_id)
    assert f"Saved in {bundle}" in caplog.text
    counts = undelivered.replay(bundle, tracking_uri=store)  # the server is "back"
    assert (counts["metric"], counts["artifact"]) == (2, 1)
    client = mlflow.MlflowClient()
    (attempt,) = client.get_metric_history(run_id, attempts.ATTEMPT_METRIC)
    assert (attempt.step, attempt.value) == (0, 0.0)
    (size,) = client.get_metric_history(run_id, attempts.WORLD_SIZE_METRIC)
    assert (size.step, size.value) == (0, 4.0)
    text = Path(client.download_artifacts(run_id, attempts.error_file(0))).read_text()
    assert text == "RuntimeError: rank 1 was killed\n"
    assert not os.path.exists(bundle)


def test_attempt_records_a_store_refuses_are_warned_about_not_saved(
    store: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow_hvd.driver.tracking import attempts

    no_such_run = tracking_target(store, "0" * 32)  # the store answers: no such run
    root = tmp_path / "undelivered"
    with caplog.at_level(logging.WARNING):
        attempts.started(no_such_run, 1, 2, 10.0, str(root))
    assert (
        "mlflow_hvd: the tracking store refused a write while recording the start of attempt 1 "
        f"in run {'0' * 32} (not recorded: metric mlflow_hvd.attempt=1, metric "
        "mlflow_hvd.world_size=2): "
    ) in caplog.text
    assert not root.exists()  # sending it again would be refused again: nothing kept


def test_a_broken_delivery_thread_is_raised_by_the_next_flush(store: str, tmp_path: Path) -> None:
    from mlflow_hvd.rank.tracking.delivery import Delivery, DeliveryState

    client = mlflow.MlflowClient()
    run = client.create_run("0")
    logger = Delivery(tracking_target(store, run.info.run_id), _direct(client, run.info.run_id),
                      str(tmp_path))
    logger.put(Metric("m", "not a number", 0, 0))  # the thread's conversion fails: a bug
    with pytest.raises(TrackingError, match=(
        rf"^the MLflow delivery thread of run {run.info.run_id} failed: ValueError: could not "
        "convert string to float: 'not a number'$"
    )):
        logger.flush(timeout=30)
    assert logger.state is DeliveryState.BROKEN


def test_a_checkpoints_rank_count_is_read_or_its_failure_raised_never_guessed(
        store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The factor a resumed optimizer's learning rate is rescaled by: from the checkpoint's
    metrics file; 1.0, said on stderr, for a checkpoint that does not say; a metrics file
    that cannot be read raises (it returned 1.0: the old size's rate restored silently)."""
    from mlflow_hvd.protocol.checkpoint_layout import CheckpointRef
    from mlflow_hvd.rank.tracking.checkpoints import lr_rescale

    def checkpoint(metrics: str | None) -> CheckpointRef:
        with mlflow.start_run() as run:
            folder = tmp_path / run.info.run_id
            folder.mkdir()
            (folder / "checkpoint.pt").write_text("model")
            mlflow.log_artifact(str(folder / "checkpoint.pt"), "checkpoints/epoch_0")
            if metrics is not None:
                (folder / "checkpoint_metrics.json").write_text(metrics)
                mlflow.log_artifact(str(folder / "checkpoint_metrics.json"),
                                    "checkpoints/epoch_0")
        return CheckpointRef(run.info.run_id, 0, "checkpoints/epoch_0/checkpoint.pt")

    dst = str(tmp_path / "dst")
    os.makedirs(dst)
    assert lr_rescale(checkpoint('{"world_size": 4, "epoch": 0}'), dst, 2, store) == 0.5
    assert "does not say" not in capsys.readouterr().err
    for unsaid in (None, '{"loss": 1.0, "epoch": 0}'):
        assert lr_rescale(checkpoint(unsaid), dst, 2, store) == 1.0
        assert ("the checkpoint of epoch 0 does not say how many ranks wrote it: its learning "
                "rate is restored as it was saved") in capsys.readouterr().err
    broken = checkpoint("{not json")
    with pytest.raises(TrackingError, match=(
            r"^could not read checkpoints/epoch_0/checkpoint_metrics.json of run "
            rf"{broken.run_id}, which says how many ranks wrote the checkpoint \(to rescale "
            r"its learning rate for 2\): JSONDecodeError")):
        lr_rescale(broken, dst, 2, store)

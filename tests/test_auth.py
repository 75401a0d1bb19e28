"""Tracking servers that check who calls: MLflow's basic-auth app, TLS with a private CA.
The driver's MLflow client settings reach rank 0 (over the job's channel) and no other rank;
a refusal comes before training."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import digits_torch
import mlflow
import pytest
import workers
from services import ADMIN_PASSWORD, start_mlflow_server, stop_group

from mlflow_hvd import HorovodRunner, JobConfig, TrackingConfig, TrackingError
from mlflow_hvd.sweep import sweep

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_mlflow_server("127.0.0.1", tmp_path_factory.mktemp("auth-server"),
                                    auth=True)
    try:
        yield url
    finally:
        stop_group(proc)


@pytest.fixture()
def as_admin(auth_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The driver (this process) logs in as the server's admin."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN_PASSWORD)
    mlflow.set_tracking_uri(auth_server)
    return auth_server


def test_only_rank_0_gets_the_drivers_credentials_and_the_run_has_its_artifacts(
    as_admin: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARTIFACT_STORE_KEY", "k3y")  # opted in with tracking_env
    runner = HorovodRunner(np=-2, tracking=TrackingConfig(tracking_env=["ARTIFACT_STORE_KEY"]))
    assert runner.run(workers.log_and_hold, seconds=0, extra_var="ARTIFACT_STORE_KEY") == {
        "rank": 0, "password_here": True}
    out = capsys.readouterr().out
    # rank 1's environment did not inherit the driver's, though it runs on the same host
    assert "[0]<log>: password here: True" in out and "[1]<log>: password here: False" in out
    assert "[0]<log>: ARTIFACT_STORE_KEY here: True" in out
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == ADMIN_PASSWORD  # the driver's, intact
    client = mlflow.MlflowClient()
    run = client.get_run(runner.last_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["held"] == 1.0
    assert run.data.tags["mlflow_hvd.rank0_host"]  # rank 0's pre-training write
    assert [a.path for a in client.list_artifacts(run.info.run_id, "held")] == ["held/rank.json"]


def test_a_wrong_password_is_refused_before_any_rank_starts(
    as_admin: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    spark: Any,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong")
    for runner in (HorovodRunner(np=-2), HorovodRunner(np=2, spark=spark)):
        with pytest.raises(TrackingError) as info:
            runner.run(workers.log_and_hold, seconds=0)
        assert str(info.value) == (
            f"the MLflow tracking server {as_admin} refused the credentials of the driver "
            "(HTTP 401). Check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
            "MLFLOW_TRACKING_TOKEN) in the driver's environment: rank 0 gets them from the "
            "driver")
    assert "<log>" not in capsys.readouterr().out  # no rank ran


def test_a_torch_job_resumed_after_a_failure_and_a_sweep_log_through_the_auth_server(
    as_admin: str, tmp_path: Path,
) -> None:
    runner = HorovodRunner(np=-2, job=JobConfig(max_failures=1, stop_grace=2))
    result = runner.run(digits_torch.train, epochs=2, fail_at_epoch=1)
    assert len(set(result["checksums"])) == 1
    client = mlflow.MlflowClient()
    run = client.get_run(runner.last_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.resumed_from"] == f"{run.info.run_id}@epoch_0"
    # epoch 0 from the first attempt, 1 from the second: none repeated, none skipped
    for key in ("loss", "val_loss"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [0, 1]
    assert [m.step for m in client.get_metric_history(run.info.run_id,
                                                      "mlflow_hvd.attempt")] == [0, 1]
    (model_out,) = run.outputs.model_outputs
    # a third process holding the credentials loads the model
    code = ("import mlflow.pytorch, torch; "
            f"m = mlflow.pytorch.load_model('models:/{model_out.model_id}'); "
            "print(tuple(m(torch.zeros(2, 1, 8, 8)).shape))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MLFLOW_TRACKING_URI": as_admin},
                          cwd=tmp_path)
    assert proc.stdout.strip().splitlines()[-1] == "(2, 10)", proc.stderr[-2000:]

    from hyperopt import hp

    result = sweep(digits_torch.train, {"learning_rate": hp.loguniform("lr", -7, -4)},
                   max_evals=2, np=-2, fixed_params={"epochs": 1, "log_model": False})
    assert (result.trials, result.failed_trials) == (2, 0)
    children = client.search_runs(
        [client.get_run(result.parent_run_id).info.experiment_id],
        f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    for child in children:  # each trial's rank 0 wrote its checkpoint
        assert child.data.tags["mlflow.latest_checkpoint_artifact"] == (
            "checkpoints/epoch_0/checkpoint.pt")


def test_a_sweep_whose_user_may_not_update_the_registered_model_is_refused_first(
    as_admin: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The admin owns the registered model; another user (no permission by default) may
    not add versions to it: refused before the first trial, with no run left behind."""
    from hyperopt import hp

    admin = mlflow.MlflowClient()
    admin.create_registered_model("guarded")
    from mlflow.server import get_app_client

    get_app_client("basic-auth", tracking_uri=as_admin).create_user("bob", "bob-password-12")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "bob-password-12")
    marker = tmp_path / "ran"
    with pytest.raises(TrackingError) as info:
        sweep(workers.quadratic_torch_trial, {"x": hp.uniform("x", 0, 1), "y": hp.choice("y", [0])},
              max_evals=1, np=-1, fixed_params={"fail_marker": str(marker)},
              register_model="guarded")
    assert str(info.value) == (
        f"register_model='guarded': the Model Registry at {as_admin} refused the driver's user "
        "(HTTP 403): it may not create or update the registered model 'guarded'. Ask its "
        "owner or an admin for EDIT (or MANAGE) permission on it, or choose another name. "
        "No trial was run.")
    assert not marker.exists()
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN_PASSWORD)
    assert not admin.search_runs([admin.get_experiment_by_name("Default").experiment_id],
                                 "tags.`mlflow_hvd.sweep.role` = 'parent' and "
                                 "params.max_evals = '1'")
    assert not admin.search_model_versions("name = 'guarded'")


def test_credentials_are_sealed_and_never_shown() -> None:
    from mlflow_hvd.protocol.credentials import Credentials, seal, unseal

    creds = Credentials((("MLFLOW_TRACKING_PASSWORD", "s3cret"),),
                        (("MLFLOW_TRACKING_SERVER_CERT_PATH", b"PEM"),))
    assert "s3cret" not in repr(creds) and "PEM" not in repr(creds)
    sealed = seal(b"k" * 32, creds)
    assert b"s3cret" not in sealed.data and "s3cret" not in repr(sealed)
    assert unseal(b"k" * 32, sealed) == creds
    from cryptography.exceptions import InvalidTag

    with pytest.raises(InvalidTag):  # another job's secret opens nothing
        unseal(b"x" * 32, sealed)


def test_tracking_env_must_name_variables() -> None:
    from mlflow_hvd import ConfigurationError

    with pytest.raises(ConfigurationError) as info:
        HorovodRunner(np=-2,
            tracking=TrackingConfig(tracking_env="AWS_ACCESS_KEY_ID"))  # type: ignore[arg-type]
    assert str(info.value) == (
        "tracking_env must be a list of environment variable names, e.g. "
        "['AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY'], got 'AWS_ACCESS_KEY_ID'")

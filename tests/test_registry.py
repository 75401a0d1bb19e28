"""A sweep's best model in the MLflow Model Registry: a version with tags, the alias
``champion`` moved only by a better trial, refusals before the first trial."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers
from hyperopt import hp

from mlflow_hvd.errors import ConfigurationError, TrackingError
from mlflow_hvd.sweep import sweep

SPACE = {"x": hp.uniform("x", 0.0, 1.0)}


def _load_weight(uri: str, tracking_uri: str, cwd: Path) -> float:
    """The one weight of the torch model at ``uri``, loaded by another process."""
    code = ("import mlflow.pytorch; "
            f"m = mlflow.pytorch.load_model({uri!r}); print(float(m.weight.item()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=cwd,
                          env={**os.environ, "MLFLOW_TRACKING_URI": tracking_uri})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_best_trial_is_registered_and_only_a_better_one_moves_the_alias(
    store: str, tmp_path: Path
) -> None:
    client = mlflow.MlflowClient()
    first = sweep(workers.model_trial, SPACE, max_evals=2, np=-2, seed=3,
                  register_model="quadratic")
    assert (first.registered_version, first.registered_uri) == (
        "1", "models:/quadratic@champion")
    version = client.get_model_version_by_alias("quadratic", "champion")
    assert str(version.version) == "1"
    assert version.run_id == first.best_run_id
    assert version.tags == {
        "mlflow_hvd.sweep.run_id": first.parent_run_id,
        "mlflow_hvd.sweep.trial_run_id": first.best_run_id,
        "mlflow_hvd.sweep.metric": "val_loss",
        "mlflow_hvd.sweep.metric_value": repr(first.best_loss),
    }
    parent = client.get_run(first.parent_run_id)
    assert parent.data.tags["mlflow_hvd.sweep.registered_model"] == "quadratic/1"
    # another process loads the champion: it is the best trial's model (its weight is x)
    best_x = first.best_params["x"]
    assert first.best_loss == pytest.approx(best_x, abs=1e-6)
    assert _load_weight("models:/quadratic@champion", store, tmp_path) == pytest.approx(
        best_x, abs=1e-6)

    # resumed with a better third trial (x - 10 < every x in [0, 1]): version 2, alias moved
    better = sweep(workers.model_trial, SPACE, max_evals=3, np=-2, seed=3,
                   parent_run_id=first.parent_run_id, fixed_params={"offset": -10.0},
                   register_model="quadratic")
    assert better.trials == 3 and better.best_loss < 0
    assert (better.registered_version, better.registered_uri) == (
        "2", "models:/quadratic@champion")
    champion = client.get_model_version_by_alias("quadratic", "champion")
    assert (str(champion.version), champion.run_id) == ("2", better.best_run_id)
    assert _load_weight("models:/quadratic@champion", store, tmp_path) == pytest.approx(
        better.best_params["x"], abs=1e-6)

    # resumed with a worse fourth trial: no new version, the alias stays on version 2
    worse = sweep(workers.model_trial, SPACE, max_evals=4, np=-2, seed=3,
                  parent_run_id=first.parent_run_id, fixed_params={"offset": 10.0},
                  register_model="quadratic")
    assert worse.trials == 4 and worse.best_run_id == better.best_run_id
    assert worse.registered_version == "2"
    assert [str(v.version) for v in client.search_model_versions("name = 'quadratic'")] == [
        "2", "1"]
    assert str(client.get_model_version_by_alias("quadratic", "champion").version) == "2"


def _no_runs() -> bool:
    return not mlflow.search_runs(search_all_experiments=True, output_format="list")


def test_a_store_without_a_registry_is_refused_before_the_first_trial(
    store: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "ftp://registry.example")
    marker = tmp_path / "ran"
    with pytest.raises(TrackingError) as info:
        sweep(workers.quadratic_torch_trial, {"x": SPACE["x"], "y": hp.choice("y", [0])},
              max_evals=1, np=-1, fixed_params={"fail_marker": str(marker)},
              register_model="quadratic")
    message = str(info.value)
    assert message.startswith(
        "register_model='quadratic': the MLflow store ftp://registry.example has no Model "
        "Registry (Model Registry features are not supported by the store with URI: "
        "'ftp://registry.example'.")
    assert "Set MLFLOW_REGISTRY_URI" in message and message.endswith("No trial was run.")
    assert not marker.exists() and _no_runs()


@pytest.mark.parametrize("name", ["", "  ", 3])
def test_register_model_must_name_a_model(store: str, name: Any) -> None:
    with pytest.raises(ConfigurationError, match="register_model must be the name of a "
                                                 "registered model"):
        sweep(workers.quadratic_torch_trial, {"x": SPACE["x"], "y": hp.choice("y", [0])},
              max_evals=1, np=-1, register_model=name)
    assert _no_runs()


@pytest.mark.ranks
def test_a_trial_without_a_model_fails_the_registration_and_says_how_to_resume(
    store: str,
) -> None:
    with pytest.raises(TrackingError) as info:
        sweep(workers.quadratic_torch_trial, {"x": SPACE["x"], "y": hp.choice("y", [0])},
              max_evals=1, np=-1, register_model="nomodel")
    message = str(info.value)
    assert "logged no model, so there is nothing to register" in message
    assert "resume the sweep with parent_run_id=" in message
    # the trials are saved: the parent is FAILED, not lost, and no version was made
    client = mlflow.MlflowClient()
    (parent,) = [r for r in mlflow.search_runs(search_all_experiments=True, output_format="list")
                 if r.data.tags.get("mlflow_hvd.sweep.role") == "parent"]
    assert parent.info.status == "FAILED"
    assert "hyperopt" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert not client.search_model_versions("name = 'nomodel'")

    # as the message says: a model logged into the best trial's run, then a resume registers
    # it without running a trial
    import torch
    from mlflow import pytorch as mlflow_pytorch

    best = parent.data.tags["mlflow_hvd.sweep.best_run_id"]
    assert f"log a model into run {best}" in message
    mlflow_pytorch.log_model(torch.nn.Linear(1, 1), name="model", run_id=best,
                             input_example=torch.zeros(1, 1).numpy())
    resumed = sweep(workers.takes_anything, {"x": SPACE["x"], "y": hp.choice("y", [0])},
                    max_evals=1, np=-1, parent_run_id=parent.info.run_id,
                    register_model="nomodel")
    assert (resumed.trials, resumed.best_run_id, resumed.registered_version) == (1, best, "1")
    assert len(_children(parent.info.run_id)) == 1


def _children(parent_id: str) -> list[Any]:
    return mlflow.search_runs(search_all_experiments=True, output_format="list",
                              filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")

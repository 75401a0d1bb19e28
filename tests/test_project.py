"""The MLflow project: `mlflow run` as a real subprocess, from here and from a copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import digits_keras
import mlflow
import numpy as np
import pytest
from conftest import REPO


def _mlflow_run(project: Path, cwd: Path, uri: str, *params: str,
                entry: str = "main") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["MLFLOW_TRACKING_URI"] = uri
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    cmd = [sys.executable, "-m", "mlflow", "run", str(project), "-e", entry,
           "--env-manager", "local"]
    for p in params:
        cmd += ["-P", p]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _copy_project(dest: Path) -> None:
    """The project as a user's checkout holds it: no venvs, caches or stores."""
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "__pycache__", "*.db", "mlruns", ".*_cache", "*.egg-info"))


def _only_run(uri: str) -> Any:
    mlflow.set_tracking_uri(uri)
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    return run


def _check_trained_run(run: Any) -> None:
    client = mlflow.MlflowClient()
    assert run.info.status == "FINISHED"
    assert run.data.params["np"] == "2" and run.data.params["epochs"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [0, 1]
    ckpts = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert ckpts == ["checkpoints/epoch_0", "checkpoints/epoch_1"]
    assert run.data.tags["mlflow_hvd.backend"] == "spark"
    (model_out,) = run.outputs.model_outputs
    model = mlflow.pyfunc.load_model(f"models:/{model_out.model_id}")
    _, _, x_test, y_test = digits_keras.load_data()
    accuracy = float((np.asarray(model.predict(x_test)).argmax(1) == y_test).mean())
    assert accuracy > 0.5, accuracy  # ten classes: chance is 0.1


@pytest.mark.new_end
@pytest.mark.old_end
@pytest.mark.slow
def test_mlflow_run_trains_on_two_spark_ranks_from_a_copy_in_another_directory(
    tmp_path: Path,
) -> None:
    """The project as a user gets it (a checkout anywhere), run from a third directory."""
    copy = tmp_path / "project-copy"
    _copy_project(copy)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    uri = f"sqlite:///{tmp_path}/other.db"
    proc = _mlflow_run(copy, elsewhere, uri, "np=2", "epochs=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test accuracy" in proc.stdout
    _check_trained_run(_only_run(uri))
    assert not (elsewhere / "mlflow.db").exists()


def test_bad_parameters_are_refused_together_before_any_job(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = _mlflow_run(REPO, REPO, uri, "np=0", "learning_rate=-0.1", "data=/no/such/dir")
    assert proc.returncode != 0
    problems = proc.stderr.split("invalid parameters:\n", 1)[1].splitlines()[:3]
    assert [p.strip() for p in problems] == [
        "np=0 is not a valid number of processes: use np=-N for N processes on the driver "
        "(np=-1 to test on one process first), np=N for N Spark barrier tasks",
        "learning_rate=-0.1: must be a positive number",
        "data='/no/such/dir': no such file or directory; pass 'digits', the path of a "
        "Parquet or Delta data set, or a table name",
    ]
    assert "log4j" not in proc.stderr  # no Spark session was started
    run = _only_run(uri)
    assert run.info.status == "FAILED"  # never left RUNNING


@pytest.mark.slow
def test_mlflow_run_of_the_sweep_entry_point_on_local_ranks(tmp_path: Path) -> None:
    """`mlflow run . -e sweep -P prune=median` as documented, here on two local ranks
    (np=-2): a parent run with four nested trials on the same warm ranks, Keras' fit
    stopped by MlflowCallback in the one trial whose learning rate cannot learn."""
    uri = f"sqlite:///{tmp_path}/sweep.db"
    space = tmp_path / "space.json"
    # seed 2 samples 0.01 for trials 0-2 and 1e-6 for trial 3 (hyperopt's TPE draws its
    # first 20 trials at random)
    space.write_text(json.dumps({"learning_rate": ["choice", [0.01, 1e-6]],
                                 "batch_size": ["choice", [32]]}))
    proc = _mlflow_run(REPO, tmp_path, uri, "max_evals=4", "np=-2", "epochs=2", "seed=2",
                       f"space={space}", "prune=median", entry="sweep")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 pruned, 7 epochs trained, 1 saved" in proc.stdout, proc.stdout[-2000:]
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    (parent,) = [r for r in runs if r.data.tags.get("mlflow_hvd.sweep.role") == "parent"]
    children = sorted((r for r in runs if r is not parent),
                      key=lambda r: int(r.data.tags["mlflow_hvd.sweep.trial"]))
    assert parent.info.status == "FINISHED"
    assert parent.data.params["max_evals"] == "4" and parent.data.params["np"] == "-2"
    assert parent.data.params["prune"] == "median"
    assert [c.data.tags["mlflow_hvd.sweep.trial"] for c in children] == ["0", "1", "2", "3"]
    assert [c.data.tags["mlflow.parentRunId"] for c in children] == [parent.info.run_id] * 4
    assert [c.info.status for c in children] == ["FINISHED"] * 4
    assert {c.data.tags["mlflow_hvd.backend"] for c in children} == {"local"}
    assert [c.data.params["learning_rate"] for c in children] == ["0.01"] * 3 + ["1e-06"]
    assert [c.data.tags.get("mlflow_hvd.sweep.pruned_at_epoch") for c in children] == [
        None, None, None, "1"]
    for child in children:
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "val_loss")]
        assert steps == ([0, 1] if child is not children[3] else [0])
    assert children[3].outputs is None or not children[3].outputs.model_outputs  # skipped
    assert parent.data.metrics["trials_pruned"] == 1
    assert parent.data.metrics["epochs_saved"] == 1
    losses = {c.info.run_id: c.data.metrics["val_loss"] for c in children[:3]}
    best = min(losses, key=losses.__getitem__)
    assert parent.data.tags["mlflow_hvd.sweep.best_run_id"] == best
    assert parent.data.metrics["best_val_loss"] == pytest.approx(losses[best])
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"loss_per_trial.png", "search_space.json", "hyperopt"} <= arts


@pytest.mark.slow
def test_mlflow_run_of_the_fsdp_example_on_two_spark_ranks_from_parquet(
        tmp_path: Path) -> None:
    """`mlflow run . -P np=2 -P train=examples/digits_fsdp.py:train -P data=<parquet>`: a
    torch.distributed entry point (FSDP2: the model sharded over the ranks). Spark reads the
    data set, each rank trains on its own partition (and validates on its own part of the
    15% held out); per-epoch metrics, checkpoints (gathered to rank 0), the model logged
    whole and both DataFrames as dataset inputs in the run."""
    import digits_to_parquet

    data = tmp_path / "digits_parquet"
    rows = digits_to_parquet.write(str(data), files=3)
    uri = f"sqlite:///{tmp_path}/torch.db"
    proc = _mlflow_run(REPO, tmp_path, uri, "np=2", "epochs=2",
                       "train=examples/digits_fsdp.py:train", f"data={data}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test accuracy" in proc.stdout
    run = _only_run(uri)
    client = mlflow.MlflowClient()
    assert run.info.status == "FINISHED"
    assert run.data.params["framework"] == "pytorch-fsdp2" and run.data.params["np"] == "2"
    for key in ("loss", "val_loss", "val_accuracy"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [0, 1]
    ckpts = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert ckpts == ["checkpoints/epoch_0", "checkpoints/epoch_1"]
    assert run.data.tags["mlflow_hvd.backend"] == "spark"
    (model_out,) = run.outputs.model_outputs
    flavors = mlflow.models.get_model_info(f"models:/{model_out.model_id}").flavors
    assert "pytorch" in flavors
    inputs = {d.dataset.name: json.loads(d.dataset.profile)["num_rows"]
              for d in client.get_run(run.info.run_id).inputs.dataset_inputs}
    assert set(inputs) == {"data", "val"} and sum(inputs.values()) == rows
    assert json.loads(client.get_run(run.info.run_id).inputs.dataset_inputs[0].dataset
                      .source)  # where the rows came from
    assert run.data.params["shard_size"] == run.data.tags["mlflow_hvd.data.data.rows_per_rank"]

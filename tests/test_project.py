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

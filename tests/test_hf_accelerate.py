"""Hugging Face's ``Trainer`` (examples/digits_hf.py) and an Accelerate loop
(examples/digits_accelerate.py) as their docs write them, on the session's local-cluster:
their own MLflow logging (``report_to=["mlflow"]``, Accelerate's ``log_with="mlflow"``)
lands in the job's one run from rank 0, and ``Trainer``'s checkpoints, kept in the run,
resume a retried attempt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import digits_accelerate
import digits_hf
import digits_to_parquet
import mlflow
import pytest

from mlflow_hvd import HorovodRunner, JobConfig, TorchDistributor


def _steps(client: Any, run_id: str, key: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


@pytest.mark.slow
def test_a_trainer_under_torchdistributor_resumes_its_checkpoint_after_a_failure(
        spark: Any, store: str) -> None:
    """TorchDistributor(num_processes=2, local_mode=False), max_failures=1: rank 1 fails
    after the first epoch's checkpoint (Trainer's directory, each rank's RNG state
    gathered into it, in the run); the retry's Trainer resumes from it and trains the
    second epoch only. One FINISHED run: Trainer's arguments and the model's config as
    params, each epoch's loss once, the attempts recorded."""
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False,
                                   job=JobConfig(max_failures=1))
    out = distributor.run(digits_hf.train, 2, fail_first_attempt=True)
    assert (out["attempt"], out["start_epoch"], out["world_size"]) == (1, 1, 2), out
    assert len(set(out["weights"])) == 1, out["weights"]  # DDP kept the ranks equal
    assert out["eval_accuracy"] > 0.2, out  # chance: 0.1
    client = mlflow.MlflowClient()
    run_id = distributor.runner.last_run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert (params["num_train_epochs"], params["save_strategy"]) == ("2", "epoch"), params
    assert (params["hidden_size"], params["num_hidden_layers"]) == ("64", "2")  # its config
    assert run.data.tags["mlflow_hvd.resumed_from"] == f"{run_id}@epoch_0"
    assert [m.value for m in client.get_metric_history(run_id, "mlflow_hvd.attempt")] == [
        0.0, 1.0]
    steps = _steps(client, run_id, "loss")  # per epoch, at Trainer's global step
    assert len(steps) == 2 and steps == sorted(set(steps)), steps
    assert _steps(client, run_id, "eval_accuracy") == steps
    (ckpt,) = [a.path for a in client.list_artifacts(run_id, "checkpoints/epoch_0")
               if a.is_dir]
    files = {a.path.rsplit("/", 1)[1] for a in client.list_artifacts(run_id, ckpt)}
    # rank 0's model, optimizer and scheduler, and both ranks' RNG states
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
            "rng_state_0.pth", "rng_state_1.pth"} <= files, files
    assert run.data.tags["mlflow.latest_checkpoint_artifact"].startswith(
        "checkpoints/epoch_1/checkpoint-")
    (only,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert only.info.run_id == run_id  # Trainer's MLflowCallback made no run of its own


@pytest.mark.slow
def test_an_accelerate_loop_trains_on_spark_ranks_from_a_dataframe(
        spark: Any, store: str, tmp_path: Path) -> None:
    """Accelerator() with prepare and backward on 2 Spark ranks, each rank's own rows of
    a DataFrame as its loader; Accelerate's MLflow tracker writes the config and each
    epoch's metrics into the job's run, once."""
    digits_to_parquet.write(str(tmp_path / "digits"), files=3)
    frame = spark.read.parquet(str(tmp_path / "digits"))
    runner = HorovodRunner(np=2, spark=spark)
    out = runner.run(digits_accelerate.train, epochs=2, data=frame)
    assert (out["processes"], out["main"]) == (2, True), out
    assert len(set(out["weights"])) == 1, out["weights"]
    assert out["test_accuracy"] > 0.3, out
    client = mlflow.MlflowClient()
    run = client.get_run(runner.last_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"epochs": "2", "batch_size": "32", "learning_rate": "0.001",
                               "processes": "2"}
    for key in ("loss", "test_loss", "test_accuracy"):
        assert _steps(client, run.info.run_id, key) == [0, 1], key
    assert client.get_metric_history(run.info.run_id, "test_accuracy")[-1].value == \
        pytest.approx(out["test_accuracy"])
    assert run.data.tags["mlflow_hvd.data.data.rows_per_rank"]  # the DataFrame was sharded
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [run.info.run_id]  # the tracker's is the job's


@pytest.mark.slow
def test_mlflow_run_trains_the_accelerate_example(tmp_path: Path) -> None:
    """`mlflow run . -P np=-2 -P train=examples/digits_accelerate.py:train`: the project's
    entry point runs a framework's loop as it runs its own examples; the entry point's
    parameters join Accelerate's config in the one run."""
    from conftest import REPO
    from test_project import _mlflow_run, _only_run

    uri = f"sqlite:///{tmp_path}/accelerate.db"
    proc = _mlflow_run(REPO, tmp_path, uri, "np=-2", "epochs=2",
                       "train=examples/digits_accelerate.py:train")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test accuracy" in proc.stdout
    run = _only_run(uri)
    assert run.info.status == "FINISHED"
    assert (run.data.params["processes"], run.data.params["np"]) == ("2", "-2")
    assert run.data.params["data"] == "digits"
    client = mlflow.MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1]
    assert run.data.tags["mlflow_hvd.backend"] == "local"

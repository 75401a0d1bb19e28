"""PyTorch code written through a framework over torch.distributed, as the framework's own
docs write it: PyTorch Lightning (examples/digits_lightning.py) under HorovodRunner on Spark
ranks and under TorchDistributor in the form Databricks' TorchDistributor page gives it,
with its MLflow logging (``mlflow.pytorch.autolog()``, ``MLFlowLogger()``) landing in the
job's one run from rank 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import digits_lightning
import digits_to_parquet
import mlflow
import pytest

from mlflow_hvd import HorovodRunner, JobConfig, TorchDistributor


def _metric_steps(client: Any, run_id: str, key: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


@pytest.mark.slow
def test_a_lightning_module_trains_on_spark_ranks_from_a_dataframe_with_mlflow_autolog(
        spark: Any, store: str, tmp_path: Path) -> None:
    """Trainer(strategy="ddp") on 2 Spark ranks (one host: devices=2 of one node), each
    rank's own rows of a DataFrame as its DataLoader; autolog's params, per-epoch metrics,
    best checkpoint and model in the job's run, logged once (rank 0 alone)."""
    rows = digits_to_parquet.write(str(tmp_path / "digits"), files=3)
    frame = spark.read.parquet(str(tmp_path / "digits"))
    runner = HorovodRunner(np=2, spark=spark)
    out = runner.run(digits_lightning.train, epochs=2, data=frame,
                     run_params={"np": 2, "rows": rows})
    assert (out["devices"], out["num_nodes"]) == (2, 1)
    assert len(set(out["weights"])) == 1, out["weights"]  # DDP kept the ranks equal
    assert out["val_accuracy"] > 0.3 and out["test_accuracy"] > 0.3  # chance: 0.1
    client = mlflow.MlflowClient()
    run = client.get_run(runner.last_run_id)
    assert run.info.status == "FINISHED"
    assert {"np", "rows", "epochs", "optimizer_name", "lr"} <= set(run.data.params)
    assert run.data.params["optimizer_name"] == "Adam"
    for key in ("loss", "val_loss", "val_accuracy"):  # once per epoch: rank 0's only
        assert _metric_steps(client, run.info.run_id, key) == [0, 1], key
    assert _metric_steps(client, run.info.run_id, "test_accuracy") == [1]
    saved = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert saved, "autolog(checkpoint=True) logged no checkpoint"
    (model_out,) = run.outputs.model_outputs
    model = mlflow.pytorch.load_model(f"models:/{model_out.model_id}")
    assert sum(float(p.detach().sum()) for p in model.parameters()) == pytest.approx(
        out["weights"][0], rel=1e-5)
    assert run.data.tags["mlflow_hvd.data.data.rows_per_rank"]  # the DataFrame was sharded


@pytest.mark.slow
def test_lightning_in_databricks_torchdistributor_form_logs_through_mlflowlogger(
        spark: Any, store: str) -> None:
    """TorchDistributor(num_processes=2, local_mode=False, use_gpu=False): every task a
    node of one process, so the Trainer is Databricks' ``devices=1, num_nodes=2``
    (Lightning indexes its devices by LOCAL_RANK); Lightning's ``MLFlowLogger()`` writes
    its hyperparameters and metrics into the job's run. With ``max_failures=1``, rank 1
    fails after the first epoch's checkpoint (Lightning's, put into the run): the retry's
    ``fit(ckpt_path=...)`` resumes at the second epoch, each epoch's metrics once."""
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False,
                                   job=JobConfig(max_failures=1))
    out = distributor.run(digits_lightning.train, 2, logger="mlflow", fail_first_attempt=True)
    assert (out["devices"], out["num_nodes"]) == (1, 2)
    assert len(set(out["weights"])) == 1, out["weights"]
    # rank 1 failed after epoch 0's checkpoint: the retry resumed from it (ckpt_path)
    assert (out["attempt"], out["start_epoch"]) == (1, 1), out
    client = mlflow.MlflowClient()
    run = client.get_run(distributor.runner.last_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.resumed_from"] == f"{run.info.run_id}@epoch_0"
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints/epoch_1")
            if a.path.endswith(".ckpt")] == ["checkpoints/epoch_1/epoch=1.ckpt"]
    assert run.data.params["learning_rate"] == "0.001"  # the module's save_hyperparameters
    val_steps = _metric_steps(client, run.info.run_id, "val_loss")
    assert len(val_steps) == 2 and val_steps == sorted(set(val_steps))  # one per epoch
    assert client.get_metric_history(run.info.run_id, "test_accuracy")[0].value == \
        pytest.approx(out["test_accuracy"])
    (only,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert only.info.run_id == run.info.run_id  # MLFlowLogger made no run of its own

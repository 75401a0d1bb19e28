"""PyTorch training functions (horovod.torch) under HorovodRunner: rank-0 tracking,
checkpoints, a model another process loads, MLflow's own API. (A retried job resumed from
its checkpoint and a sweep of torch trials: tests/test_auth.py; 4 Spark ranks on two hosts:
tests/test_cluster.py; `mlflow run` of the example: tests/test_project.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import digits_torch
import mlflow
import pytest
import workers
from conftest import REPO

from mlflow_hvd import HorovodRunner, JobConfig, WorkerFailedError

pytestmark = pytest.mark.slow


def _load_in_another_process(model_uri: str, cwd: Path) -> float:
    """Test accuracy of the logged model, loaded by ``mlflow.pytorch`` in a fresh Python
    that has no copy of the examples (cwd elsewhere, no path to them)."""
    code = f"""
import json, sys
import mlflow.pytorch, numpy as np, torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
assert not any("examples" in p for p in sys.path)
digits = load_digits()
x = (digits.images / 16.0).astype("float32")[:, None]
_, x_test, _, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=0,
                                        stratify=digits.target)
model = mlflow.pytorch.load_model({model_uri!r})
with torch.no_grad():
    pred = model(torch.from_numpy(x_test)).argmax(1).numpy()
print(json.dumps(float((pred == y_test).mean())))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def _model_files(model_id: str) -> list[str]:
    client = mlflow.MlflowClient()
    location = client.get_logged_model(model_id).artifact_location
    return sorted(os.path.basename(a.path) for a in mlflow.artifacts.list_artifacts(
        f"{location}/data"))


@pytest.mark.new_end
def test_horovod_torch_collectives_are_exact_and_its_optimizer_keeps_ranks_equal(
    warm_ranks: Any,
) -> None:
    """horovod.torch as built here (against PyTorch's CPU build in the main environment, its
    CUDA build for CPU tensors in the new end's): exact collectives, and two ranks that see
    different data end every step with the same weights."""
    out = warm_ranks.run(workers.torch_collectives, steps=3)
    assert out["size"] == 2
    assert (out["sum"], out["mean"], out["broadcast"]) == ([3.0], [0.5], [100.0])
    assert out["gathered"] == [0, 1, 10, 11]
    first, second = out["initial"]
    assert first != second  # each rank drew its own weights ...
    assert out["broadcast_initial"] == [first, first]  # ... and took rank 0's
    losses_0, losses_1 = out["losses"]
    assert all(a != b for a, b in zip(losses_0, losses_1, strict=True))  # its own data
    weights_0, weights_1 = out["weights"]
    assert weights_0 == weights_1  # averaged gradients: the same step everywhere
    assert weights_0 != first  # and training moved them


@pytest.mark.new_end
def test_a_torch_job_that_fails_resumes_from_its_last_checkpoint(store: str) -> None:
    """Rank 1 raises at the start of epoch 1 on the first attempt; the second attempt loads
    rank 0's checkpoint of epoch 0 (model and optimizer) and goes on: no epoch lost or
    logged twice, the ranks equal at the end."""
    runner = HorovodRunner(np=-2, job=JobConfig(max_failures=1, stop_grace=2))
    result = runner.run(digits_torch.train, epochs=2, fail_at_epoch=1, log_model=False)
    assert len(result["checksums"]) == 2 and len(set(result["checksums"])) == 1
    client = mlflow.MlflowClient()
    run_id = str(runner.last_run_id)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.resumed_from"] == f"{run_id}@epoch_0"
    for key in ("loss", "val_loss"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [0, 1], key
    assert [m.step for m in client.get_metric_history(run_id, "mlflow_hvd.attempt")] == [0, 1]
    assert [(m.step, m.value) for m in client.get_metric_history(
        run_id, "mlflow_hvd.world_size")] == [(0, 2.0), (1, 2.0)]
    assert run.data.tags["mlflow.latest_checkpoint_artifact"] == (
        "checkpoints/epoch_1/checkpoint.pt")


def test_code_written_for_horovod_elastic_is_refused_naming_the_way_that_works(
        store: str) -> None:
    """``@hvd.elastic.run`` cannot keep its in-memory state across a lost host under
    barrier tasks: the job ends at once (not restarted, though max_failures allows it), with
    min_np and the checkpoint functions named; the run FAILED."""
    from mlflow_hvd.errors import ConfigurationError

    runner = HorovodRunner(np=-2, job=JobConfig(max_failures=2))
    with pytest.raises(ConfigurationError) as info:
        runner.run(workers.horovod_elastic_loop)
    message = str(info.value)
    assert message.startswith("Horovod elastic (hvd.elastic.run, hvd.elastic.TorchState/"
                              "KerasState, state.commit()) does not run under HorovodRunner")
    assert "JobConfig(min_np=..., max_failures=...)" in message
    assert "mlflow_hvd.keras.restore_from_checkpoint" in message
    run = mlflow.MlflowClient().get_run(runner.last_run_id)
    assert run.info.status == "FAILED"
    attempts = mlflow.MlflowClient().get_metric_history(run.info.run_id, "mlflow_hvd.attempt")
    assert [m.step for m in attempts] == [0]  # not restarted


def test_two_local_ranks_train_as_one_and_log_checkpoints_and_a_model_another_process_loads(
    store: str, warm_ranks: Any, tmp_path: Path
) -> None:
    result = warm_ranks.run(digits_torch.train, epochs=2)
    assert len(result["checksums"]) == 2 and len(set(result["checksums"])) == 1  # identical
    client = mlflow.MlflowClient()
    run_id = warm_ranks.last_run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for key in ("loss", "val_loss", "val_accuracy"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [0, 1], key
    assert run.data.params["framework"] == "pytorch" and run.data.params["hvd_size"] == "2"
    # the shards are equal: 1347 * 0.85 = 1144 rows, 572 per rank
    assert run.data.params["shard_size"] == "572"
    assert run.data.tags["mlflow.latest_checkpoint_artifact"] == (
        "checkpoints/epoch_1/checkpoint.pt")
    files = {a.path for a in client.list_artifacts(run_id, "checkpoints/epoch_0")}
    assert files == {"checkpoints/epoch_0/checkpoint.pt",
                     "checkpoints/epoch_0/checkpoint_metrics.json"}
    (model_out,) = run.outputs.model_outputs
    assert model_out.step == 1
    assert _model_files(model_out.model_id) == ["model.pt2"]  # an input example: torch.export
    logged = client.get_logged_model(model_out.model_id)
    reqs = Path(mlflow.artifacts.download_artifacts(
        f"{logged.artifact_location}/requirements.txt")).read_text().split()
    assert "torch==2.13.0+cpu" in reqs
    accuracy = _load_in_another_process(f"models:/{model_out.model_id}", tmp_path)
    assert accuracy == pytest.approx(result["test_accuracy"], abs=1e-6)
    assert accuracy > 0.5  # ten classes: chance is 0.1


def test_mlflows_own_pytorch_api_logs_from_rank_0_only(store: str, warm_ranks: Any) -> None:
    result = warm_ranks.run(workers.torch_with_mlflows_own_api)
    run_id = warm_ranks.last_run_id
    assert result["rank"] == 0 and result["size"] == 2 and result["run"] == run_id
    run = mlflow.MlflowClient().get_run(run_id)
    assert run.data.params == {"layers": "1"}
    # rank 1's log_model calls were dropped: rank 0's two models only
    assert {m.model_id for m in run.outputs.model_outputs} == {result["model_id"],
                                                               result["pickled_id"]}
    import torch  # not at the top: the old-end environment (no torch) collects this module

    assert _model_files(result["model_id"]) == ["model.pt2"]  # MLflow's default format
    linear = mlflow.pytorch.load_model(f"models:/{result['model_id']}")
    assert tuple(linear(torch.zeros(3, 4)).shape) == (3, 2)
    # no example: the pickle format, the class defined in the function by value
    assert "model.pth" in _model_files(result["pickled_id"])
    doubler = mlflow.pytorch.load_model(f"models:/{result['pickled_id']}")
    assert doubler(torch.ones(2)).tolist() == [2.0, 2.0]


@pytest.mark.parametrize(("latest", "why"), [
    ("checkpoints/epoch_0/checkpoint.keras", "not a PyTorch checkpoint (checkpoint.pt or "
     "checkpoint.dcp); resume it with the framework that wrote it"),
    ("checkpoints/epoch_0/checkpoint.dcp", "a sharded one (torch.distributed.checkpoint): "
     "resume it in a job that calls dist.init_process_group(...), as the one that wrote it "
     "did, not under horovod.torch"),
])
def test_a_checkpoint_another_kind_of_job_wrote_is_refused_before_it_is_read(
        store: str, latest: str, why: str) -> None:
    """A Keras job's checkpoint, and a sharded one (torch.distributed) under horovod.torch:
    named by rank 0 before any download."""
    with mlflow.start_run() as run:  # the run as such a job tags it
        mlflow.set_tag("mlflow.latest_checkpoint_artifact", latest)
        with pytest.raises(WorkerFailedError) as info:
            HorovodRunner(np=-1).run(digits_torch.train, epochs=2, log_model=False)
    assert info.value.root_cause.error == (
        f"ConfigurationError: the latest checkpoint of run {run.info.run_id} is {latest}, "
        + why)


def test_the_example_is_importable_without_torch_on_the_driver() -> None:
    """The driver loads the training function; torch is imported only in the ranks."""
    code = ("import sys; sys.path.insert(0, 'examples'); import digits_torch; "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr

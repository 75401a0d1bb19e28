"""The GPU tier (``make test-gpu``, ``MLFLOW_HVD_TIER=gpu``; deselected in every other tier):
on a machine with NVIDIA GPUs and their driver, in the new end's environment (PyTorch's CUDA
13 build, tensorflow-cpu) with Horovod's NCCL build installed. NCCL collectives exact on CUDA
tensors across the GPUs present; the PyTorch and Keras examples with one GPU per rank
(``np < 0``); Spark's GPU scheduling on ``local-cluster`` with the nvidia-smi discovery
script; ``torch.distributed`` on ``nccl``. Each rank's GPU memory and steps/s are printed.
With one GPU, the multi-rank cases say they need two and run one rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers
from conftest import REPO

from mlflow_hvd import HorovodRunner, JobConfig, TrackingConfig

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    """The GPUs nvidia-smi lists (the driver process never initialises CUDA itself)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.fail("the GPU tier runs on a machine with nvidia-smi: make test-gpu checks it")
    out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return len(out.split())


@pytest.fixture(scope="module")
def ranks() -> int:
    """One rank per GPU; with one GPU, the cases that need two say so."""
    count = _gpus()
    if count < 2:
        warnings.warn("one GPU here: the multi-rank NCCL cases need two and ran one rank",
                      stacklevel=1)
    return count


def test_nccl_collectives_are_exact_on_cuda_tensors_across_the_gpus(ranks: int) -> None:
    views = HorovodRunner(np=-ranks, tracking=TrackingConfig(track=False)).run(
        workers.gpu_collectives)
    n = ranks
    assert len({v["uuid"] for v in views}) == n, views  # one GPU per rank
    for view in views:
        assert view["nccl"] > 0 and view["devices"] == [f"cuda:{view['local_rank']}"], view
        assert view["sum"] == [n * (n + 1) / 2] and view["mean"] == [(n - 1) / 2], view
        assert view["gathered"] == [x for r in range(n) for x in (r * 10, r * 10 + 1)], view
        assert view["broadcast"] == [100.0] and view["big_exact"], view


def test_a_horovod_torch_loop_on_one_gpu_per_rank_prints_memory_and_speed(ranks: int) -> None:
    views = HorovodRunner(np=-ranks, tracking=TrackingConfig(track=False)).run(
        workers.gpu_torch_steps)
    for view in views:
        print(f"rank {view['rank']} on {view['device']}: peak GPU memory "
              f"{view['peak_mib']:.0f} MiB, {view['steps_per_s']:.1f} steps/s")
    assert len({v["uuid"] for v in views}) == ranks
    assert all(v["device"].startswith("cuda") for v in views)
    assert len({v["checksum"] for v in views}) == 1  # NCCL's averages: one model everywhere


def test_the_pytorch_example_trains_on_gpus_tracked_by_rank_0(ranks: int, store: str) -> None:
    import digits_torch  # examples/ is on sys.path (conftest), as for the ranks

    runner = HorovodRunner(np=-ranks, job=JobConfig(stop_grace=2))
    result: dict[str, Any] = runner.run(digits_torch.train, epochs=2)
    assert len(set(result["checksums"])) == 1, result
    run = mlflow.MlflowClient().get_run(str(runner.last_run_id))
    assert run.info.status == "FINISHED"
    assert result["test_accuracy"] > 0.5, result


def test_the_keras_example_runs_with_one_gpu_per_rank(ranks: int, store: str) -> None:
    """Keras computes on the GPU where TensorFlow is a CUDA build; the tier's environment has
    tensorflow-cpu beside PyTorch's CUDA 13 build (TensorFlow 2.21's CUDA build is CUDA 12),
    which the test says."""
    import tensorflow as tf

    if not tf.test.is_built_with_cuda():
        warnings.warn(f"TensorFlow {tf.__version__} here is built without CUDA: the Keras "
                      "example computed on each rank's CPU", stacklevel=1)
    import digits_keras

    runner = HorovodRunner(np=-ranks, job=JobConfig(stop_grace=2))
    result: dict[str, Any] = runner.run(digits_keras.train, epochs=2)
    run = mlflow.MlflowClient().get_run(str(runner.last_run_id))
    assert run.info.status == "FINISHED"
    assert result["test_accuracy"] > 0.5, result


DRIVER = """
import json, sys
from pyspark.sql import SparkSession
from mlflow_hvd import HorovodRunner, TrackingConfig
from mlflow_hvd.backends.spark import jvm
import workers

n = {ranks}
spark = (SparkSession.builder.master(f"local-cluster[1,{{n}},2048]")
         .config("spark.ui.enabled", "false")
         .config("spark.pyspark.python", sys.executable)
         .config("spark.driver.defaultJavaOptions", jvm.driver_java_options())
         .config("spark.worker.resource.gpu.amount", str(n))
         .config("spark.worker.resource.gpu.discoveryScript", {script!r})
         .config("spark.executor.resource.gpu.amount", str(n))
         .config("spark.task.resource.gpu.amount", "1")
         .getOrCreate())
views = HorovodRunner(np=n, spark=spark, tracking=TrackingConfig(track=False)).run(
    workers.gpu_collectives)
print("VIEWS " + json.dumps(views))
spark.stop()
"""


def test_spark_schedules_one_gpu_per_task_with_the_nvidia_smi_discovery_script(
        ranks: int, tmp_path: Path) -> None:
    code = DRIVER.format(ranks=ranks, script=str(REPO / "examples" / "get_gpus_resources.sh"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(
                              None, (str(REPO / "tests"), os.environ.get("PYTHONPATH"))))})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("VIEWS ")]
    views = json.loads(line[len("VIEWS "):])
    assert sorted(v["own"] for v in views) == [str(i) for i in range(ranks)]
    assert len({v["uuid"] for v in views}) == ranks
    for view in views:
        assert view["visible"].split(",")[view["local_rank"]] == view["own"], view
        assert view["sum"] == [ranks * (ranks + 1) / 2] and view["big_exact"], view


def test_torch_distributed_on_nccl_averages_across_the_gpus(ranks: int) -> None:
    views = HorovodRunner(np=-ranks, tracking=TrackingConfig(track=False)).run(
        workers.ddp_on_nccl)
    assert [v["backend"] for v in views] == ["nccl"] * ranks
    assert all(v["sum"] == [ranks * (ranks + 1) / 2] for v in views), views
    assert len({json.dumps(v["weights"]) for v in views}) == 1, views

"""Run inside a fresh environment made by ``pip install "<checkout>[torch]"`` (PyTorch, no
TensorFlow, no Horovod) by tests/test_torch_only.py: what a PyTorch user does first.
DDP and FSDP jobs on local ranks and on a local-cluster Spark session, each into its own
MLflow run of a local SQLite store; a TorchDistributor job; a function that imports
``horovod.torch``. Prints one JSON line, ``RESULT {...}``, that the test reads.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1] / "examples")]

import cloudpickle  # noqa: E402
import digits_fsdp  # noqa: E402
import workers  # noqa: E402

cloudpickle.register_pickle_by_value(workers)  # the ranks do not have tests/ on their path

FOREIGN = ("horovod", "tensorflow")


def loaded() -> list[str]:
    """The modules of Horovod or TensorFlow this process has imported."""
    return sorted(m for m in sys.modules if m.split(".")[0] in FOREIGN)


def ddp(steps: int) -> dict[str, Any]:
    result = workers.ddp_as_pytorch_writes_it(steps=steps)
    return {"world": result["ranks"][0]["world"], "start": result["start"],
            "same_weights": all(r["weights"] == result["ranks"][0]["weights"]
                                for r in result["ranks"]),
            "loaded": loaded()}


def fsdp(epochs: int) -> dict[str, Any]:
    result = digits_fsdp.train(epochs=epochs, sharded_checkpoints=True, log_model=False)
    return {"test_accuracy": result["test_accuracy"], "held": result["held"],
            "full_bytes": result["full_bytes"], "loaded": loaded()}


def with_horovod() -> None:
    import horovod.torch as hvd  # not installed here

    hvd.init()


def main() -> None:
    import mlflow
    from pyspark.sql import SparkSession

    from mlflow_hvd import HorovodRunner, TorchDistributor, WorkerFailedError

    mlflow.set_tracking_uri(f"sqlite:///{os.getcwd()}/mlflow.db")
    out: dict[str, Any] = {}
    runner = HorovodRunner(np=-2)
    out["local_ddp"] = runner.run(ddp, steps=2)
    out["local_ddp_run"] = runner.last_run_id
    out["local_fsdp"] = runner.run(fsdp, epochs=2)
    out["local_fsdp_run"] = runner.last_run_id
    try:
        runner.run(with_horovod)
        out["horovod_error"] = "no error"
    except WorkerFailedError as exc:
        out["horovod_error"] = str(exc)
    out["distributor"] = TorchDistributor(num_processes=2, local_mode=True,
                                          use_gpu=False).run(ddp, 1)
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors run this environment
    spark = (SparkSession.builder.master("local-cluster[2,1,1024]")
             .appName("mlflow_hvd-torch-only").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    try:
        cluster = HorovodRunner(np=2)
        out["spark_ddp"] = cluster.run(ddp, steps=2)
        out["spark_ddp_run"] = cluster.last_run_id
        out["spark_fsdp"] = cluster.run(fsdp, epochs=2)
        out["spark_fsdp_run"] = cluster.last_run_id
    finally:
        spark.stop()
    out["driver_loaded"] = loaded()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

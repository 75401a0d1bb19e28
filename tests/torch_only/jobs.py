"""Run inside a fresh environment made by ``pip install "<checkout>[torch]"`` (PyTorch, no
TensorFlow, no Horovod) by tests/test_torch_only.py: what a PyTorch user does first.
DDP and FSDP jobs on local ranks and on a local-cluster Spark session, each into its own
MLflow run of a local SQLite store: the local FSDP job fails on its first attempt and
resumes from its sharded checkpoint (``JobConfig(max_failures=1)``), the Spark one trains on
a DataFrame's shards; a TorchDistributor job; a function that imports ``horovod.torch``.
Prints one JSON line, ``RESULT {...}``, that the test reads.
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
import digits_to_parquet  # noqa: E402
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


def fsdp(epochs: int, **kwargs: Any) -> dict[str, Any]:
    result = digits_fsdp.train(epochs=epochs, sharded_checkpoints=True, log_model=False,
                               **kwargs)
    return {"test_accuracy": result["test_accuracy"], "held": result["held"],
            "full_bytes": result["full_bytes"], "start": result["start_epoch"],
            "loaded": loaded()}


def with_horovod() -> None:
    import horovod.torch as hvd  # not installed here

    hvd.init()


def main() -> None:
    import mlflow
    from pyspark.sql import SparkSession

    from mlflow_hvd import HorovodRunner, JobConfig, TorchDistributor, WorkerFailedError

    mlflow.set_tracking_uri(f"sqlite:///{os.getcwd()}/mlflow.db")
    out: dict[str, Any] = {}
    runner = HorovodRunner(np=-2)
    out["local_ddp"] = runner.run(ddp, steps=2)
    out["local_ddp_run"] = runner.last_run_id
    retried = HorovodRunner(np=-2, job=JobConfig(max_failures=1))
    out["local_fsdp"] = retried.run(fsdp, epochs=2, fail_at_epoch=1)  # rank 1 fails once
    out["local_fsdp_run"] = retried.last_run_id
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
        rows = digits_to_parquet.write(os.path.abspath("digits_parquet"), files=2)
        data = spark.read.parquet(os.path.abspath("digits_parquet"))
        out["spark_fsdp"] = cluster.run(fsdp, epochs=2, data=data)
        out["spark_fsdp_rows"] = rows
        out["spark_fsdp_run"] = cluster.last_run_id
    finally:
        spark.stop()
    out["driver_loaded"] = loaded()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""GPUs scheduled by Spark: each rank sees the GPUs Spark gave the job's tasks on its host,
ordered by local rank, so the eight-step `gpus[hvd.local_rank()]` picks its own task's.
Spark's GPU scheduling is exercised without GPUs: a discovery script hands out addresses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

from mlflow_hvd import ClusterConfig
from mlflow_hvd.common.layout import Devices, assign_slots, visible_devices


def test_each_host_lists_its_gpus_by_local_rank() -> None:
    slots = assign_slots(["a", "b", "a", "b"])  # tasks 0 and 2 on a, 1 and 3 on b
    addresses = [["7"], ["0"], ["3"], ["5"]]
    views = [visible_devices(slots, addresses, t) for t in range(4)]
    for task, view in enumerate(views):
        assert view.own == tuple(addresses[task])
        assert view.visible[slots[task].local_rank] == addresses[task][0]  # gpus[local_rank]
    assert views[0].visible == views[2].visible == ("7", "3")
    assert views[1].visible == views[3].visible == ("0", "5")


def test_several_gpus_per_task_put_each_ranks_first_at_its_local_rank() -> None:
    slots = assign_slots(["a", "a"])
    view = visible_devices(slots, [["0", "1"], ["2", "3"]], 1)
    assert view == Devices(("0", "2", "1", "3"), ("2", "3"))
    assert view.env() == {"CUDA_VISIBLE_DEVICES": "0,2,1,3", "MLFLOW_HVD_TASK_DEVICES": "2,3"}


def test_a_gpu_spark_let_two_tasks_share_is_the_only_one_each_sees() -> None:
    slots = assign_slots(["a", "a"])
    assert visible_devices(slots, [["0"], ["0"]], 1) == Devices(("0",), ("0",))


DRIVER = """
import json, sys
from pyspark.sql import SparkSession
from mlflow_hvd import (ClusterConfig, HorovodRunner, InsufficientSlotsError, JobConfig,
                        TrackingConfig)
from mlflow_hvd.backends.spark import jvm
import workers

spark = (SparkSession.builder.master("local-cluster[2,2,1024]")
         .config("spark.ui.enabled", "false")
         .config("spark.pyspark.python", sys.executable)
         .config("spark.driver.defaultJavaOptions", jvm.driver_java_options())
         .config("spark.worker.resource.acc.amount", "1")
         .config("spark.worker.resource.acc.discoveryScript", {script!r})
         .config("spark.executor.resource.acc.amount", "1")
         .config("spark.task.resource.acc.amount", "1")
         .getOrCreate())
try:
    HorovodRunner(np=3, spark=spark, job=JobConfig(slot_timeout=5),
                  cluster=ClusterConfig(gpu_resource="acc"),
                  tracking=TrackingConfig(track=False)).run(workers.gpu_view, out_dir=".")
except InsufficientSlotsError as exc:
    print("REFUSED", exc)
HorovodRunner(np=2, spark=spark, cluster=ClusterConfig(gpu_resource="acc"),
              tracking=TrackingConfig(track=False)).run(workers.gpu_view, out_dir={out!r})
spark.stop()
"""


@pytest.mark.slow
def test_spark_gpu_scheduling_reaches_the_ranks_and_too_few_gpus_are_named(
    tmp_path: Path,
) -> None:
    """On local-cluster, with the GPUs under another resource name (``gpu_resource``); the
    namespace cluster test uses the default name."""
    claims, out = tmp_path / "claims", tmp_path / "out"
    claims.mkdir()
    out.mkdir()
    script = tmp_path / "discover.sh"
    # each worker claims a different address (mkdir is atomic): GPUs 3 and 7
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for a in 3 7; do
          if mkdir {claims}/$a 2>/dev/null; then
            echo '{{"name": "acc", "addresses": ["'$a'"]}}'; exit 0
          fi
        done
        exit 1
        """))
    script.chmod(0o755)
    code = DRIVER.format(script=str(script), out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (refusal,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFUSED ")]
    assert "np=3 needs 3 concurrent barrier task slots" in refusal
    assert ("Each task also needs 1 acc (spark.task.resource.acc.amount; executors have "
            "spark.executor.resource.acc.amount=1)") in refusal
    views = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    owns = sorted(v["MLFLOW_HVD_TASK_DEVICES"] for v in views)
    assert owns == ["3", "7"]  # each rank's task got its own GPU
    for view in views:
        visible = view["CUDA_VISIBLE_DEVICES"].split(",")
        assert sorted(visible) == ["3", "7"]
        assert visible[int(view["HOROVOD_LOCAL_RANK"])] == view["MLFLOW_HVD_TASK_DEVICES"]



@pytest.mark.parametrize("name", ["", "gpu amount", 3])
def test_a_resource_name_spark_could_not_have_is_refused(name: object) -> None:
    from mlflow_hvd import ConfigurationError, HorovodRunner

    with pytest.raises(ConfigurationError, match=r"^gpu_resource must be the name of a Spark "
                       r"resource \(as in spark.task.resource.<name>.amount\), got "):
        HorovodRunner(np=2, cluster=ClusterConfig(gpu_resource=name))  # type: ignore[arg-type]

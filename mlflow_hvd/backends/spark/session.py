"""Finding the SparkSession to run on, and checking it can run a barrier stage of np tasks."""

from __future__ import annotations

import os
import re
import time
from typing import Any

from mlflow_hvd.errors import InsufficientSlotsError, SparkBarrierUnsupportedError


def get_or_create_session(np: int) -> Any:
    """The active SparkSession, or an embedded ``local[max(np, cores)]`` one if none exists."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    slots = max(np, os.cpu_count() or 1)
    return (
        SparkSession.builder.master(f"local[{slots}]")
        .appName("mlflow_hvd")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )


def check_barrier_supported(conf: Any) -> None:
    """Fail fast on configurations where Spark refuses or stalls barrier stages."""
    if str(conf.get("spark.dynamicAllocation.enabled", "false")).lower() == "true":
        raise SparkBarrierUnsupportedError(
            "Spark cannot run barrier-mode stages with dynamic allocation: set "
            "spark.dynamicAllocation.enabled=false (and a fixed spark.executor.instances) for "
            "the SparkSession that runs HorovodRunner, or use np<0 to run on the driver"
        )


def task_slots(sc: Any) -> int:
    """How many tasks the cluster can run at once right now (executors x cores / task cpus)."""
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def expected_slots(master: str, conf: Any) -> int | None:
    """Slots the cluster will offer once every executor is up, when the master tells it.

    ``local[N]`` and ``local-cluster[E,C,M]`` (and ``spark.executor.instances`` with
    ``spark.executor.cores``) determine it; otherwise None (the cluster may still grow).
    """
    task_cpus = int(conf.get("spark.task.cpus", "1") or 1)
    m = re.fullmatch(r"local\[(\d+)(?:,\s*\d+)?\]", master)
    if m:
        return int(m.group(1)) // task_cpus
    if master in ("local", "local[1]"):
        return 1
    m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    if m:
        return int(m.group(1)) * (int(m.group(2)) // task_cpus)
    instances, cores = conf.get("spark.executor.instances"), conf.get("spark.executor.cores")
    if instances and cores:
        return int(instances) * (int(cores) // task_cpus)
    return None


def wait_for_slots(sc: Any, np: int, timeout: float) -> int:
    """Wait up to ``timeout`` seconds (executors may still be registering) for ``np`` slots.

    Fails at once when the master's own size shows that ``np`` slots can never exist.

    Raises:
        InsufficientSlotsError: Fewer than ``np`` slots after the wait.
    """
    deadline = time.monotonic() + timeout
    ceiling = expected_slots(str(sc.master), sc.getConf())
    while True:
        slots = task_slots(sc)
        if slots >= np:
            return slots
        if (ceiling is not None and ceiling < np) or time.monotonic() >= deadline:
            conf = sc.getConf()
            raise InsufficientSlotsError(
                f"np={np} needs {np} concurrent barrier task slots but the Spark cluster "
                f"(master {sc.master}) offers {slots}"
                + (f" and can offer at most {ceiling}" if ceiling is not None and ceiling < np
                   else f" after waiting {timeout:g}s")
                + " "
                f"(spark.executor.cores={conf.get('spark.executor.cores', 'default')}, "
                f"spark.task.cpus={conf.get('spark.task.cpus', '1')}). Lower np, add "
                "executors or cores, or raise HorovodRunner(slot_timeout=...) if executors "
                "are still starting"
            )
        time.sleep(0.25)

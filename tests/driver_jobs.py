"""Helpers for tests that drive the driver's loop directly, with a backend of their own."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TextIO

from mlflow_hvd import ClusterConfig, JobConfig, TrackingConfig
from mlflow_hvd.backends.base import Backend
from mlflow_hvd.driver import DriverSettings, Job, RankPool, Verbosity
from mlflow_hvd.driver.retry import Failed
from mlflow_hvd.protocol.messages import TrackingTarget


def settings(**overrides: Any) -> DriverSettings:
    """The driver's settings of the default option groups, with ``overrides``."""
    base = DriverSettings.from_config(JobConfig(), ClusterConfig(), Verbosity.LOG_CALLBACK_ONLY)
    return dataclasses.replace(base, **overrides)


def run_job(backend: Backend, job: Job, driver_host: str = "127.0.0.1",
            out: TextIO | None = None) -> bytes:
    """Run ``job`` on ``job.np`` new ranks of ``backend`` (a cold generation, as
    ``HorovodRunner.run`` outside a ``with`` block) and return rank 0's cloudpickled value;
    every server and rank is gone when it returns or raises."""
    pool = RankPool(lambda _feed, _np: (backend, driver_host), warm=False)
    try:
        value = pool.run(job, out or sys.stdout)
        if isinstance(value, Failed):
            raise value.error
        assert isinstance(value, bytes), f"the job ended for a restart: {value}"
        return value
    finally:
        pool.close()


def tracking_target(uri: str, run_id: str, experiment_id: str = "0") -> TrackingTarget:
    """What ranks get of the driver's run ``run_id``, with the default tracking options."""
    options = TrackingConfig()
    return TrackingTarget(uri, run_id, experiment_id, system_metrics=options.log_system_metrics,
                          tracking_timeout=options.tracking_timeout)

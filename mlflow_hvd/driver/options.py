"""Driver side: ``HorovodRunner``'s options (the groups of :mod:`mlflow_hvd.common.config`),
checked once and kept as one frozen value (:class:`RunnerOptions`); every refusal names the
option and what it takes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlflow_hvd.backends.spark.master import standalone_addresses
from mlflow_hvd.common.config import ClusterConfig, JobConfig, TrackingConfig, group_argument
from mlflow_hvd.common.horovod_env import HorovodOptions, job_env
from mlflow_hvd.driver.supervisor import DriverSettings, Verbosity
from mlflow_hvd.errors import ConfigurationError


@dataclass(frozen=True)
class RunnerOptions:
    """What a ``HorovodRunner`` runs every job with: the groups as given (checked), and the
    driver loop's settings made from them once."""

    job: JobConfig
    cluster: ClusterConfig
    tracking: TrackingConfig
    horovod: HorovodOptions | None
    settings: DriverSettings


def runner_options(
    driver_log_verbosity: str,
    job: Any,
    cluster: Any,
    tracking: Any,
    horovod: Any,
    environ: Mapping[str, str] = os.environ,
) -> RunnerOptions:
    """``HorovodRunner``'s keyword arguments (see its docstring and
    :mod:`mlflow_hvd.common.config`), checked.

    Raises:
        ConfigurationError: A group of the wrong type, or an option out of its range,
            naming it.
    """
    job = group_argument(job, JobConfig, "job")
    cluster = group_argument(cluster, ClusterConfig, "cluster")
    tracking = group_argument(tracking, TrackingConfig, "tracking")
    if cluster.spark_master is not None:
        standalone_addresses(cluster.spark_master)  # a malformed spark:// URL fails now
    settings = DriverSettings.from_config(job, cluster, _verbosity(driver_log_verbosity),
                                          _horovod_env(horovod, environ))
    return RunnerOptions(job, cluster, tracking, horovod, settings)


def _verbosity(value: str) -> Verbosity:
    try:
        return Verbosity(value)
    except ValueError:
        raise ConfigurationError(
            f"driver_log_verbosity must be 'all' or 'log_callback_only', got {value!r}"
        ) from None


def _horovod_env(
    options: HorovodOptions | None, environ: Mapping[str, str]
) -> tuple[tuple[str, str], ...]:
    """Horovod's tuning for every rank: the driver's ``HOROVOD_*`` variables as they are
    now, overridden by ``options`` (refuses the variables the runner owns)."""
    if options is not None and not isinstance(options, HorovodOptions):
        raise ConfigurationError(
            f"horovod must be a mlflow_hvd.HorovodOptions, got {type(options).__name__}")
    return tuple(sorted(job_env(options, environ).items()))

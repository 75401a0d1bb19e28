"""Driver side: ``HorovodRunner``'s options, checked once and kept as one frozen value
(:class:`RunnerOptions`); every refusal names the option and what it takes."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlflow_hvd.backends.spark.master import standalone_addresses
from mlflow_hvd.common.horovod_env import HorovodOptions, job_env
from mlflow_hvd.common.options import check_positive_int, check_seconds
from mlflow_hvd.driver.supervisor import DriverSettings, Verbosity
from mlflow_hvd.errors import ConfigurationError


@dataclass(frozen=True)
class RunnerOptions:
    """What a ``HorovodRunner`` runs every job with: the driver loop's settings and the
    runner's own (Spark, tracking, retries)."""

    settings: DriverSettings
    slot_timeout: float
    spark_master: str | None
    track: bool
    system_metrics: bool
    tracking_timeout: float
    undelivered_dir: str | None
    tracking_env: tuple[str, ...]
    max_failures: int
    data_compression: str | None = None  # Arrow IPC compression of the DataFrames' shards
    # the environment shipped with a session the runner builds: False (none), True (this
    # venv, packed and cached) or an archive's path
    ship_environment: bool | str = False
    environment_timeout: float = 600.0  # executors fetch, unpack and check a shipped one


def runner_options(
    driver_log_verbosity: str,
    start_timeout: float,
    slot_timeout: float,
    timeout: float | None,
    stop_grace: float,
    spark_master: str | None,
    gloo_iface: str | None,
    max_line_bytes: int,
    track: bool,
    log_system_metrics: bool,
    tracking_timeout: float,
    undelivered_dir: str | None,
    max_failures: int,
    idle_timeout: float,
    horovod: HorovodOptions | None,
    gpu_resource: str,
    tracking_env: Sequence[str],
    data_compression: str | None = None,
    ship_environment: bool | str = False,
    environment_timeout: float = 600.0,
    environ: Mapping[str, str] = os.environ,
) -> RunnerOptions:
    """``HorovodRunner``'s keyword arguments (see its docstring), checked.

    Raises:
        ConfigurationError: An option out of its range or of the wrong type, naming it.
    """
    settings = DriverSettings(
        verbosity=_verbosity(driver_log_verbosity),
        start_timeout=check_seconds("start_timeout", start_timeout),
        timeout=None if timeout is None else check_seconds("timeout", timeout),
        stop_grace=check_seconds("stop_grace", stop_grace),
        max_line_bytes=check_positive_int("max_line_bytes", max_line_bytes, 80),
        gloo_iface=gloo_iface,
        idle_timeout=check_seconds("idle_timeout", idle_timeout),
        horovod_env=_horovod_env(horovod, environ),
        gpu_resource=_resource_name(gpu_resource),
    )
    return RunnerOptions(
        settings=settings,
        slot_timeout=check_seconds("slot_timeout", slot_timeout),
        spark_master=_master(spark_master),
        track=bool(track),
        system_metrics=bool(log_system_metrics),
        tracking_timeout=check_seconds("tracking_timeout", tracking_timeout),
        undelivered_dir=undelivered_dir,
        tracking_env=_env_names("tracking_env", tracking_env),
        max_failures=check_positive_int("max_failures", max_failures, 0),
        data_compression=_compression(data_compression),
        ship_environment=check_ship_environment(ship_environment),
        environment_timeout=check_seconds("environment_timeout", environment_timeout),
    )


ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")  # what spark.archives unpacks


def check_ship_environment(value: Any) -> bool | str:
    """``ship_environment`` checked: a bool, or an existing archive's absolute path.

    Raises:
        ConfigurationError: Anything else, naming what it takes.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str | os.PathLike):
        path = os.path.abspath(os.fspath(value))
        if path.endswith(ARCHIVE_SUFFIXES) and os.path.isfile(path):
            return path
    raise ConfigurationError(
        "ship_environment must be True (pack this venv for the executors: python -m "
        "mlflow_hvd.cli.pack_env), False, or the path of an existing archive ending in "
        f"{', '.join(ARCHIVE_SUFFIXES)}, got {value!r}")


COMPRESSIONS = (None, "lz4", "zstd")  # what Arrow IPC files can be compressed with


def _compression(value: Any) -> str | None:
    if value not in COMPRESSIONS:
        raise ConfigurationError(
            f"data_compression must be None (uncompressed: ranks memory-map their shards "
            f"without copying), 'lz4' or 'zstd', got {value!r}")
    return value


def _verbosity(value: str) -> Verbosity:
    try:
        return Verbosity(value)
    except ValueError:
        raise ConfigurationError(
            f"driver_log_verbosity must be 'all' or 'log_callback_only', got {value!r}"
        ) from None


def _master(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigurationError(
            f"spark_master must be a master URL such as 'spark://host:7077' (or None), got "
            f"{type(value).__name__}"
        )
    standalone_addresses(value or "")  # a malformed spark:// URL fails now
    return value


def _env_names(name: str, value: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
        raise ConfigurationError(
            f"{name} must be a list of environment variable names, e.g. "
            f"['AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY'], got {value!r}")
    return tuple(value)


def _horovod_env(
    options: HorovodOptions | None, environ: Mapping[str, str]
) -> tuple[tuple[str, str], ...]:
    """Horovod's tuning for every rank: the driver's ``HOROVOD_*`` variables as they are
    now, overridden by ``options`` (refuses the variables the runner owns)."""
    if options is not None and not isinstance(options, HorovodOptions):
        raise ConfigurationError(
            f"horovod must be a mlflow_hvd.HorovodOptions, got {type(options).__name__}")
    return tuple(sorted(job_env(options, environ).items()))


def _resource_name(name: str) -> str:
    if not isinstance(name, str) or not name or not name.replace("_", "").replace(
            "-", "").replace(".", "").isalnum():
        raise ConfigurationError(
            f"gpu_resource must be the name of a Spark resource (as in "
            f"spark.task.resource.<name>.amount), got {name!r}")
    return name

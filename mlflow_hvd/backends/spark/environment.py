"""Driver side: executors ready with a shipped environment before the first barrier stage.

A session that ships an environment (``spark.archives=<archive>#environment``) has each
executor fetch and unpack it when its first task arrives: a gigabyte and more, then
Horovod's extensions loaded from the fresh files (:mod:`mlflow_hvd.agent.host_check`).
Inside a barrier stage that would count against the job's start deadline, which is meant
for ranks starting, and fail it on a slow disk or network with a misleading
``StartTimeoutError``. So before the first barrier stage on such a session the backend runs
a plain stage of one task per slot: every executor unpacks the archive and checks it fits
its host (each task answers its host and what it lacks), under its own deadline,
``HorovodRunner(cluster=ClusterConfig(environment_timeout=...))``. Done once per application and
archive.

A Spark Connect session has no ``spark.archives`` of its own making: the runner uploads the
archive as a session artifact (``addArtifacts(..., archive=True)``; the server has every
executor unpack it in that session's own directory) and sets the session's
``spark.sql.execution.pyspark.python`` to its interpreter, once per session and archive
(:func:`ship_to_connect`). Other sessions of the same server are not affected.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from mlflow_hvd.backends.spark.api import ConnectApi, SessionApi, run_stage
from mlflow_hvd.backends.spark.failures import summarize_spark_error
from mlflow_hvd.backends.spark.session import refuse_stopped
from mlflow_hvd.common.phases import Phase, PhaseTimeout, in_phase
from mlflow_hvd.errors import BackendError, ConfigurationError, JobStopped, unfit_environment
from mlflow_hvd.protocol.environment import (
    ARCHIVE_ALIAS,
    SHIPPED_PYTHON,
    EnvironmentFingerprint,
)

log = logging.getLogger(__name__)

_ready: set[tuple[str, str]] = set()  # (scope, fingerprint) prepared
_lock = threading.Lock()
_uploaded: dict[str, str] = {}  # Connect session scope -> the archive it was given


def ship_to_connect(api: ConnectApi, archive: str, timeout: float,
                    stop: threading.Event | None = None) -> EnvironmentFingerprint | None:
    """Give ``api``'s Connect session the environment ``archive`` (once per session): upload
    it, unpacked as ``./environment`` on every executor, and have the session's Python
    workers run ``./environment/bin/python``. Returns what the archive needs of each host
    (None for an archive this package did not pack: unchecked).

    Raises:
        ConfigurationError: This session was given another archive before (a session's
            artifacts cannot be replaced).
        BackendError: The upload did not end within ``timeout`` seconds
            (``environment_timeout``), or the server refused it.
        JobStopped: ``stop`` was set meanwhile (``HorovodRunner.stop()``).
    """
    from mlflow_hvd.common.env_archive import fingerprint_of_archive

    scope = api.scope()
    with _lock:
        given = _uploaded.get(scope)
        if given is None:
            size = os.path.getsize(archive)
            log.info("shipped environment: uploading %s (%.0f MiB) to the Spark Connect "
                     "server %s", archive, size / 2**20, api.server_host())
            started = time.monotonic()
            _upload(api, archive, timeout, stop)
            api.set_python(SHIPPED_PYTHON)
            _uploaded[scope] = archive
            log.info("shipped environment: uploaded in %.1fs", time.monotonic() - started)
        elif given != archive:
            raise ConfigurationError(
                f"this Spark Connect session was given the environment {given} before and a "
                f"session's artifacts cannot be replaced: ship {archive} with a new session "
                "(SparkSession.builder.remote(...).create()), or keep shipping the first")
    return fingerprint_of_archive(archive)


def _upload(api: ConnectApi, archive: str, timeout: float,
            stop: threading.Event | None) -> None:
    """``addArtifacts`` as the ``SHIPPING`` phase: the client's call has no deadline of its
    own, so it is left to end by itself past ``timeout`` or a stop request."""
    try:
        in_phase(Phase.SHIPPING, api.add_archive, archive, ARCHIVE_ALIAS, limit=timeout,
                 option="environment_timeout", stop=stop)
    except PhaseTimeout:
        raise BackendError(
            f"uploading the environment {archive} to the Spark Connect server "
            f"{api.server_host()} did not end within {timeout:g}s (environment_timeout): "
            "raise HorovodRunner(cluster=ClusterConfig(environment_timeout=...)) for a large "
            "archive or a slow network, or give the server's nodes the environment instead"
        ) from None
    except (JobStopped, ConfigurationError):
        raise
    except Exception as exc:
        raise BackendError(f"the Spark Connect server {api.server_host()} refused the "
                           f"environment {archive}: {exc}") from exc


def _check_on_executor(shipped: EnvironmentFingerprint
                       ) -> Callable[[Iterable[Any]], Iterator[tuple[str, list[str]]]]:
    def check(_rows: Iterable[Any]) -> Iterator[tuple[str, list[str]]]:
        import socket

        from mlflow_hvd.agent.host_check import environment_differences

        yield socket.gethostname(), list(environment_differences(shipped))

    return check


def _check_as_arrow(shipped: EnvironmentFingerprint
                    ) -> Callable[[Iterable[Any]], Iterator[Any]]:
    check = _check_on_executor(shipped)

    def as_arrow(batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa

        for host, differences in check(batches):
            yield pa.RecordBatch.from_pylist([{"host": host, "differences": differences}])

    return as_arrow


def prepare_executors(api: SessionApi, shipped: EnvironmentFingerprint, slots: int,
                      timeout: float, stop: threading.Event | None = None) -> None:
    """Have every executor of ``api``'s session unpack and check the shipped environment (once per
    application and environment).

    Raises:
        EnvironmentArchiveError: A host the environment does not fit, naming what differs.
        BackendError: Not done within ``timeout`` seconds, or the stage failed (e.g. an
            executor cannot start the shipped interpreter).
    """
    key = (api.scope(), shipped.dumps())
    with _lock:
        if key in _ready:
            return
        started = time.monotonic()
        log.info("shipped environment: %d tasks unpack and check it on the executors", slots)
        hosts = _run_stage(api, shipped, slots, timeout, stop)
        unfit = {host: differences for host, differences in hosts if differences}
        if unfit:
            host, differences = sorted(unfit.items())[0]
            others = f" (nor {', '.join(sorted(unfit)[1:])})" if len(unfit) > 1 else ""
            raise unfit_environment(host + others, differences)
        _ready.add(key)
        log.info("shipped environment: ready on %s in %.1fs",
                 ", ".join(sorted({h for h, _ in hosts})), time.monotonic() - started)


def _run_stage(api: SessionApi, shipped: EnvironmentFingerprint, slots: int,
               timeout: float, stop: threading.Event | None) -> list[tuple[str, list[str]]]:
    def check() -> list[tuple[str, list[str]]]:
        rows = api.each_task(slots, _check_on_executor(shipped), _check_as_arrow(shipped),
                             "host string, differences array<string>")
        return [(row[0], row[1]) for row in rows]

    outcome = run_stage(api, "environment",
                        "mlflow_hvd: unpack and check the shipped environment", check, timeout,
                        stop)
    if not outcome.finished:
        raise BackendError(
            f"the executors did not fetch, unpack and check the shipped environment within "
            f"{timeout:g}s (environment_timeout): raise "
            f"HorovodRunner(cluster=ClusterConfig(environment_timeout="
            "...)) for a large archive or a slow network, or give the nodes the environment "
            "(an image) instead of shipping it")
    if outcome.error is not None:
        refuse_stopped(api, "unpacked and checked the shipped environment on the executors",
                       outcome.error)
        error = summarize_spark_error(outcome.error, shipped, api.remote,
                                      api.removed_executors())
        raise BackendError(f"preparing the shipped environment failed: {error}"
                           ) from outcome.error
    return [(str(h), list(d)) for h, d in outcome.value]

"""``HorovodRunner``: the API of Databricks' ``sparkdl.HorovodRunner``, open and real."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import cloudpickle

from mlflow_hvd.backends.base import Backend
from mlflow_hvd.backends.local import LocalBackend
from mlflow_hvd.driver import DriverSettings, Verbosity, new_job_id, resolve_host, run_job
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.messages import Payload, TrackingTarget


def _check_np(np: object) -> int:
    if isinstance(np, bool) or not isinstance(np, int):
        raise ConfigurationError(
            f"np must be a non-zero integer, got {np!r} ({type(np).__name__}): use np=-N for N "
            "processes on the driver, np=N for N Spark barrier tasks"
        )
    if np == 0:
        raise ConfigurationError(
            "np=0 is not a valid number of processes: use np=-N for N processes on the "
            "driver (np=-1 to test on one process first), np=N for N Spark barrier tasks"
        )
    return np


def _check_positive(name: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")


class HorovodRunner:
    """Runs a function as a distributed Horovod (Gloo) job and returns rank 0's result.

    Drop-in for Databricks' ``sparkdl.HorovodRunner(*, np, driver_log_verbosity)``.

    Args:
        np: ``np < 0`` runs ``-np`` processes on the driver machine (``np=-1``: one process,
            to test first); ``np > 0`` runs a Spark barrier-mode stage of ``np`` tasks on the
            active SparkSession (an embedded ``local[max(np, cores)]`` session is created if
            none is active), one rank per task.
        driver_log_verbosity: ``"log_callback_only"`` (default) shows on the driver only
            what workers send with :func:`mlflow_hvd.log_to_driver`, and errors;
            ``"all"`` also streams every rank's stdout and stderr, prefixed ``[rank]<stream>:``.
        start_timeout: Seconds for every rank to start and reach the driver.
        slot_timeout: Seconds to wait for Spark executors to offer ``np`` task slots.
        timeout: Optional limit in seconds on the whole run (None: no limit).
        stop_grace: Seconds between SIGTERM and SIGKILL when stopping ranks.
        spark: The SparkSession to use for ``np > 0`` (default: active or embedded one).
        gloo_iface: Network interface for Gloo (default: the one routing to the driver).
        max_line_bytes: Longer output lines are cut with a ``...[line truncated: N more
            bytes]`` marker.
        track: Log the job into one MLflow run owned by the driver: the active run, the
            run of ``mlflow run`` (``MLFLOW_RUN_ID``), or a new run that ``run`` ends with
            status FINISHED, FAILED or KILLED. Rank 0 logs into it through
            :mod:`mlflow_hvd.tracking`. ``False``: no MLflow at all.
        log_system_metrics: Also log MLflow system metrics, once per node.
    """

    def __init__(
        self,
        *,
        np: int,
        driver_log_verbosity: str = "log_callback_only",
        start_timeout: float = 60.0,
        slot_timeout: float = 30.0,
        timeout: float | None = None,
        stop_grace: float = 5.0,
        spark: Any = None,
        gloo_iface: str | None = None,
        max_line_bytes: int = 16384,
        track: bool = True,
        log_system_metrics: bool = False,
    ) -> None:
        self.num_processor = _check_np(np)
        try:
            verbosity = Verbosity(driver_log_verbosity)
        except ValueError:
            raise ConfigurationError(
                f"driver_log_verbosity must be 'all' or 'log_callback_only', got "
                f"{driver_log_verbosity!r}"
            ) from None
        _check_positive("start_timeout", start_timeout)
        _check_positive("slot_timeout", slot_timeout)
        _check_positive("timeout", timeout, allow_none=True)
        _check_positive("stop_grace", stop_grace)
        if isinstance(max_line_bytes, bool) or not isinstance(max_line_bytes, int) or (
            max_line_bytes < 80
        ):
            raise ConfigurationError(f"max_line_bytes must be an int >= 80, got {max_line_bytes!r}")
        self.driver_log_verbosity = verbosity.value
        self._settings = DriverSettings(
            verbosity=verbosity,
            start_timeout=float(start_timeout),
            run_timeout=float(timeout) if timeout is not None else None,
            stop_grace=float(stop_grace),
            max_line_bytes=max_line_bytes,
            gloo_iface=gloo_iface,
        )
        self._slot_timeout = float(slot_timeout)
        self._spark = spark
        self._track = bool(track)
        self._system_metrics = bool(log_system_metrics)
        self.last_job_id: str | None = None
        self.last_run_id: str | None = None
        """Id of the latest run; for ``np > 0`` also its Spark job group (Spark UI)."""

    @property
    def np(self) -> int:
        return self.num_processor

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """Run ``main(**kwargs)`` on every rank, each in a fresh Python process.

        ``main`` and ``kwargs`` are cloudpickled (functions defined in the caller's own
        modules are pickled by value, so workers need not import them).

        Returns:
            The return value of ``main`` on rank 0.

        Raises:
            WorkerFailedError: A rank raised, exited non-zero or was killed; names the rank,
                host, exit status and the rank's traceback (or last lines of output).
            StartTimeoutError, RunTimeoutError, InsufficientSlotsError, BackendError.
        """
        if not callable(main):
            raise ConfigurationError(f"main must be callable, got {type(main).__name__}")
        _dumps_payload(main, kwargs)  # fail on unpicklable input before touching MLflow
        backend, driver_host = self._backend()
        if not self._track:
            return self._launch(main, kwargs, backend, driver_host, None)
        from mlflow_hvd.mlflow_run import driver_run

        with driver_run(self.num_processor, backend.describe(), self._system_metrics) as target:
            self.last_run_id = target.run_id
            return self._launch(main, kwargs, backend, driver_host, target)

    def _launch(
        self,
        main: Callable[..., Any],
        kwargs: dict[str, Any],
        backend: Backend,
        driver_host: str,
        target: TrackingTarget | None,
    ) -> Any:
        self.last_job_id = job_id = new_job_id()
        value = run_job(
            abs(self.num_processor),
            _dumps_payload(main, kwargs, target),
            backend,
            self._settings,
            driver_host,
            f"HorovodRunner(np={self.num_processor}).run({_name(main)})",
            job_id=job_id,
        )
        return cloudpickle.loads(value)

    def _backend(self) -> tuple[Backend, str]:
        if self.num_processor < 0:
            return LocalBackend(), "127.0.0.1"
        from mlflow_hvd.backends.spark import SparkBackend
        from mlflow_hvd.session import get_or_create_session

        spark = self._spark or get_or_create_session(self.num_processor)
        host = spark.sparkContext.getConf().get("spark.driver.host") or "127.0.0.1"
        return SparkBackend(spark, self._slot_timeout), resolve_host(host)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _dumps_payload(
    main: Callable[..., Any], kwargs: dict[str, Any], target: TrackingTarget | None = None
) -> bytes:
    """cloudpickle ``(main, kwargs)``; the caller's own modules go by value.

    Installed packages and the standard library stay by reference (workers import them).
    The module of ``main`` and the other user modules loaded here (a script's helpers, a
    test file's fixtures) are pickled by value, so workers whose ``sys.path`` differs from
    the driver's (Spark executors) can still run them. Modules imported *inside* ``main``
    must be importable on the workers.
    """
    module = sys.modules.get(getattr(main, "__module__", "") or "")
    by_value = _user_modules(module)
    source_file = source_text = ""
    for mod in by_value:
        cloudpickle.register_pickle_by_value(mod)
    if module is not None and module in by_value:
        source_file = os.path.realpath(str(module.__file__))
        try:
            with open(source_file, encoding="utf-8") as f:
                source_text = f.read()
        except OSError:
            source_text = ""
    try:
        return cloudpickle.dumps(Payload(main, kwargs, source_file, source_text, target))
    except Exception as exc:
        raise ConfigurationError(
            f"cannot pickle main or its kwargs for the workers: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        for mod in by_value:
            cloudpickle.unregister_pickle_by_value(mod)


def _user_modules(main_module: Any) -> list[Any]:
    """Every user module loaded in this process, ``main``'s first: a script's helpers and a
    notebook's imports from its project are installed nowhere on the workers."""
    found = [m for m in list(sys.modules.values()) if _is_user_module(m)]
    if main_module in found:
        found.remove(main_module)
        found.insert(0, main_module)
    return found


def _is_user_module(module: Any) -> bool:
    """A module of the user's own code: not installed (site-packages), not the standard
    library, not mlflow_hvd, not ``__main__`` (which cloudpickle already sends by value)."""
    import sysconfig

    name = getattr(module, "__name__", "")
    path = getattr(module, "__file__", None)
    if name == "__main__" or not path or not isinstance(path, str):
        return False
    if name.split(".")[0] == "mlflow_hvd":
        return False
    path = os.path.realpath(path)
    if "site-packages" in path or "dist-packages" in path:
        return False
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    return not path.startswith(stdlib + os.sep)

"""``HorovodRunner``: the API of Databricks' ``sparkdl.HorovodRunner``, open and real."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle

from mlflow_hvd.backends.base import Backend
from mlflow_hvd.backends.local import LocalBackend
from mlflow_hvd.backends.spark.boot import SessionBoot
from mlflow_hvd.backends.spark.master import standalone_addresses
from mlflow_hvd.common import compat
from mlflow_hvd.common.horovod_env import HorovodOptions, job_env
from mlflow_hvd.common.options import check_np, check_positive_int, check_seconds
from mlflow_hvd.driver import DriverSettings, Verbosity, new_job_id, resolve_host, run_job
from mlflow_hvd.driver.payload import dumps_code, dumps_payload
from mlflow_hvd.driver.retry import Decision, RetryPolicy
from mlflow_hvd.driver.signals import sigterm_interrupts
from mlflow_hvd.driver.tracking import attempts
from mlflow_hvd.errors import (
    BackendError,
    ConfigurationError,
    RetriesExhaustedError,
    WorkerFailedError,
)
from mlflow_hvd.protocol.credentials import collect as collect_credentials
from mlflow_hvd.protocol.messages import Code, TrackingTarget, UndeliveredTracking

if TYPE_CHECKING:
    from mlflow_hvd.driver.pool import RankPool
    from mlflow_hvd.driver.tracking.epochs import EpochJudge

log = logging.getLogger(__name__)


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
        spark: The SparkSession to use for ``np > 0`` (default: the active one, else one on
            the master Spark's own settings name, else an embedded ``local[N]``).
        spark_master: The Spark master for a new session (e.g. ``spark://host:7077``);
            None or ``"auto"``: ``PYSPARK_SUBMIT_ARGS``' ``--master``, ``spark.master`` in
            ``spark-defaults.conf``, or ``MASTER``, as ``spark-submit`` reads them.
        gloo_iface: Network interface for Gloo (default: the one routing to the driver).
        max_line_bytes: Longer output lines are cut with a ``...[line truncated: N more
            bytes]`` marker.
        track: Log the job into one MLflow run owned by the driver: the active run, the
            run of ``mlflow run`` (``MLFLOW_RUN_ID``), or a new run that ``run`` ends with
            status FINISHED, FAILED or KILLED. Rank 0 logs into it through
            :mod:`mlflow_hvd.tracking`. ``False``: no MLflow at all.
        log_system_metrics: Also log MLflow system metrics, once per node.
        tracking_timeout: Seconds given to the tracking server at the end of a job, once
            for rank 0 to deliver what it queued and once for the driver to end the run
            (status, failure tags): against an unreachable server ``run`` returns or raises
            the job's own outcome at most ``2 * tracking_timeout`` after training ends
            (default: 60 s). During training nothing waits for the server: rank 0 buffers
            through an outage (memory, then disk) and delivers in order when it is back.
        undelivered_dir: Where the driver saves what never reached the server, one bundle
            per run, with a warning naming the count and the path; replay it with
            ``python -m mlflow_hvd.tracking.replay <path>``. Default:
            ``MLFLOW_HVD_UNDELIVERED_DIR``, else ``~/.local/state/mlflow_hvd/undelivered``.

        max_failures: Restart the whole job after a rank or backend failure, up to this many
            times (all-or-nothing, like a Spark barrier stage; default 0: no restart). Each
            attempt runs in the same MLflow run, so training code that resumes from the
            run's latest checkpoint (:func:`mlflow_hvd.keras.restore_from_checkpoint`)
            continues where the failed attempt's last checkpoint left off. Every attempt is
            logged (metric ``mlflow_hvd.attempt`` at step = attempt, and
            ``attempts/attempt_<k>_error.txt`` with each failure in full); when all fail,
            :class:`~mlflow_hvd.errors.RetriesExhaustedError` carries every cause.
            Workers can read their attempt with :func:`mlflow_hvd.attempt`.

        log_prefix: Put before every worker line shown on the driver (the sweep uses
            ``"[trial N]"``).
        idle_timeout: Inside ``with runner:``, warm ranks that wait longer than this for
            the next ``run`` are retired (their Spark slots freed); the next ``run`` starts
            new ones.
        horovod: ``horovodrun``'s tuning flags for every rank
            (:class:`~mlflow_hvd.HorovodOptions`: timeline, fusion threshold, cycle time,
            cache capacity, hierarchical allreduce/allgather, autotune and its log). The
            driver's ``HOROVOD_*`` variables (read here) and the executors' (Spark's
            ``spark.executorEnv.*``) reach every rank too; the options win over both, the
            driver's over the executors'. The variables the runner sets per rank (rank,
            size, rendezvous, controller) are refused, naming them. A timeline or
            autotune log is written on rank 0's host and logged to the job's run
            (``horovod/timeline.json``, ``horovod/autotune_log.csv``) when ``main``
            returns.
        gpu_resource: For ``np > 0`` with Spark's resource scheduling
            (``spark.task.resource.<name>.amount``): the resource whose addresses each rank
            gets as ``CUDA_VISIBLE_DEVICES`` (default ``"gpu"``). A rank sees the GPUs Spark
            gave the job's tasks on its host, ordered by local rank, so
            ``gpus[hvd.local_rank()]`` is the one Spark gave its own task; where Spark let
            tasks share a GPU (a fractional amount), a rank sees only its own. Without the
            resource nothing is changed. ``np < 0``: ``CUDA_VISIBLE_DEVICES`` is left as the
            driver has it, so local rank ``i`` takes the driver's ``i``-th visible GPU.
        tracking_env: Names of further variables of the driver's environment that rank 0's
            MLflow client needs, e.g. an artifact store's (``AWS_ACCESS_KEY_ID``, ...).
            They reach rank 0 as MLflow's own client settings do: the driver's
            ``MLFLOW_TRACKING_USERNAME``, ``MLFLOW_TRACKING_PASSWORD``,
            ``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_INSECURE_TLS`` and the files of
            ``MLFLOW_TRACKING_SERVER_CERT_PATH`` / ``MLFLOW_TRACKING_CLIENT_CERT_PATH``, read
            at each ``run``, are handed to the job's rank 0 over its channel, sealed with the
            job's secret, and to no other rank (README: "Tracking servers with
            authentication").

    SIGTERM to the driver while ``run`` executes (main thread) ends it like Ctrl-C: ranks
    stopped, the Spark job group cancelled, the run ended KILLED, and
    :class:`~mlflow_hvd.errors.Terminated` (a ``KeyboardInterrupt``) raised.
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
        spark_master: str | None = None,
        gloo_iface: str | None = None,
        max_line_bytes: int = 16384,
        track: bool = True,
        log_system_metrics: bool = False,
        tracking_timeout: float = 30.0,
        undelivered_dir: str | None = None,
        max_failures: int = 0,
        log_prefix: str = "",
        idle_timeout: float = 3600.0,
        horovod: HorovodOptions | None = None,
        gpu_resource: str = "gpu",
        tracking_env: Sequence[str] = (),
    ) -> None:
        self.num_processor = check_np(np)
        try:
            verbosity = Verbosity(driver_log_verbosity)
        except ValueError:
            raise ConfigurationError(
                f"driver_log_verbosity must be 'all' or 'log_callback_only', got "
                f"{driver_log_verbosity!r}"
            ) from None
        self.driver_log_verbosity = verbosity.value
        self._settings = DriverSettings(
            verbosity=verbosity,
            start_timeout=check_seconds("start_timeout", start_timeout),
            run_timeout=None if timeout is None else check_seconds("timeout", timeout),
            stop_grace=check_seconds("stop_grace", stop_grace),
            max_line_bytes=check_positive_int("max_line_bytes", max_line_bytes, 80),
            gloo_iface=gloo_iface,
            log_prefix=str(log_prefix),
            idle_timeout=check_seconds("idle_timeout", idle_timeout),
            horovod_env=_horovod_env(horovod),
            gpu_resource=_resource_name(gpu_resource),
        )
        self._slot_timeout = check_seconds("slot_timeout", slot_timeout)
        self._spark = spark
        if spark_master is not None and not isinstance(spark_master, str):
            raise ConfigurationError(
                f"spark_master must be a master URL such as 'spark://host:7077' (or None), got "
                f"{type(spark_master).__name__}"
            )
        standalone_addresses(spark_master or "")  # a malformed spark:// URL fails now
        self._spark_master = spark_master
        self._track = bool(track)
        self._system_metrics = bool(log_system_metrics)
        self._tracking_timeout = check_seconds("tracking_timeout", tracking_timeout)
        self._undelivered_dir = undelivered_dir
        self._tracking_env = _env_names("tracking_env", tracking_env)
        self._max_failures = check_positive_int("max_failures", max_failures, 0)
        self._pool: RankPool | None = None
        self._boot = SessionBoot(self.num_processor, spark_master, self._slot_timeout)
        self.last_job_id: str | None = None
        self.last_run_id: str | None = None
        """Id of the latest run; for ``np > 0`` also its Spark job group (Spark UI)."""
        self.epoch_judge: EpochJudge | None = None
        """Decides after each epoch (rank 0 reports ``epoch_judge.metric``) whether a run
        goes on: set by :func:`mlflow_hvd.sweep.sweep` when it prunes; None by default."""

    @property
    def np(self) -> int:
        return self.num_processor

    @property
    def log_prefix(self) -> str:
        """Put before every worker line shown on the driver (settable between runs)."""
        return self._settings.log_prefix

    @log_prefix.setter
    def log_prefix(self, prefix: str) -> None:
        self._settings = dataclasses.replace(self._settings, log_prefix=str(prefix))

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """Run ``main(**kwargs)`` on every rank, each in a fresh Python process.

        ``main`` and ``kwargs`` are cloudpickled (functions defined in the caller's own
        modules are pickled by value, so workers need not import them).

        Returns:
            The return value of ``main`` on rank 0.

        Raises:
            WorkerFailedError: A rank raised, exited non-zero or was killed; names the rank,
                host, exit status and the rank's traceback (or last lines of output).
            UnsupportedVersionError: pyspark (``np > 0``) or TensorFlow (``np < 0``) outside
                the supported versions, or ``TF_USE_LEGACY_KERAS`` set; nothing was started.
            StartTimeoutError, RunTimeoutError, InsufficientSlotsError, BackendError.
        """
        if not callable(main):
            raise ConfigurationError(f"main must be callable, got {type(main).__name__}")
        compat.check_driver(self.num_processor)
        code = dumps_code(main, kwargs)  # once; unpicklable input fails before MLflow
        self._boot.new_run()  # the master is resolved once per run
        self.prepare()  # a new SparkSession boots while MLflow's run is being set up
        with sigterm_interrupts():
            if not self._track:
                return self._attempts(main, code, None)
            from mlflow_hvd.driver.tracking.run import driver_run

            with driver_run(
                self.num_processor,
                self._describe_backend(),
                self._system_metrics,
                self._tracking_timeout,
                self._undelivered_dir,
            ) as target:
                self.last_run_id = target.run_id
                return self._attempts(main, code, target)

    def _attempts(
        self, main: Callable[..., Any], code: Code, target: TrackingTarget | None
    ) -> Any:
        """Run the job; what follows a failure is :class:`RetryPolicy`'s decision: run it
        again (it never started), restart it as a new attempt in the same MLflow run (up to
        ``max_failures`` times), or raise."""
        policy = RetryPolicy(self._max_failures)
        failures: list[BaseException] = []
        record = target if self._max_failures > 0 else None  # attempts only when retrying
        attempt = reruns = 0
        while True:
            if reruns == 0:
                log.info("attempt %d of %d of %s starts", attempt + 1,
                         self._max_failures + 1, _name(main))
                if record is not None:
                    attempts.started(record, attempt, self._tracking_timeout,
                                     self._undelivered_root())
            try:
                return self._launch(main, code, target, attempt)
            except (WorkerFailedError, BackendError) as exc:
                decision = policy.decide(exc, attempt, reruns)
                if decision is Decision.RERUN:
                    reruns += 1
                    log.info("attempt %d never ran (%s); running it on new ranks",
                             attempt + 1, str(exc).splitlines()[0])
                    continue
                failures.append(exc)
                if record is not None:
                    attempts.failed(record, attempt, exc, self._tracking_timeout,
                                    self._undelivered_root())
                if decision is Decision.GIVE_UP:
                    if len(failures) == 1:
                        raise
                    raise RetriesExhaustedError(failures) from exc
                log.warning(
                    "mlflow_hvd: attempt %d of %d failed (%s); restarting the job%s",
                    attempt + 1, self._max_failures + 1, str(exc).splitlines()[0],
                    " from its latest checkpoint" if target is not None else "",
                )
                attempt, reruns = attempt + 1, 0

    def _launch(
        self,
        main: Callable[..., Any],
        code: Code,
        target: TrackingTarget | None,
        attempt: int = 0,
    ) -> Any:
        self.last_job_id = job_id = new_job_id()
        if target is not None and attempt > 0:  # an earlier attempt logged: rank 0 asks
            target = dataclasses.replace(target, facts=None)
        settings = self._settings
        if target is not None:
            # the driver's MLflow client settings, read now, for rank 0 over the channel
            settings = dataclasses.replace(settings, credentials=collect_credentials(
                os.environ, self._tracking_env))
            target = dataclasses.replace(target,
                                         authenticated=settings.credentials is not None)
            if self.epoch_judge is not None:  # rank 0 reports the judged metric per epoch
                target = dataclasses.replace(target, prune_metric=self.epoch_judge.metric)
        payload = dumps_payload(code, target, attempt)
        description = f"HorovodRunner(np={self.num_processor}).run({_name(main)})" + (
            f" attempt {attempt}" if attempt else ""
        )
        writes = None  # rank 0's metrics, params and tags: the driver writes them
        if target is not None:
            from mlflow_hvd.driver.tracking.epochs import rank0_requests
            from mlflow_hvd.driver.tracking.relay import Relay

            writes = rank0_requests(Relay(target).answer, self.epoch_judge, target.run_id)
        if self._pool is not None:
            value = self._pool.run(payload, description, sys.stdout, job_id,
                                   self._save_undelivered, settings, writes)
        else:
            backend, driver_host = self._backend()
            value = run_job(
                abs(self.num_processor), payload, backend, settings, driver_host,
                description, job_id=job_id, on_undelivered=self._save_undelivered,
                on_tracking_write=writes,
            )
        return cloudpickle.loads(value)

    def __enter__(self) -> HorovodRunner:
        """Keep the ranks warm between ``run`` calls until the ``with`` block ends.

        Inside the block, ranks (local processes, or the tasks of one Spark barrier stage)
        stay up after a job, with TensorFlow, Horovod and MLflow imported, and run the next
        ``run``'s function: Horovod is shut down and Keras' state cleared between jobs, so
        ``main`` calls ``hvd.init()`` as usual. A job that fails stops its ranks; the next
        ``run`` starts new ones. Leaving the block retires the ranks and frees the Spark
        slots, on every exit path. Module-level state of user code (globals, TF settings
        made before ``hvd.init``, e.g. GPU visibility) carries over between jobs.
        """
        if self._pool is not None:
            raise ConfigurationError("this HorovodRunner's ranks are already kept warm "
                                     "(nested `with runner:`)")
        from mlflow_hvd.driver.pool import RankPool

        self._pool = RankPool(abs(self.num_processor), self._backend, self._settings)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            pool.close()
        except Exception:
            if exc_type is None:
                raise
            # the block's own error is what the caller must see
            log.warning("mlflow_hvd: releasing the warm ranks failed", exc_info=True)

    def _save_undelivered(self, message: UndeliveredTracking) -> None:
        """Keep what rank 0 could not deliver, and say how much and where."""
        from mlflow_hvd.driver.tracking import undelivered
        from mlflow_hvd.protocol import records

        path = undelivered.save_message(self._undelivered_root(), message)
        what = records.describe(records.count(message.records))
        log.warning(
            "mlflow_hvd: %s logged by rank 0 on host %s did not reach the tracking server %s "
            "(%s). Saved in %s; send with: python -m mlflow_hvd.tracking.replay %s",
            what, message.host, message.tracking_uri, message.reason, path, path,
        )

    def _undelivered_root(self) -> str:
        from mlflow_hvd.driver.tracking import undelivered

        return self._undelivered_dir or undelivered.default_root()

    def _describe_backend(self) -> dict[str, str]:
        """The backend's facts for the run's tags, without starting anything."""
        if self.num_processor < 0:
            return {"backend": LocalBackend.name}
        from mlflow_hvd.backends.spark import SparkBackend

        if self._spark is not None:
            master = str(self._spark.sparkContext.master)
        else:
            master = self._boot.choice()[1]
        return {"backend": SparkBackend.name, "spark_master": master}

    def prepare(self) -> None:
        """Start what ``run`` needs ahead of it: with ``np > 0`` and no SparkSession yet,
        Spark's JVM boots in a background thread while the caller goes on with
        other start-up work (imports, MLflow). ``run`` calls it itself, so calling it early
        only saves time. A wrong or unreachable master is refused at once.

        Raises:
            ConfigurationError: ``spark_master`` differs from the active session's master.
            BackendError: The configured standalone master does not answer.
        """
        if self.num_processor > 0 and self._spark is None:
            self._boot.start()

    def _session(self) -> Any:
        if self._spark is not None:
            return self._spark
        return self._boot.session(self._settings.start_timeout)

    def _backend(self) -> tuple[Backend, str]:
        if self.num_processor < 0:
            return LocalBackend(), "127.0.0.1"
        from mlflow_hvd.backends.spark import SparkBackend

        spark = self._session()
        host = spark.sparkContext.getConf().get("spark.driver.host") or "127.0.0.1"
        return SparkBackend(spark, self._slot_timeout), resolve_host(host)


def _env_names(name: str, value: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
        raise ConfigurationError(
            f"{name} must be a list of environment variable names, e.g. "
            f"['AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY'], got {value!r}")
    return tuple(value)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _horovod_env(options: HorovodOptions | None) -> tuple[tuple[str, str], ...]:
    """Horovod's tuning for every rank: the driver's ``HOROVOD_*`` variables as they are
    now, overridden by ``options`` (refuses the variables the runner owns)."""
    import os

    if options is not None and not isinstance(options, HorovodOptions):
        raise ConfigurationError(
            f"horovod must be a mlflow_hvd.HorovodOptions, got {type(options).__name__}")
    return tuple(sorted(job_env(options, os.environ).items()))


def _resource_name(name: str) -> str:
    if not isinstance(name, str) or not name or not name.replace("_", "").replace(
            "-", "").replace(".", "").isalnum():
        raise ConfigurationError(
            f"gpu_resource must be the name of a Spark resource (as in "
            f"spark.task.resource.<name>.amount), got {name!r}")
    return name

"""Driver side (the user's process): ``HorovodRunner``, the API of Databricks'
``sparkdl.HorovodRunner``, open and real."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cloudpickle

from mlflow_hvd.backends.base import Backend
from mlflow_hvd.backends.local import LocalBackend
from mlflow_hvd.backends.spark.boot import SessionBoot, refuse_unshipped
from mlflow_hvd.common import compat
from mlflow_hvd.common.horovod_env import HorovodOptions
from mlflow_hvd.common.options import check_np
from mlflow_hvd.driver.feed import Feed, split_frames
from mlflow_hvd.driver.job import Job, new_job_id, resolve_host
from mlflow_hvd.driver.options import runner_options
from mlflow_hvd.driver.payload import check_call, dumps_code, dumps_payload
from mlflow_hvd.driver.pool import RankPool
from mlflow_hvd.driver.retry import Decision, RetryPolicy
from mlflow_hvd.driver.signals import sigterm_interrupts
from mlflow_hvd.driver.supervisor import DriverSettings
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
        start_timeout: Seconds a starting job may go without progress: with no rank
            reaching the driver and no task feeding the data for that long, the job ends
            with ``StartTimeoutError`` naming the ranks that never started.
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
            job's secret, and to no other rank (docs/cluster.md: "Tracking servers with
            authentication").
        data_compression: ``"lz4"``/``"zstd"`` compress the shards of DataFrame arguments
            (less disk, a copy as ranks read); None: memory-mapped (docs/data.md).
        ship_environment: True: this venv, packed (cached), shipped with the session the
            runner builds; a path: that archive (docs/cluster.md).
        environment_timeout: Seconds a shipped environment gets to be unpacked: on the
            driver while the session the runner builds starts (Spark unpacks archives
            there too; added to ``start_timeout``), and on every executor before the
            session's first job, with Horovod loaded from it (a plain Spark stage ahead of
            the barrier stage; once per application).

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
        idle_timeout: float = 3600.0,
        horovod: HorovodOptions | None = None,
        gpu_resource: str = "gpu",
        tracking_env: Sequence[str] = (),
        data_compression: str | None = None,
        ship_environment: bool | str = False,
        environment_timeout: float = 600.0,
    ) -> None:
        self.num_processor = check_np(np)
        """``np`` under the attribute name of Databricks' HorovodRunner."""
        self._options = runner_options(
            driver_log_verbosity, start_timeout, slot_timeout, timeout, stop_grace,
            spark_master, gloo_iface, max_line_bytes, track, log_system_metrics,
            tracking_timeout, undelivered_dir, max_failures, idle_timeout, horovod,
            gpu_resource, tracking_env, data_compression, ship_environment,
            environment_timeout)
        self.driver_log_verbosity = self._options.settings.verbosity.value
        self._spark = spark
        if spark is not None:
            refuse_unshipped(spark, self._options.ship_environment)
        self._pool = RankPool(abs(self.num_processor), self._backend, warm=False)
        self._boot = SessionBoot(self.num_processor, spark_master, self._options.slot_timeout,
                                 self._options.ship_environment,
                                 self._options.environment_timeout)
        self.last_job_id: str | None = None
        """Id of the latest job; for ``np > 0`` also its Spark job group (Spark UI)."""
        self.last_run_id: str | None = None
        """Id of the latest ``run``'s MLflow run (None without tracking)."""

    @property
    def np(self) -> int:
        """The ``np`` this runner was made with."""
        return self.num_processor

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """Run ``main(**kwargs)`` on every rank, each in a fresh Python process (or on the
        warm ranks inside ``with runner:``).

        ``main`` and ``kwargs`` are cloudpickled (functions defined in the caller's own
        modules are pickled by value, so workers need not import them).

        Returns:
            The return value of ``main`` on rank 0.

        Raises:
            ConfigurationError: ``main`` is not callable, or does not accept ``kwargs``
                (a name it does not take, or one it needs missing); nothing was started.
            WorkerFailedError: A rank raised, exited non-zero or was killed; names the rank,
                host, exit status and the rank's traceback (or last lines of output).
            UnsupportedVersionError: pyspark (``np > 0``) or TensorFlow (``np < 0``) outside
                the supported versions, or ``TF_USE_LEGACY_KERAS`` set; nothing was started.
            StartTimeoutError: The ranks did not all start within ``start_timeout``.
            RunTimeoutError: The job ran longer than ``timeout``.
            InsufficientSlotsError: Spark will not offer ``np`` task slots.
            BackendError: Spark or the local backend failed outside the user's code.
        """
        return self._run_with(RunHooks(), main, kwargs)

    def _run_with(self, hooks: RunHooks, main: Callable[..., Any],
                  kwargs: dict[str, Any]) -> Any:
        """:meth:`run` with per-run ``hooks`` (the sweep's epoch judge and log prefix)."""
        check_call(main, kwargs)
        compat.check_driver(self.num_processor)
        # DataFrames: each rank gets its own shard
        kwargs, feed = split_frames(kwargs, self._spark, self._options.data_compression)
        code = dumps_code(main, kwargs)  # once; unpicklable input fails before MLflow
        self._boot.new_run()  # the master is resolved once per run
        self.prepare()  # a new SparkSession boots while MLflow's run is being set up
        settings = dataclasses.replace(self._options.settings, log_prefix=hooks.log_prefix)
        with sigterm_interrupts():
            if not self._options.track:
                return self._attempts(main, code, None, settings, hooks, feed)
            from mlflow_hvd.driver.tracking.run import driver_run

            with driver_run(
                self.num_processor,
                self._describe_backend(),
                self._options.system_metrics,
                self._options.tracking_timeout,
                self._options.undelivered_dir,
            ) as target:
                self.last_run_id = target.run_id
                return self._attempts(main, code, target, settings, hooks, feed)

    def _attempts(self, main: Callable[..., Any], code: Code, target: TrackingTarget | None,
                  settings: DriverSettings, hooks: RunHooks, feed: Feed | None) -> Any:
        """Run the job; what follows a failure is :class:`RetryPolicy`'s decision: run it
        again (it never started), restart it as a new attempt in the same MLflow run (up to
        ``max_failures`` times), or raise."""
        max_failures, timeout = self._options.max_failures, self._options.tracking_timeout
        policy = RetryPolicy(max_failures)
        failures: list[BaseException] = []
        record = target if max_failures > 0 else None  # attempts only when retrying
        attempt = reruns = 0
        while True:
            if reruns == 0:
                log.info("attempt %d of %d of %s starts", attempt + 1, max_failures + 1,
                         _name(main))
                if record is not None:
                    attempts.started(record, attempt, timeout, self._undelivered_root())
            try:
                job = self._job(main, code, target, attempt, settings, hooks, feed)
                return cloudpickle.loads(self._pool.run(job, sys.stdout))
            except (WorkerFailedError, BackendError) as exc:
                decision = policy.decide(exc, attempt, reruns)
                if decision is Decision.RERUN:
                    reruns += 1
                    log.info("attempt %d never ran (%s); running it on new ranks",
                             attempt + 1, str(exc).splitlines()[0])
                    continue
                failures.append(exc)
                if record is not None:
                    attempts.failed(record, attempt, exc, timeout, self._undelivered_root())
                if decision is Decision.GIVE_UP:
                    if len(failures) == 1:
                        raise
                    raise RetriesExhaustedError(failures) from exc
                log.warning(
                    "mlflow_hvd: attempt %d of %d failed (%s); restarting the job%s",
                    attempt + 1, max_failures + 1, str(exc).splitlines()[0],
                    " from its latest checkpoint" if target is not None else "",
                )
                attempt, reruns = attempt + 1, 0

    def _job(self, main: Callable[..., Any], code: Code, target: TrackingTarget | None,
             attempt: int, settings: DriverSettings, hooks: RunHooks,
             feed: Feed | None) -> Job:
        """One attempt's job: its payload, settings, data and who answers rank 0."""
        job_id = self.last_job_id = new_job_id()
        writes = None  # rank 0's metrics, params and tags: the driver writes them
        on_fed = None  # the DataFrames' split: recorded as the run's dataset inputs
        if target is not None and feed is not None:
            from mlflow_hvd.driver.tracking.datasets import recorder

            on_fed = recorder(feed, (target.run_id, *hooks.dataset_runs))
        if target is not None:
            from mlflow_hvd.driver.tracking.epochs import rank0_requests
            from mlflow_hvd.driver.tracking.relay import Relay

            # the driver's MLflow client settings, read now, for rank 0 over the channel
            settings = dataclasses.replace(settings, credentials=collect_credentials(
                os.environ, self._options.tracking_env))
            target = dataclasses.replace(
                target, authenticated=settings.credentials is not None,
                # an earlier attempt logged: rank 0 asks the server what the run holds
                facts=target.facts if attempt == 0 else None,
                # rank 0 reports the judged metric per epoch
                prune_metric=hooks.epoch_judge.metric if hooks.epoch_judge else "")
            writes = rank0_requests(Relay(target).answer, hooks.epoch_judge, target.run_id)
        description = f"HorovodRunner(np={self.num_processor}).run({_name(main)})" + (
            f" attempt {attempt}" if attempt else "")
        return Job(payload=dumps_payload(code, target, attempt), settings=settings,
                   description=description, job_id=job_id, on_tracking_write=writes,
                   on_undelivered=self._save_undelivered, feed=feed, on_fed=on_fed)

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
        if self._pool.warm:
            raise ConfigurationError("this HorovodRunner's ranks are already kept warm "
                                     "(nested `with runner:`)")
        self._pool = RankPool(abs(self.num_processor), self._backend, warm=True)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        pool = self._pool
        self._pool = RankPool(abs(self.num_processor), self._backend, warm=False)
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

        return self._options.undelivered_dir or undelivered.default_root()

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
        return self._boot.session(self._options.settings.start_timeout)

    def _backend(self, feed: Feed | None) -> tuple[Backend, str]:
        """A backend for a new generation of ranks, fed ``feed``'s DataFrames if any."""
        np = abs(self.num_processor)
        if self.num_processor < 0:
            frame = feed.fed_frame(np) if feed is not None else None
            return LocalBackend(frame=frame), "127.0.0.1"
        from mlflow_hvd.backends.spark import SparkBackend

        spark = self._session()
        if feed is not None:
            feed.check_session(spark)
        frame = feed.fed_frame(np) if feed is not None else None
        host = spark.sparkContext.getConf().get("spark.driver.host") or "127.0.0.1"
        backend = SparkBackend(spark, self._options.slot_timeout, frame,
                               self._options.environment_timeout)
        return backend, resolve_host(host)



def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@dataclass(frozen=True)
class RunHooks:
    """Per-run settings of a face built on the runner (internal: the sweep's), passed to
    :meth:`HorovodRunner._run_with` rather than set on the runner."""

    epoch_judge: EpochJudge | None = None  # judges rank 0's per-epoch metric (pruning)
    log_prefix: str = ""  # before every worker line shown on the driver, e.g. "[trial 3]"
    dataset_runs: tuple[str, ...] = ()  # further runs that record the job's DataFrames

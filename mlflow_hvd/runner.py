"""Driver side (the user's process): ``HorovodRunner``, the API of Databricks'
``sparkdl.HorovodRunner``, open and real."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, assert_never

import cloudpickle

from mlflow_hvd.backends.base import Placement
from mlflow_hvd.backends.local import LocalPlacement
from mlflow_hvd.backends.spark.boot import refuse_unshipped
from mlflow_hvd.backends.spark.placement import SparkPlacement
from mlflow_hvd.common import compat, config
from mlflow_hvd.common.config import ClusterConfig, JobConfig, TrackingConfig
from mlflow_hvd.common.horovod_env import HorovodOptions
from mlflow_hvd.common.naming import callable_name
from mlflow_hvd.common.options import check_np
from mlflow_hvd.driver.feed import Feed, split_frames, with_shard_args
from mlflow_hvd.driver.job import Job, new_job_id
from mlflow_hvd.driver.options import runner_options
from mlflow_hvd.driver.payload import check_call, dumps_code, dumps_payload
from mlflow_hvd.driver.pool import RankPool
from mlflow_hvd.driver.retry import Attempts, Decision, Failed, RetryPolicy
from mlflow_hvd.driver.signals import sigterm_interrupts
from mlflow_hvd.driver.supervisor import DriverSettings, GrowingBack
from mlflow_hvd.driver.tracking import attempts
from mlflow_hvd.errors import (
    ConfigurationError,
    JobStopped,
    RetriesExhaustedError,
)
from mlflow_hvd.protocol.credentials import collect as collect_credentials
from mlflow_hvd.protocol.messages import (
    Code,
    EpochReport,
    EpochVerdict,
    TrackingTarget,
    UndeliveredTracking,
)

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
        spark: The SparkSession to use for ``np > 0`` (default: the active one, else one on
            the master Spark's own settings name, else an embedded ``local[N]``).
        job: How each job is started, watched and restarted (:class:`JobConfig`: timeouts,
            ``max_failures``, output line length).
        cluster: Spark, the network and what is shipped to executors
            (:class:`ClusterConfig`: master, Gloo interface, GPU resource, shipped
            environment, DataFrame shard compression).
        tracking: The job's MLflow run (:class:`TrackingConfig`: on/off, system metrics,
            the end-of-job deadline, where undelivered records go, credentials' variables).
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

    Any other keyword is refused naming the group it belongs to (``HorovodRunner(np=2,
    timeout=600)``: ``timeout`` is an option of ``JobConfig``).

    SIGTERM to the driver while ``run`` executes (main thread) ends it like Ctrl-C: ranks
    stopped, the Spark job group cancelled, the run ended KILLED, and
    :class:`~mlflow_hvd.errors.Terminated` (a ``KeyboardInterrupt``) raised.
    """

    def __init__(
        self,
        *,
        np: int,
        driver_log_verbosity: str = "log_callback_only",
        spark: Any = None,
        job: JobConfig | None = None,
        cluster: ClusterConfig | None = None,
        tracking: TrackingConfig | None = None,
        horovod: HorovodOptions | None = None,
        **misplaced: Any,
    ) -> None:
        if misplaced:
            raise ConfigurationError(config.misplaced(next(iter(misplaced)), "HorovodRunner"))
        self.num_processor = check_np(np)
        """``np`` under the attribute name of Databricks' HorovodRunner."""
        self._options = runner_options(driver_log_verbosity, job, cluster, tracking, horovod)
        self.driver_log_verbosity = self._options.settings.verbosity.value
        _check_elastic(self.num_processor, self._options.job)
        self._spark = spark
        ship = self._options.cluster.ship_environment
        if spark is not None:
            refuse_unshipped(spark, ship)
        self._stop = threading.Event()  # stop(): the running (or next) job ends as on Ctrl-C
        self._placement: Placement = (
            LocalPlacement(abs(self.num_processor), self._options.job, self._stop)
            if self.num_processor < 0
            else SparkPlacement(self.num_processor, spark, self._options.job,
                                self._options.cluster, self._stop))
        self._pool = RankPool(self._placement.backend, warm=False,
                              stop=self._stop)
        self.last_job_id: str | None = None
        """Id of the latest job; for ``np > 0`` also its Spark job group (Spark UI)."""
        self.last_run_id: str | None = None
        """Id of the latest ``run``'s MLflow run (None without tracking)."""

    @property
    def job(self) -> JobConfig:
        """The :class:`JobConfig` this runner was made with (its defaults if none)."""
        return self._options.job

    @property
    def cluster(self) -> ClusterConfig:
        """The :class:`ClusterConfig` this runner was made with (its defaults if none)."""
        return self._options.cluster

    @property
    def tracking(self) -> TrackingConfig:
        """The :class:`TrackingConfig` this runner was made with (its defaults if none)."""
        return self._options.tracking

    @property
    def horovod(self) -> HorovodOptions | None:
        """The :class:`~mlflow_hvd.HorovodOptions` this runner was made with, if any."""
        return self._options.horovod

    @property
    def spark(self) -> Any:
        """The SparkSession given to this runner (None: it uses or builds one itself)."""
        return self._spark

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
        return self.run_with(RunHooks(), main, **kwargs)

    def run_with(self, hooks: RunHooks, main: Callable[..., Any], /, **kwargs: Any) -> Any:
        """:meth:`run` with per-run :class:`RunHooks`: what a face built on the runner (the
        sweep: its trials' epoch judge, log prefix and parent run) sets for one run only.
        Returns and raises as :meth:`run`."""
        try:
            return self._run_with(hooks, main, kwargs)
        except JobStopped:
            self._stop.clear()  # the stop is spent: the runner can run again
            raise

    def stop(self) -> None:
        """Stop this runner's job from another thread, as Ctrl-C stops it in the thread
        that runs it: its ranks stopped (SIGTERM, SIGKILL after ``stop_grace``), its Spark
        job cancelled, its MLflow run ended KILLED; that thread's :meth:`run` raises
        :class:`~mlflow_hvd.errors.JobStopped` (a ``KeyboardInterrupt``) within a fraction
        of a second of the ranks being down. Called while no job runs, it stops the next
        ``run`` as it starts. Returns at once; thread-safe; idempotent."""
        self._stop.set()

    def _run_with(self, hooks: RunHooks, main: Callable[..., Any],
                  kwargs: dict[str, Any]) -> Any:
        if self._stop.is_set():
            raise JobStopped(f"{callable_name(main)} was stopped before it started")
        check_call(main, kwargs)
        compat.check_driver(self.num_processor)
        # DataFrames, passed or held by the code (converters): each rank gets its own
        # shard; the code is pickled once, and unpicklable input fails before MLflow
        code, held = dumps_code(main, with_shard_args(kwargs))
        kwargs, feed = split_frames(kwargs, self._spark, self.cluster.data_compression, held)
        self._placement.new_run()
        self.prepare()  # a new SparkSession boots while MLflow's run is being set up
        settings = dataclasses.replace(self._options.settings, log_prefix=hooks.log_prefix)
        with sigterm_interrupts():
            if not self.tracking.track:
                return self._attempts(main, code, None, settings, hooks, feed)
            from mlflow_hvd.driver.tracking.run import driver_run

            with driver_run(self.num_processor, self._placement.describe(),
                            self.tracking) as target:
                self.last_run_id = target.run_id
                return self._attempts(main, code, target, settings, hooks, feed)

    def _attempts(self, main: Callable[..., Any], code: Code, target: TrackingTarget | None,
                  settings: DriverSettings, hooks: RunHooks, feed: Feed | None) -> Any:
        """Run the job; what follows a failure is :class:`RetryPolicy`'s decision: run it
        again (it never started), restart it as a new attempt in the same MLflow run (up to
        ``max_failures`` times), or raise. An elastic job's attempt runs on as many ranks
        as there are slots for (``min_np``)."""
        max_failures, timeout = self.job.max_failures, self.tracking.tracking_timeout
        state = Attempts(RetryPolicy(max_failures))
        record = target if max_failures > 0 else None  # attempts only when retrying
        size = abs(self.num_processor)
        while True:
            attempt = state.attempt
            if state.starting:
                size = self._attempt_size(attempt)
                log.info("attempt %d of %s starts%s%s", attempt + 1, callable_name(main),
                         f" on {size} ranks" if self.job.min_np is not None else "",
                         f" ({len(state.failures)} of max_failures={max_failures} failed)"
                         if max_failures else "")
                if record is not None:
                    attempts.started(record, attempt, size, timeout, self._undelivered_root())
            job = self._job(main, code, target, attempt, size, settings, hooks, feed)
            ended = self._pool.run(job, sys.stdout)
            if isinstance(ended, bytes):
                return cloudpickle.loads(ended)
            if isinstance(ended, GrowingBack):
                decision = state.grew()
            else:
                decision = state.failed(ended)
                error = ended.error
            match decision:
                case Decision.GROW:
                    pass  # the next attempt, on np ranks (elastic.py said why)
                case Decision.RERUN:
                    log.info("attempt %d never ran (%s); running it on new ranks",
                             attempt + 1, str(error).splitlines()[0])
                case Decision.RESTART | Decision.GIVE_UP:
                    if record is not None:
                        attempts.failed(record, attempt, error, timeout,
                                        self._undelivered_root())
                    if decision is Decision.GIVE_UP:
                        assert isinstance(ended, Failed)
                        if max_failures:
                            log.warning("mlflow_hvd: attempt %d failed (%s); %s", attempt + 1,
                                        str(error).splitlines()[0],
                                        state.policy.why_not(ended, len(state.failures)))
                        if len(state.failures) == 1:
                            raise error
                        raise RetriesExhaustedError([f.error for f in state.failures]) \
                            from error
                    log.warning(
                        "mlflow_hvd: attempt %d failed (%s: %s; %d of max_failures=%d); "
                        "restarting the job%s", attempt + 1, type(error).__name__,
                        str(error).splitlines()[0], len(state.failures), max_failures,
                        " from its latest checkpoint" if target is not None else "")
                case _ as unknown:
                    assert_never(unknown)

    def _attempt_size(self, attempt: int) -> int:
        """How many ranks ``attempt`` runs on: ``|np|``, or for an elastic job as many as
        there are slots for (at least ``min_np``), with the reason logged when fewer."""
        np, least = abs(self.num_processor), self.job.min_np
        if least is None:
            return np
        size = self._placement.elastic_size(least)
        if size < np:
            log.warning(
                "mlflow_hvd: attempt %d runs on %d of np=%d ranks: Spark offers %d task slots "
                "after waiting %gs for %d (min_np=%d)", attempt + 1, size, np, size,
                self.job.slot_timeout, np, least)
        return size

    def _job(self, main: Callable[..., Any], code: Code, target: TrackingTarget | None,
             attempt: int, size: int, settings: DriverSettings, hooks: RunHooks,
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
                os.environ, self.tracking.tracking_env))
            target = dataclasses.replace(
                target, authenticated=settings.credentials is not None,
                # an earlier attempt logged: rank 0 asks the server what the run holds
                facts=target.facts if attempt == 0 else None,
                # rank 0 reports the judged metric per epoch
                prune_metric=hooks.epoch_judge.metric if hooks.epoch_judge else "")
            judge = _verdicts(hooks.epoch_judge) if hooks.epoch_judge is not None else None
            writes = rank0_requests(Relay(target).answer, judge, target.run_id)
        grow = None
        if target is not None and size < abs(self.num_processor):
            from mlflow_hvd.driver.elastic import GrowBack

            seen = target  # not None, for the callback (mypy narrows no closure)
            grow = GrowBack(abs(self.num_processor), size, self.job.grow_interval,
                            lambda: self._placement.slots_back(size),
                            lambda back: attempts.slots_seen(
                                seen, attempt, back, self.tracking.tracking_timeout,
                                self._undelivered_root()))
        elif size < abs(self.num_processor):
            log.warning("mlflow_hvd: attempt %d runs on %d of np=%d ranks and will not grow "
                        "back: growing back happens at a checkpoint committed to the job's "
                        "MLflow run, and this job does not track (TrackingConfig(track=False))",
                        attempt + 1, size, abs(self.num_processor))
        description = f"HorovodRunner(np={self.num_processor}).run({callable_name(main)})" + (
            f" attempt {attempt + 1}" if attempt else "") + (
            f" on {size} ranks" if size != abs(self.num_processor) else "")
        return Job(np=size, payload=dumps_payload(code, target, attempt),
                   settings=settings,
                   description=description, job_id=job_id, on_tracking_write=writes,
                   on_undelivered=self._undelivered_handler(
                       grow.restart if grow is not None else None),
                   feed=feed, on_fed=on_fed, grow=grow, attempt=attempt,
                   max_restarts=self.job.max_failures, rank_env=hooks.rank_env,
                   torch_nodes_are_tasks=hooks.torch_nodes_are_tasks)

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
        self._pool = RankPool(self._placement.backend, warm=True,
                              stop=self._stop)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        pool = self._pool
        self._pool = RankPool(self._placement.backend, warm=False,
                              stop=self._stop)
        try:
            pool.close()
        except Exception:
            if exc_type is None:
                raise
            # the block's own error is what the caller must see
            log.warning("mlflow_hvd: releasing the warm ranks failed", exc_info=True)

    def _undelivered_handler(
            self, restart: threading.Event | None) -> Callable[[UndeliveredTracking], None]:
        """Keeps what rank 0 could not deliver; after a planned restart (growing back) what
        it had left came after the checkpoint the next attempt resumes from: dropped."""
        if restart is None:
            return self._save_undelivered

        def handle(message: UndeliveredTracking) -> None:
            if restart.is_set():
                log.info("dropped %d record(s) rank 0 had not delivered when its attempt "
                         "ended for a restart on more ranks", len(message.records))
                return
            self._save_undelivered(message)

        return handle

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

        return self.tracking.undelivered_dir or undelivered.default_root()

    def prepare(self) -> None:
        """Start what ``run`` needs ahead of it: with ``np > 0`` and no SparkSession yet,
        Spark's JVM boots in a background thread while the caller goes on with
        other start-up work (imports, MLflow). ``run`` calls it itself, so calling it early
        only saves time. A wrong or unreachable master is refused at once.

        Raises:
            ConfigurationError: ``spark_master`` differs from the active session's master.
            BackendError: The configured standalone master does not answer.
        """
        self._placement.prepare()

    def task_slots(self) -> TaskSlots:
        """The task slots this runner's jobs can use at once: for ``np > 0`` the Spark
        session's (starting it if needed; executors x cores / ``spark.task.cpus`` as the
        master declares them, else as registered, after waiting up to ``slot_timeout`` for
        ``np`` of them), for ``np < 0`` the driver's cores.

        Raises:
            InsufficientSlotsError: Spark did not offer ``np`` slots within ``slot_timeout``.
        """
        return TaskSlots(*self._placement.task_slots())


def _check_elastic(np: int, job: JobConfig) -> None:
    """``min_np`` fits ``np``: at most ``np``, and only for Spark jobs."""
    if job.min_np is None:
        return
    if np < 0:
        raise ConfigurationError(
            f"JobConfig(min_np={job.min_np}) applies to Spark jobs (np > 0), whose hosts can "
            f"be lost; np={np} runs {-np} processes on the driver, which restart on the same "
            "machine (max_failures alone): drop min_np, or use np > 0")
    if job.min_np > np:
        raise ConfigurationError(
            f"JobConfig(min_np={job.min_np}) is above np={np}: min_np is the fewest ranks an "
            f"attempt may run on, np the most; give min_np between 1 and {np}")


@dataclass(frozen=True)
class EpochDecision:
    """An :class:`EpochJudge`'s answer for one epoch.

    Attributes:
        stop: Stop training at this epoch's end (rank 0's ``should_prune()`` says True).
        epoch: How many epochs the job has completed, as the judge counts them.
        reason: Why, for the log.
    """

    stop: bool
    epoch: int
    reason: str = ""


class EpochJudge(Protocol):
    """Judges rank 0's per-epoch metric (:attr:`RunHooks.epoch_judge`): called on the
    driver, once each time rank 0 logs ``metric`` at an epoch's end, while rank 0 waits
    for the answer; an exception it raises is logged and training goes on."""

    metric: str  # the metric rank 0 reports, as it logs it

    def __call__(self, metric: str, step: int, value: float) -> EpochDecision: ...


def _verdicts(judge: EpochJudge) -> Callable[[EpochReport], EpochVerdict]:
    """The driver's answers to rank 0's epoch reports, from ``judge``'s decisions."""

    def verdict(report: EpochReport) -> EpochVerdict:
        decision = judge(report.key, report.step, report.value)
        return EpochVerdict(decision.stop, decision.epoch, decision.reason)

    return verdict


@dataclass(frozen=True)
class RunHooks:
    """Per-run settings of a face built on the runner (the sweep is one), passed to
    :meth:`HorovodRunner.run_with` for one run rather than set on the runner.

    Attributes:
        epoch_judge: Judges rank 0's per-epoch metric and may stop the job after an epoch
            (:class:`EpochJudge`; the sweep's pruning is one).
        log_prefix: Put before every rank line shown on the driver, e.g. ``"[trial 3]"``.
        dataset_runs: Further MLflow runs that record the job's DataFrames as inputs (the
            sweep's parent run).
        rank_env: Variables every rank has while the job runs, restored after it
            (``TorchDistributor(use_gpu=False)``: ``(("CUDA_VISIBLE_DEVICES", ""),)``).
        torch_nodes_are_tasks: Each Spark task is a torchrun node of its own, as pyspark's
            TorchDistributor numbers its processes (``LOCAL_RANK`` 0 in every task, the
            task as ``GROUP_RANK`` and ``NODE_RANK``); False: hosts are the nodes.
    """

    epoch_judge: EpochJudge | None = None
    log_prefix: str = ""
    dataset_runs: tuple[str, ...] = ()
    rank_env: tuple[tuple[str, str], ...] = ()
    torch_nodes_are_tasks: bool = False


@dataclass(frozen=True)
class TaskSlots:
    """What :meth:`HorovodRunner.task_slots` reports: how many tasks can run at once, and
    where (for messages)."""

    count: int
    where: str

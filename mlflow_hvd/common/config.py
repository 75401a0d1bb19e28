"""``HorovodRunner``'s options, grouped by concern into frozen, typed objects that check
themselves when made: :class:`JobConfig` (how a job is started, watched and restarted),
:class:`ClusterConfig` (Spark, the network, and what is shipped to executors) and
:class:`TrackingConfig` (the job's MLflow run). Horovod's own tuning is
:class:`~mlflow_hvd.HorovodOptions`. ``sweep()`` and the command line take the same objects.

A misspelled or misplaced option is refused naming the group it belongs to::

    HorovodRunner(np=2, timeout=600)
    # ConfigurationError: timeout is an option of JobConfig: HorovodRunner(np=2,
    # job=JobConfig(timeout=...)) ...
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, dataclass_transform

from mlflow_hvd.common.options import check_positive_int, check_seconds
from mlflow_hvd.errors import ConfigurationError

T = TypeVar("T")
GROUPS: dict[str, type] = {}  # every group, by class name
# what is not in a group: where each of HorovodRunner's own keyword arguments goes
RUNNER_ARGUMENTS = ("np", "driver_log_verbosity", "spark", "job", "cluster", "tracking",
                    "horovod")
# the groups' parameter names on HorovodRunner and sweep()
GROUP_ARGUMENTS = {"JobConfig": "job", "ClusterConfig": "cluster",
                   "TrackingConfig": "tracking", "HorovodOptions": "horovod"}


@dataclass_transform(frozen_default=True, kw_only_default=True)
def option_group(cls: type[T]) -> type[T]:
    """A frozen, keyword-only dataclass whose constructor refuses an unknown option naming
    the group it belongs to (or the nearest name), and checks values in ``__post_init__``."""
    made = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    names = {f.name for f in dataclasses.fields(made)}  # type: ignore[arg-type]
    init: Callable[..., None] = made.__init__

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigurationError(
                f"{made.__name__} takes its options by name, e.g. {made.__name__}("
                f"{sorted(names)[0]}=...), got {len(args)} positional argument(s)")
        for name in kwargs:
            if name not in names:
                raise ConfigurationError(misplaced(name, made.__name__))
        init(self, **kwargs)

    made.__init__ = checked  # type: ignore[method-assign]
    GROUPS[made.__name__] = made
    return made


def owner(name: str) -> str | None:
    """The group an option belongs to (None: no group has it)."""
    for group_name, group in GROUPS.items():
        if name in {f.name for f in dataclasses.fields(group)}:
            return group_name
    from mlflow_hvd.common.horovod_env import HorovodOptions

    if name in {f.name for f in dataclasses.fields(HorovodOptions)}:
        return "HorovodOptions"
    return None


def misplaced(name: str, where: str) -> str:
    """The refusal of option ``name`` given to ``where`` (a group, ``HorovodRunner`` or
    ``sweep``): the group it belongs to, with the call that takes it, else the nearest
    option names."""
    group = owner(name)
    if group is not None:
        argument = GROUP_ARGUMENTS[group]
        return (f"{where}() takes no option {name!r}: {name} is an option of {group}: "
                f"{argument}={group}({name}=...), e.g. HorovodRunner(np=2, {argument}="
                f"{group}({name}=...)); sweep(..., {argument}={group}({name}=...)) takes "
                "the same")
    known = [*RUNNER_ARGUMENTS, *(f.name for g in GROUPS.values()
                                  for f in dataclasses.fields(g))]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = ""
    if close:
        hint = "; did you mean " + " or ".join(
            f"{c!r}" + (f" (in {owner(c)})" if owner(c) else "") for c in close) + "?"
    groups = ", ".join(GROUP_ARGUMENTS)
    return (f"{where}() takes no option {name!r}{hint} (options are grouped: {groups}; "
            "docs/usage.md lists each group's)")


@option_group
class JobConfig:
    """How each job is started, watched and restarted.

    Attributes:
        start_timeout: Seconds a starting job may go without progress: with no rank
            reaching the driver and no task feeding the data for that long, the job ends
            with ``StartTimeoutError`` naming the ranks that never started.
        slot_timeout: Seconds to wait for Spark executors to offer ``np`` task slots.
        timeout: Optional limit in seconds on the whole run (None: no limit).
        stop_grace: Seconds between SIGTERM and SIGKILL when stopping ranks.
        idle_timeout: Inside ``with runner:``, warm ranks that wait longer than this for
            the next ``run`` are retired (their Spark slots freed); the next ``run`` starts
            new ones.
        max_failures: Restart the whole job after a rank or backend failure, up to this many
            times (all-or-nothing, like a Spark barrier stage; default 0: no restart). Each
            attempt runs in the same MLflow run, so training code that resumes from the
            run's latest checkpoint (:func:`mlflow_hvd.keras.restore_from_checkpoint`)
            continues where the failed attempt's last checkpoint left off. Every attempt is
            logged (metrics ``mlflow_hvd.attempt`` and ``mlflow_hvd.world_size``, its number
            of ranks, at step = attempt, and
            ``attempts/attempt_<k>_error.txt`` with each failure in full); when all fail,
            :class:`~mlflow_hvd.errors.RetriesExhaustedError` carries every cause.
            Workers can read their attempt with :func:`mlflow_hvd.attempt`.
        min_np: Elastic jobs (``np > 0``): the fewest ranks an attempt may run on (None:
            every attempt runs on ``np``). Each attempt waits up to ``slot_timeout`` for
            ``np`` task slots, then starts on as many as Spark offers if that is at least
            ``min_np`` (``hvd.size()`` is the new size; DataFrame arguments are split again
            into equal shards over the new ranks), from the run's latest checkpoint; fewer
            fail with ``InsufficientSlotsError`` naming both counts. Needs ``max_failures >=
            1`` (a job shrinks when it restarts after losing a host). A job running below
            ``np`` grows back when the missing slots return: at the first checkpoint in its
            run after they are found, it restarts on ``np`` ranks from that checkpoint (a
            planned restart, not counted as a failure). A job that does not track
            (``TrackingConfig(track=False)``) has no checkpoints in a run: it shrinks but
            never grows back (said in the lifecycle log). docs/usage.md#elastic-jobs.
        grow_interval: Seconds between two looks for the missing slots of a job running
            below ``np`` (made by the driver while the attempt runs, the first this long
            after it started): the fewest seconds between two resizes of a job.
        max_line_bytes: Longer output lines of the ranks are cut with a ``...[line
            truncated: N more bytes]`` marker.
    """

    start_timeout: float = 60.0
    slot_timeout: float = 30.0
    timeout: float | None = None
    stop_grace: float = 5.0
    idle_timeout: float = 3600.0
    max_failures: int = 0
    min_np: int | None = None
    grow_interval: float = 300.0
    max_line_bytes: int = 16384

    def __post_init__(self) -> None:
        for name in ("start_timeout", "slot_timeout", "stop_grace", "idle_timeout",
                     "grow_interval"):
            _set(self, name, check_seconds(name, getattr(self, name)))
        if self.timeout is not None:
            _set(self, "timeout", check_seconds("timeout", self.timeout))
        check_positive_int("max_failures", self.max_failures, 0)
        check_positive_int("max_line_bytes", self.max_line_bytes, 80)
        if self.min_np is not None:
            check_positive_int("min_np", self.min_np, 1)
            if self.max_failures < 1:
                raise ConfigurationError(
                    f"min_np={self.min_np} needs max_failures >= 1: a job runs on fewer "
                    "ranks only when it restarts after a failure (a lost host), e.g. "
                    f"JobConfig(min_np={self.min_np}, max_failures=3)")


ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")  # what spark.archives unpacks
COMPRESSIONS = (None, "lz4", "zstd")  # what Arrow IPC files can be compressed with


@option_group
class ClusterConfig:
    """Spark, the network, and what is shipped to the executors (``np > 0``; ``gloo_iface``
    and ``data_compression`` apply to ``np < 0`` too).

    Attributes:
        spark_master: The Spark master for a new session (e.g. ``spark://host:7077``);
            None or ``"auto"``: ``PYSPARK_SUBMIT_ARGS``' ``--master``, ``spark.master`` in
            ``spark-defaults.conf``, or ``MASTER``, as ``spark-submit`` reads them.
        gloo_iface: Network interface for Gloo (default: the one routing to the driver).
        gpu_resource: With Spark's resource scheduling
            (``spark.task.resource.<name>.amount``): the resource whose addresses each rank
            gets as ``CUDA_VISIBLE_DEVICES`` (default ``"gpu"``). A rank sees the GPUs Spark
            gave the job's tasks on its host, ordered by local rank, so
            ``gpus[hvd.local_rank()]`` is the one Spark gave its own task; where Spark let
            tasks share a GPU (a fractional amount), a rank sees only its own. Without the
            resource nothing is changed. ``np < 0``: ``CUDA_VISIBLE_DEVICES`` is left as the
            driver has it, so local rank ``i`` takes the driver's ``i``-th visible GPU.
        ship_environment: True: this venv, packed (cached), shipped with the session the
            runner builds, or uploaded to a Spark Connect session when its first job
            starts; a path: that archive (docs/cluster.md).
        environment_timeout: Seconds a shipped environment gets to be uploaded to a Spark
            Connect session, or unpacked on the driver while the session the runner builds
            starts (Spark unpacks archives there too; added to ``start_timeout``); and again
            to be unpacked on every executor before the session's first job, with Horovod
            loaded from it (a plain Spark stage ahead of the barrier stage; once per
            application, or per Connect session).
        data_compression: ``"lz4"``/``"zstd"`` compress the shards of DataFrame arguments
            (less disk, a copy as ranks read); None: memory-mapped (docs/data.md).
    """

    spark_master: str | None = None
    gloo_iface: str | None = None
    gpu_resource: str = "gpu"
    ship_environment: bool | str = False
    environment_timeout: float = 600.0
    data_compression: str | None = None

    def __post_init__(self) -> None:
        if self.spark_master is not None and not isinstance(self.spark_master, str):
            raise ConfigurationError(
                "spark_master must be a master URL such as 'spark://host:7077' (or None), "
                f"got {type(self.spark_master).__name__}")
        if self.gloo_iface is not None and (not isinstance(self.gloo_iface, str)
                                            or not self.gloo_iface):
            raise ConfigurationError(
                f"gloo_iface must be a network interface name such as 'eth0' (or None), got "
                f"{self.gloo_iface!r}")
        name = self.gpu_resource
        if not isinstance(name, str) or not name or not name.replace("_", "").replace(
                "-", "").replace(".", "").isalnum():
            raise ConfigurationError(
                f"gpu_resource must be the name of a Spark resource (as in "
                f"spark.task.resource.<name>.amount), got {name!r}")
        _set(self, "ship_environment", check_ship_environment(self.ship_environment))
        _set(self, "environment_timeout",
             check_seconds("environment_timeout", self.environment_timeout))
        if self.data_compression not in COMPRESSIONS:
            raise ConfigurationError(
                "data_compression must be None (uncompressed: ranks memory-map their shards "
                f"without copying), 'lz4' or 'zstd', got {self.data_compression!r}")


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


@option_group
class TrackingConfig:
    """The job's one MLflow run.

    Attributes:
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
        tracking_env: Names of further variables of the driver's environment that rank 0's
            MLflow client needs, e.g. an artifact store's (``AWS_ACCESS_KEY_ID``, ...).
            They reach rank 0 as MLflow's own client settings do: the driver's
            ``MLFLOW_TRACKING_USERNAME``, ``MLFLOW_TRACKING_PASSWORD``,
            ``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_INSECURE_TLS`` and the files of
            ``MLFLOW_TRACKING_SERVER_CERT_PATH`` / ``MLFLOW_TRACKING_CLIENT_CERT_PATH``, read
            at each ``run``, are handed to the job's rank 0 over its channel, sealed with the
            job's secret, and to no other rank (docs/cluster.md: "Tracking servers with
            authentication").
    """

    track: bool = True
    log_system_metrics: bool = False
    tracking_timeout: float = 30.0
    undelivered_dir: str | None = None
    tracking_env: Sequence[str] = ()

    def __post_init__(self) -> None:
        for name in ("track", "log_system_metrics"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(
                    f"{name} must be True or False, got {getattr(self, name)!r}")
        _set(self, "tracking_timeout", check_seconds("tracking_timeout", self.tracking_timeout))
        if self.undelivered_dir is not None:
            if not isinstance(self.undelivered_dir, str | os.PathLike):
                raise ConfigurationError(
                    f"undelivered_dir must be a directory path (or None), got "
                    f"{self.undelivered_dir!r}")
            _set(self, "undelivered_dir", os.fspath(self.undelivered_dir))
        value = self.tracking_env
        if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
            raise ConfigurationError(
                "tracking_env must be a list of environment variable names, e.g. "
                f"['AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY'], got {value!r}")
        _set(self, "tracking_env", tuple(value))


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # a frozen dataclass normalising its own field


def group_argument(value: Any, group: type[T], name: str) -> T:
    """``value`` as given for HorovodRunner's or sweep's ``name`` argument: an instance of
    ``group`` (None: its defaults).

    Raises:
        ConfigurationError: Anything else (a dict included), naming the class to use.
    """
    if value is None:
        return group()
    if not isinstance(value, group):
        raise ConfigurationError(
            f"{name} must be a mlflow_hvd.{group.__name__} (e.g. {name}={group.__name__}("
            f"...)), got {type(value).__name__}")
    return value

"""The one exception hierarchy of mlflow_hvd.

Every exception here survives pickling (it may be raised in a worker and re-raised on the
driver), so each class keeps its constructor arguments in ``self.args`` order or defines
``__reduce__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LIFECYCLE_HINT = (
    "Each rank's start and exit and the driver's decisions are in the lifecycle log: set "
    "MLFLOW_HVD_LOG_LEVEL=INFO (or call mlflow_hvd.enable_logging())"
)


class MlflowHvdError(Exception):
    """Base class of every error raised by mlflow_hvd."""


class ConfigurationError(MlflowHvdError, ValueError):
    """An argument or setting is invalid; the message names it and what to do."""


class UnsupportedVersionError(ConfigurationError):
    """An installed library (pyspark, TensorFlow, Keras) is outside the versions mlflow_hvd
    works with; the message names the version found and the supported range."""


class InsufficientSlotsError(ConfigurationError):
    """The cluster cannot run ``np`` barrier tasks at once."""


class SparkBarrierUnsupportedError(ConfigurationError):
    """The Spark configuration cannot run a barrier-mode stage."""


class EnvironmentArchiveError(ConfigurationError):
    """The environment cannot be packed for the executors, or an executor's unpacked
    archive does not match what was packed (Python, platform, Horovod's build); the message
    names what was expected, what was found and what to do."""


def unfit_environment(where: str, differences: list[str] | tuple[str, ...]
                      ) -> EnvironmentArchiveError:
    """The one error for a shipped environment that does not fit a host (``where``: the
    host, and its task when known), naming each difference and what to do."""
    return EnvironmentArchiveError(
        f"the environment shipped to the executors does not fit {where}: "
        f"{'; '.join(differences)}. Pack it where the executors' Python and platform are the "
        "same (python -m mlflow_hvd.cli.pack_env), or give the nodes that interpreter")


class InstallError(MlflowHvdError):
    """Something mlflow_hvd installs into an environment (Horovod, the project itself)
    could not be built, installed or verified there."""


class StartTimeoutError(MlflowHvdError, TimeoutError):
    """Not every rank started before the start deadline."""


class RunTimeoutError(MlflowHvdError, TimeoutError):
    """The job did not finish before the run deadline."""


class ChannelError(MlflowHvdError):
    """The worker-to-driver channel failed (connection, framing or authentication)."""


class AuthenticationError(ChannelError):
    """A message reached the driver without a valid signature for this run."""


class BackendError(MlflowHvdError):
    """The launch backend (e.g. the Spark job) failed outside of the user's code."""


class DataInputError(ConfigurationError):
    """A DataFrame passed to ``run`` cannot be fed to the ranks as it is (a column type or
    null values, rows per rank, another session); the message names the argument, the
    column or the counts, and what to do."""


class FeedError(BackendError):
    """Writing a DataFrame's partitions to the ranks' hosts failed (e.g. a full disk); the
    message names the host's directory and the bytes."""


class JobNotStartedError(BackendError):
    """Warm ranks died after taking a job but before starting it (e.g. killed while idle):
    the job never ran. ``HorovodRunner`` runs it again on new ranks."""


class IncompatibleImportError(MlflowHvdError, ImportError):
    """A module that cannot work in this environment was imported (e.g. Horovod's Keras
    layer under Keras 3, or mlflow_hvd's Keras layer where TensorFlow or Horovod is not
    installed); the message names the replacement or the command that installs what is
    missing."""


class TrackingError(MlflowHvdError):
    """Logging to the driver's MLflow run failed, or a rank asked MLflow for something only
    rank 0 may read (the message says what to do instead)."""


class RetriesExhaustedError(MlflowHvdError):
    """The job failed on every attempt: ``max_failures`` restarts did not help.

    Attributes:
        failures: The error of each attempt, first to last (each a WorkerFailedError or
            BackendError with its own root cause).
    """

    def __init__(self, failures: Sequence[BaseException]) -> None:
        self.failures = tuple(failures)
        lines = [f"the job failed on all {len(self.failures)} attempts:"]
        for i, exc in enumerate(self.failures):
            first = str(exc).splitlines()[0] if str(exc) else ""
            lines.append(f"attempt {i}: {type(exc).__name__}: {first}")
        lines.append(f"Last attempt in full:\n{self.failures[-1]}")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.failures,))

    @property
    def last(self) -> BaseException:
        return self.failures[-1]


class Terminated(KeyboardInterrupt):
    """The driver received SIGTERM (a scheduler, ``kill`` or a container stop).

    A :class:`KeyboardInterrupt`, so that it unwinds the driver exactly like Ctrl-C: the
    job is stopped, the Spark job group cancelled and the MLflow run ended KILLED.
    """


class JobStopped(KeyboardInterrupt):
    """:meth:`HorovodRunner.stop` was called (from another thread) while this runner's job
    ran or was about to start.

    A :class:`KeyboardInterrupt`, so that the job unwinds exactly as on Ctrl-C: its ranks
    stopped, its Spark job cancelled, its MLflow run ended KILLED.
    """


# What Horovod and Gloo say on the surviving ranks when a peer dies mid-collective.
PEER_LOSS_MARKS = (
    "Horovod has been shut down",
    "HorovodInternalError",
    "Connection closed by peer",
    "Connection reset by peer",
    "__wrapped__HorovodAllreduce",
    "__wrapped__HorovodBroadcast",
    "__wrapped__HorovodAllgather",
)


@dataclass(frozen=True)
class RankFailure:
    """What is known about one failed rank.

    Attributes:
        rank: Horovod rank of the worker.
        host: Host the worker ran on.
        exit_code: Exit status; negative values are signals (``-9`` is SIGKILL); ``None`` if
            the process was not seen exiting.
        error: One-line summary of the error (``ValueError: boom``), empty if unknown.
        traceback: The worker's own formatted traceback, empty if the worker died without one.
        output_tail: The rank's last lines of output (stdout and stderr), for failures
            without a traceback.
        timestamp: Time (``time.time()``) the failure was observed.
    """

    rank: int
    host: str
    exit_code: int | None
    error: str
    traceback: str
    output_tail: tuple[str, ...]
    timestamp: float

    @property
    def lost_a_peer(self) -> bool:
        """Whether this rank failed in a Horovod collective because another rank went away
        (Horovod shut down, Gloo's connection closed): a consequence, not a cause."""
        text = f"{self.error}\n{self.traceback}"
        return any(mark in text for mark in PEER_LOSS_MARKS)

    def describe_exit(self) -> str:
        """Human-readable exit status, e.g. ``exit code 3`` or ``killed by signal SIGKILL``."""
        import signal

        if self.exit_code is None:
            return "no exit status"
        if self.exit_code < 0:
            try:
                name = signal.Signals(-self.exit_code).name
            except ValueError:
                name = str(-self.exit_code)
            return f"killed by signal {name}"
        return f"exit code {self.exit_code}"


class WorkerFailedError(MlflowHvdError):
    """One or more ranks failed; the first failure is the root cause.

    Attributes:
        root_cause: The earliest failure.
        failures: All failures observed, root cause first.
        stopped_ranks: Ranks that were stopped by the driver after the root cause.
        unreported_ranks: Ranks whose exit never reached the driver (their task or host
            may be lost).
    """

    def __init__(
        self,
        root_cause: RankFailure,
        failures: Sequence[RankFailure] = (),
        stopped_ranks: Sequence[int] = (),
        unreported_ranks: Sequence[int] = (),
    ) -> None:
        self.root_cause = root_cause
        self.failures = tuple(failures) or (root_cause,)
        self.stopped_ranks = tuple(stopped_ranks)
        self.unreported_ranks = tuple(unreported_ranks)
        super().__init__(self._format())

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.root_cause, self.failures, self.stopped_ranks, self.unreported_ranks),
        )

    @property
    def rank(self) -> int:
        return self.root_cause.rank

    @property
    def host(self) -> str:
        return self.root_cause.host

    @property
    def exit_code(self) -> int | None:
        return self.root_cause.exit_code

    def _format(self) -> str:
        rc = self.root_cause
        lines = [
            f"Rank {rc.rank} on host {rc.host} failed ({rc.describe_exit()}) [root cause]"
            + (f": {rc.error}" if rc.error else "")
        ]
        if rc.traceback:
            lines.append(f"Traceback of rank {rc.rank}:")
            lines.append(rc.traceback.rstrip())
        elif rc.output_tail:
            lines.append(f"Last {len(rc.output_tail)} lines of output of rank {rc.rank}:")
            lines.extend(rc.output_tail)
        else:
            lines.append(f"Rank {rc.rank} wrote no traceback and no output.")
        for other in self.failures:
            if other is rc:
                continue
            lines.append(
                f"Also failed afterwards: rank {other.rank} on host {other.host} "
                f"({other.describe_exit()})" + (f": {other.error}" if other.error else "")
            )
        if self.stopped_ranks:
            lines.append(
                "Stopped by the driver after the root cause: ranks "
                + ", ".join(str(r) for r in self.stopped_ranks)
            )
        if self.unreported_ranks:
            lines.append(
                "No exit report reached the driver from ranks "
                + ", ".join(str(r) for r in self.unreported_ranks)
                + " (their task or host may be lost)"
            )
        lines.append(LIFECYCLE_HINT)
        return "\n".join(lines)

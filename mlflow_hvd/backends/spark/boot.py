"""Driver side: which SparkSession a run uses, chosen once per run, and a new one booted in
the background while the caller goes on (``HorovodRunner.prepare``).

The master is resolved (and a standalone one probed) once per run: the run's tags, the
session and the backend all use that one choice. A session that does not come up within
the runner's ``start_timeout`` is an error naming it, not a hang.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, assert_never

from mlflow_hvd.common.config import ClusterConfig
from mlflow_hvd.common.phases import Phase, PhaseTimeout, in_phase
from mlflow_hvd.errors import ConfigurationError, EnvironmentArchiveError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unchosen:
    """A run begins: its master is not resolved yet."""


@dataclass(frozen=True)
class Chosen:
    """The run's master, and its session: the active one, or None (one is to be booted)."""

    session: Any
    master: str


@dataclass(frozen=True)
class Booting:
    """A new session on ``master`` starts in a thread; ``unpacking``: it ships an archive,
    which Spark unpacks on the driver too before its context is up."""

    master: str
    started: Future[Any]
    unpacking: bool


BootState = Unchosen | Chosen | Booting


class SessionBoot:
    """The SparkSession choice of one ``HorovodRunner`` (``np > 0``, no explicit session):
    ``Unchosen -> Chosen`` (the master resolved: an active session, or none) ``-> Booting``
    (a new one starting) ``-> Chosen`` (it started, or failed: the next run boots again).

    Args:
        np: Number of ranks (an embedded ``local[max(np, cores)]`` master when nothing
            names one).
        cluster: ``HorovodRunner(cluster=...)``: the master, and the environment shipped
            with the session.
        probe_timeout: Seconds a standalone master gets to accept a connection.
        stop: The runner's stop request: packing and the wait for the session end at once
            when it is set (:mod:`mlflow_hvd.common.phases`).
    """

    def __init__(self, np: int, cluster: ClusterConfig, probe_timeout: float,
                 stop: threading.Event | None = None) -> None:
        self.np, self.spark_master, self.probe_timeout = np, cluster.spark_master, probe_timeout
        self.stop = stop
        self.ship_environment = cluster.ship_environment
        # a shipped archive is unpacked by the driver too while its context starts
        self.environment_timeout = cluster.environment_timeout
        self.state: BootState = Unchosen()

    def new_run(self) -> None:
        """Forget the last run's choice (unless a boot it started is still under way)."""
        if not isinstance(self.state, Booting):
            self.state = Unchosen()

    def choice(self) -> tuple[Any, str]:
        """(active session or None, master URL), resolved once per run.

        Raises:
            ConfigurationError: ``spark_master`` differs from the active session's master.
            BackendError: The configured standalone master does not answer.
        """
        match self.state:
            case Unchosen():
                from mlflow_hvd.backends.spark.session import resolve_master

                self.state = Chosen(*resolve_master(self.np, self.spark_master,
                                                    self.probe_timeout))
                return self.state.session, self.state.master
            case Chosen(session=session, master=master):
                return session, master
            case Booting(master=master):
                return None, master
            case _ as unknown:
                assert_never(unknown)

    def start(self) -> None:
        """With no active session, boot one in a background thread (idempotent)."""
        if isinstance(self.state, Booting):
            return
        active, master = self.choice()
        if active is not None:
            refuse_unshipped(active, self.ship_environment)
            return
        from mlflow_hvd.backends.spark.session import new_session

        archive = in_phase(Phase.PACKING, environment_archive, self.ship_environment, master,
                           limit=self.environment_timeout,
                           option="ClusterConfig(environment_timeout)", stop=self.stop)
        if archive is not None:
            check_room_to_unpack(archive, spark_local_dir())
        started: Future[Any] = Future()

        def boot() -> None:
            try:
                started.set_result(new_session(master, archive))
            except BaseException as exc:  # handed to the waiter
                started.set_exception(exc)

        threading.Thread(target=boot, name="mlflow-hvd-spark-boot", daemon=True).start()
        self.state = Booting(master, started, unpacking=archive is not None)

    def session(self, timeout: float) -> Any:
        """The run's session: the active one, or the one booting (waited for at most
        ``timeout`` seconds, ``start_timeout``).

        Raises:
            PhaseTimeout: The session did not start in time (a BackendError).
            JobStopped: The runner was asked to stop meanwhile.
            Exception: Whatever starting the session raised.
        """
        self.start()
        booting = self.state
        if not isinstance(booting, Booting):
            return self.choice()[0]
        # Spark unpacks spark.archives on the driver as well (SparkFiles) before the
        # context is up: a shipped environment's gigabytes get their own allowance
        extra = self.environment_timeout if booting.unpacking else 0.0
        self.state = Chosen(None, booting.master)  # after a failure the next run boots again
        try:
            session = in_phase(Phase.BOOTING, booting.started.result, limit=timeout + extra,
                               option="start_timeout", stop=self.stop)
        except PhaseTimeout:
            allowance = (f" + {extra:g}s (environment_timeout: Spark unpacks the shipped "
                         "environment on the driver too)" if extra else "")
            raise PhaseTimeout(
                f"the SparkSession on {booting.master} did not start within {timeout:g}s "
                f"(start_timeout){allowance}: Spark's JVM is hung or very slow to start; "
                "check JAVA_HOME and Spark's driver log, or raise start_timeout"
            ) from None
        self.state = Chosen(session, booting.master)  # active from now on
        return session


def spark_local_dir() -> str:
    """Where this driver's Spark will unpack ``spark.archives`` (SparkFiles' directory is
    made in Spark's first local directory): ``SPARK_LOCAL_DIRS``, else the JVM's temporary
    directory, ``/tmp`` (``spark.local.dir`` in ``spark-defaults.conf`` is not read here)."""
    first = os.environ.get("SPARK_LOCAL_DIRS", "").split(",")[0].strip()
    return first or "/tmp"


def check_room_to_unpack(archive: str, directory: str) -> None:
    """Refuse to start a session that ships ``archive`` when ``directory`` (where the
    driver's Spark unpacks it, before the context is up) has less free space than the
    archive records it takes unpacked (archives packed by mlflow_hvd record it; others are
    not checked): at once, instead of a failure inside Spark's start-up.

    Raises:
        EnvironmentArchiveError: Not enough room, naming the space needed and the space free.
    """
    from mlflow_hvd.common.env_archive import fingerprint_of_archive

    recorded = fingerprint_of_archive(archive)
    needed = recorded.unpacked_bytes if recorded is not None else 0
    if not needed:
        return
    try:
        free = shutil.disk_usage(directory).free
    except OSError:  # not there yet: Spark makes it, on the file system of its parent
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(directory)) or "/").free
    if free < needed:
        raise EnvironmentArchiveError(
            f"the environment shipped to the executors ({archive}) takes "
            f"{needed / 1e9:.2f} GB unpacked, and Spark unpacks it on the driver too, in "
            f"{directory}, where {free / 1e9:.2f} GB are free: free {(needed - free) / 1e9:.2f} "
            "GB there, or point SPARK_LOCAL_DIRS at a disk with room")


def environment_archive(ship: bool | str, master: str) -> str | None:
    """The archive a new session on ``master`` ships (``HorovodRunner(ship_environment)``):
    None when nothing is shipped. ``local[...]`` masters run tasks in the driver's own
    process tree: nothing to ship."""
    if ship is False:
        return None
    if master.startswith("local[") or master == "local":
        log.info("ship_environment: not applied on %s (tasks run beside the driver)", master)
        return None
    return archive_of(ship)


def archive_of(ship: bool | str) -> str:
    """The archive ``ship_environment`` names: its path, or for True this venv packed (or
    its cached archive)."""
    if isinstance(ship, str):
        return ship
    from mlflow_hvd.common.env_archive import pack_environment

    log.info("ship_environment: packing %s for the executors (once; reused while it is "
             "unchanged)", sys.prefix)
    packed = pack_environment()
    how = "cached" if packed.reused else f"packed in {packed.seconds:.0f} s"
    log.info("ship_environment: %s (%.0f MiB, %s)", packed.path, packed.size / 2**20, how)
    if not packed.reused:  # a minute or more of silence otherwise
        print(f"mlflow_hvd: packed {sys.prefix} for the executors in {packed.seconds:.0f} s: "
              f"{packed.path} ({packed.size / 2**20:.0f} MiB; reused while unchanged)",
              file=sys.stderr, flush=True)
    return packed.path


def refuse_unshipped(session: Any, ship: bool | str) -> None:
    """``ship_environment`` applies to a classic session the runner builds: an existing one
    must already ship an environment (its ``spark.archives``). A Spark Connect session is
    given the environment when a job starts (:func:`.environment.ship_to_connect`)."""
    if ship is False:
        return
    from mlflow_hvd.backends.spark.api import session_api
    from mlflow_hvd.common.env_archive import shipped_archive

    api = session_api(session)
    if api.ships_with_jobs:
        return
    conf = api.conf()
    if shipped_archive(conf.get("spark.archives", "") or "") is None:
        raise ConfigurationError(
            "ship_environment applies to the SparkSession HorovodRunner builds, and this "
            "process already has one: build it with spark.archives=<archive>#environment and "
            "PYSPARK_PYTHON=./environment/bin/python in the environment (python -m "
            "mlflow_hvd.cli.pack_env prints both), or stop it first")

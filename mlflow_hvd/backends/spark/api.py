"""One face over the two kinds of SparkSession the runner drives.

A **classic** session has a SparkContext in this process (py4j to a driver JVM beside it): its
configuration, job groups, task slots and RDDs. A **Spark Connect** session
(``SparkSession.builder.remote("sc://...")``, ``spark.api.mode=connect``, Databricks Connect
and its standard and serverless compute) is a gRPC client of a server elsewhere, with no
SparkContext: it has the DataFrame API, the session's runtime configuration, operation tags
(``addTag``/``interruptTag``) and session artifacts (``addArtifacts``). The barrier stage,
cancellation and the checks before it go through :func:`session_api`, so the backend does not
ask which kind it drives.
"""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from mlflow_hvd.backends.spark import private, removals
from mlflow_hvd.common import network
from mlflow_hvd.common.deadline import Deadline, Running
from mlflow_hvd.common.phases import STOP_LOOK
from mlflow_hvd.errors import BackendError, JobStopped

PYTHON_CONF = "spark.sql.execution.pyspark.python"  # a session's Python workers' interpreter


def is_connect(session: Any) -> bool:
    """True for a Spark Connect session (no SparkContext; without importing its client)."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def active_session() -> Any:
    """The active (else the default) SparkSession of this process, classic or Spark Connect;
    None when there is none. Connect's client module is looked at only if it is loaded (a
    Connect session exists only then): a classic-only install never imports it."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    connect = sys.modules.get("pyspark.sql.connect.session")
    if connect is None:
        return None
    session = connect.SparkSession.getActiveSession()
    if session is None:  # active is per thread; the default is the process's first session
        try:
            session = connect.SparkSession.active()
        except Exception:  # no active nor default session: pyspark raises, not returns None
            return None
    return session


class ClassicApi:
    """A classic session: its SparkContext's configuration, job groups and slots."""

    # an environment is given to the session as it is built (spark.archives), not per job
    ships_with_jobs: Literal[False] = False
    # this process holds the application (a SparkContext): its scheduler's state is visible
    remote = False

    def __init__(self, session: Any) -> None:
        self.session = session
        self._sc = session.sparkContext
        self._removals = removals.watch(self._sc)

    def master(self) -> str:
        return str(self._sc.master)

    def conf(self) -> Any:
        """The application's configuration (``get(key, default)``, ``getAll()``)."""
        return self._sc.getConf()

    def application_id(self) -> str:
        return str(self._sc.applicationId)

    def scope(self) -> str:
        """Where files shipped to the executors live: the application."""
        return self.application_id()

    def stopped(self) -> bool:
        return private.context_stopped(self._sc)

    def task_slots(self) -> int | None:
        """Tasks the cluster can run at once right now (executors x cores / task cpus)."""
        return private.max_concurrent_tasks(self._sc)

    def driver_host(self) -> str:
        """Where executors reach this process: Spark's own ``spark.driver.host``."""
        return str(self.conf().get("spark.driver.host") or "127.0.0.1")

    @contextmanager
    def tagged(self, tag: str, description: str) -> Iterator[None]:
        """The Spark jobs this thread starts inside belong to ``tag`` (a job group, which
        :meth:`cancel` kills; its properties are thread-local: call it in a thread that
        submits only this work)."""
        self._sc.setJobGroup(tag, description, interruptOnCancel=True)
        yield

    def cancel(self, tag: str) -> None:
        """Cancel ``tag``'s jobs; a stopped context has none left (and would raise, hiding
        the error that ended the job)."""
        if not self.stopped():
            self._sc.cancelJobGroup(tag)

    def removed_executors(self) -> list[tuple[str, str]]:
        """(host, reason) of every executor Spark removed from this application; read on
        failure paths, to say more than Spark's error, never raising a second error in
        place of the first: what a watch kept while the context ran (:mod:`.removals`; a
        context Spark stopped has lost them), with what it says now if it still runs."""
        return self._removals.removed()

    def parallel_tasks(self, count: int, fn: Any) -> Any:
        """``count`` tasks, each running ``fn(rows)`` over one number of ``range(count)``."""
        return self._sc.parallelize(range(count), count).mapPartitions(fn)

    def barrier_tasks(self, count: int, fn: Any) -> Any:
        """A barrier stage of ``count`` tasks over ``range(count)``, ``fn(rows)`` in each: an
        RDD, whose first stage in a new JVM starts sooner than a DataFrame's."""
        return self._sc.parallelize(range(count), count).barrier().mapPartitions(fn)

    def facts(self) -> dict[str, str]:
        """What the run's tags say of where it ran."""
        return {"spark_master": self.master()}

    def run_barrier(self, count: int, frame: Any, by_rows: Any, by_arrow: Any,
                    schema: str) -> None:
        """Run a barrier stage of ``count`` tasks to its end: over ``frame``'s partitions
        (``by_arrow``, ``mapInArrow``), or with no frame an RDD (``by_rows``)."""
        if frame is None:
            self.barrier_tasks(count, by_rows).collect()
        else:
            frame.mapInArrow(by_arrow, schema, barrier=True).collect()

    def each_task(self, count: int, by_rows: Any, by_arrow: Any, schema: str) -> list[Any]:
        """The rows of ``count`` plain tasks (an RDD: ``by_rows``)."""
        del by_arrow, schema
        return list(self.parallel_tasks(count, by_rows).collect())

    def unreachable_hint(self, driver_host: str) -> str:
        """What to add when the tasks could not reach this process at ``driver_host``:
        nothing beyond the error's own advice (the executors' ``spark.driver.host``)."""
        del driver_host
        return ""


class ConnectApi:
    """A Spark Connect session: the server's configuration as the session reads it, its
    operation tags, and the DataFrame API only."""

    # an environment is uploaded to the session when its first job starts (addArtifacts)
    ships_with_jobs: Literal[True] = True
    # a client of a server elsewhere: the application's scheduler is out of sight
    remote = True

    def __init__(self, session: Any) -> None:
        self.session = session
        self._conf: _ConnectConf | None = None

    def master(self) -> str:
        return str(self.conf().get("spark.master") or "unknown")

    def conf(self) -> Any:
        """The session's configuration as one snapshot (one round trip): the server's
        ``spark.*`` settings and the session's own."""
        if self._conf is None:
            self._conf = _ConnectConf(dict(self.session.conf.getAll))
        return self._conf

    def application_id(self) -> str:
        return str(self.conf().get("spark.app.id") or self.session.session_id)

    def scope(self) -> str:
        """Where files shipped to the executors live: this session (the server keeps each
        session's artifacts, and runs its Python workers, in a directory of its own)."""
        return f"{self.application_id()}/{self.session.session_id}"

    def add_archive(self, path: str, alias: str) -> None:
        """Upload ``path`` as a session artifact every executor unpacks as ``./alias`` in
        the session's working directory (``addArtifacts(..., archive=True)``)."""
        self.session.addArtifacts(f"{path}#{alias}", archive=True)

    def set_python(self, executable: str) -> None:
        """The interpreter the session's Python workers run from now on (a path relative to
        the session's working directory on each executor may name a shipped archive's)."""
        self.session.conf.set(PYTHON_CONF, executable)
        self._conf = None  # the snapshot no longer holds

    def stopped(self) -> bool:
        return bool(self.session.is_stopped)

    def task_slots(self) -> int | None:
        """Unknown: a Connect client cannot ask the scheduler (the master's declared size,
        :func:`.session.expected_slots`, is what there is)."""
        return None

    def server_host(self) -> str:
        """The Connect server's host, as the client dials it."""
        return str(self.session.client.host)

    def driver_host(self) -> str:
        """Where the executors are to reach this process (the runner's servers listen
        there): this machine's address on the route to the Connect server, the executors
        being near that server. A server dialled on loopback runs on this machine, or at
        the end of a tunnel: on this machine its own ``spark.driver.host`` is the address
        its executors reach; through a tunnel there is none for them to reach.

        Raises:
            BackendError: The server is dialled on loopback but is not on this machine (a
                tunnel: its executors cannot reach this client).
        """
        source = network.route_source_or_loopback(self.server_host())
        if source != "127.0.0.1":
            return source
        served = str(self.conf().get("spark.driver.host") or "")
        if not served:  # the server does not say: taken to be on this machine
            return source
        if network.is_local_address(served):
            return served
        raise BackendError(
            f"the Spark Connect server is dialled on loopback ({self.server_host()}) but is "
            f"not on this machine (its driver host is {served}): a tunnel. Its executors "
            f"(master {self.master()}) would have to open connections to this client, "
            "which runs the job's channel and rendezvous servers, and a tunnel gives them "
            "no address to reach it at. Run the client where the executors can reach it "
            "(a notebook or job on the cluster, or the Connect server's host)")

    @contextmanager
    def tagged(self, tag: str, description: str) -> Iterator[None]:
        """The operations this thread starts inside carry ``tag`` (thread-local), which
        :meth:`cancel` interrupts on the server."""
        del description  # Connect tags have no description
        self.session.addTag(tag)
        try:
            yield
        finally:
            self.session.removeTag(tag)

    def cancel(self, tag: str) -> None:
        self.session.interruptTag(tag)

    def removed_executors(self) -> list[tuple[str, str]]:
        """Not known to a Connect client: the server's log has them."""
        return []

    def parallel_tasks(self, count: int, fn: Any) -> Any:
        raise NotImplementedError("a Spark Connect session has no RDDs: use DataFrames")

    def barrier_tasks(self, count: int, fn: Any) -> Any:
        raise NotImplementedError("a Spark Connect session has no RDDs: use DataFrames")

    def facts(self) -> dict[str, str]:
        """What the run's tags say of where it ran: the master and the Connect server."""
        return {"spark_master": self.master(), "spark_connect": self.server_host()}

    def run_barrier(self, count: int, frame: Any, by_rows: Any, by_arrow: Any,
                    schema: str) -> None:
        """Run a barrier stage of ``count`` tasks to its end, through DataFrames only: over
        ``frame``'s partitions, or ``range(count)`` in ``count`` partitions."""
        del by_rows
        frame = frame if frame is not None else self.session.range(0, count, 1, count)
        frame.mapInArrow(by_arrow, schema, barrier=True).collect()

    def each_task(self, count: int, by_rows: Any, by_arrow: Any, schema: str) -> list[Any]:
        """The rows of ``count`` plain tasks, through DataFrames only (``by_arrow``)."""
        del by_rows
        return list(self.session.range(0, count, 1, count).mapInArrow(by_arrow, schema)
                    .collect())

    def unreachable_hint(self, driver_host: str) -> str:
        """What to add when the tasks could not reach this client at ``driver_host``."""
        return (f" On Spark Connect that driver is this client process, at {driver_host} "
                f"(its address on the route to the Connect server {self.server_host()}): "
                "the executors must be able to open connections to it. Run the client where "
                "they can (a notebook or job on the cluster, or the Connect server's host)")


class _ConnectConf:
    """A configuration snapshot with :class:`pyspark.SparkConf`'s reading methods."""

    def __init__(self, values: dict[str, str]) -> None:
        self._values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self._values.get(key, default)

    def getAll(self) -> list[tuple[str, str]]:
        return list(self._values.items())


SessionApi = ClassicApi | ConnectApi


def session_api(session: Any) -> SessionApi:
    """The face of ``session``: :class:`ConnectApi` for a Spark Connect session, else
    :class:`ClassicApi`."""
    return ConnectApi(session) if is_connect(session) else ClassicApi(session)


@dataclass(frozen=True)
class StageOutcome:
    """What :func:`run_stage` saw: the action's value, its error, or neither (still running
    at the deadline: cancelled)."""

    finished: bool
    value: Any = None
    error: BaseException | None = None


def run_stage(api: SessionApi, name: str, description: str, action: Callable[[], Any],
              timeout: float, stop: threading.Event | None = None) -> StageOutcome:
    """Run ``action`` (which submits Spark work and returns its result) in a thread of its
    own, under a fresh tag ``mlflow-hvd-<name>-...`` (job groups and tags are thread-local);
    past ``timeout`` seconds the tagged work is cancelled and waited for 30 s more.

    Raises:
        JobStopped: ``stop`` was set meanwhile (``HorovodRunner.stop()``, SIGTERM): the
            tagged work is cancelled first.
    """
    tag = f"mlflow-hvd-{name}-{uuid.uuid4().hex[:12]}"

    def submit() -> Any:
        with api.tagged(tag, description):
            return action()

    call = Running(name, submit)
    deadline = Deadline.after(timeout)
    while not call.wait(deadline.slice(STOP_LOOK)):
        stopped = stop is not None and stop.is_set()
        if stopped or deadline.passed():
            api.cancel(tag)
            call.wait(30)  # cancelled work ends soon; a stage that does not is given up on
            if stopped:
                raise JobStopped(f"stopped while Spark ran {description!r} "
                                 "(HorovodRunner.stop)")
            return StageOutcome(False)
    error = call.error
    if error is not None and not isinstance(error, Exception):
        raise error  # KeyboardInterrupt, SystemExit: not the stage's outcome
    return StageOutcome(True, None if error else call.result(), error)

"""Finding the SparkSession to run on, and checking it can run a barrier stage of np tasks."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import Any

from mlflow_hvd.backends.spark import jvm, private, removals
from mlflow_hvd.backends.spark.api import SessionApi, active_session, run_stage, session_api
from mlflow_hvd.backends.spark.failures import executors_not_started, summarize_spark_error
from mlflow_hvd.backends.spark.master import AUTO, check_reachable, choose_master
from mlflow_hvd.common import phases
from mlflow_hvd.common.env_archive import fingerprint_of_archive, shipped_archive
from mlflow_hvd.common.horovod_env import refuse_owned
from mlflow_hvd.common.phases import Phase
from mlflow_hvd.errors import (
    BackendError,
    ConfigurationError,
    InsufficientSlotsError,
    SparkBarrierUnsupportedError,
)
from mlflow_hvd.protocol.environment import (
    ARCHIVE_ALIAS,
    SHIPPED_PYTHON,
    EnvironmentFingerprint,
)


def resolve_master(np: int, spark_master: str | None, timeout: float) -> tuple[Any, str]:
    """``(active session or None, master URL)`` for a job of ``np`` ranks: the active
    SparkSession, else the configured master (see :mod:`.master`), else an embedded
    ``local[max(np, cores)]``, without starting a JVM: a wrong or unreachable master fails
    here, in a second.

    Raises:
        ConfigurationError: ``spark_master`` differs from the active session's master.
        BackendError: The configured standalone master does not answer within ``timeout``.
    """
    active = active_session()
    choice = choose_master(spark_master, os.environ)
    if active is not None:
        running = session_api(active).master()
        if spark_master and spark_master != AUTO and spark_master != running:
            raise ConfigurationError(
                f"spark_master={spark_master!r} but this process already has a SparkSession "
                f"on {running!r}; stop it first (spark.stop()) or leave spark_master unset"
            )
        return active, running
    if choice is None:
        return None, f"local[{max(np, os.cpu_count() or 1)}]"
    check_reachable(choice, timeout)
    return None, choice.master


def new_session(master: str, archive: str | None = None) -> Any:
    """A new SparkSession on ``master``. Starts Spark's driver JVM with the start-up options
    of :mod:`.jvm` (a class-data archive and the C1-only JIT). With ``archive``, ships it
    to the executors (``spark.archives=<archive>#environment``) and has them run its
    ``./environment/bin/python``: ``PYSPARK_PYTHON`` is what the context reads when it
    starts (a plain Python driver ignores ``spark.pyspark.python``), set only meanwhile.
    Without an archive, a ``local[...]``/``local-cluster[...]`` master's executors run this
    driver's interpreter unless ``PYSPARK_PYTHON`` says otherwise.

    The context starts first and its executors are watched from then on
    (:mod:`.removals`): a master can give up on the application before the session is
    built (executors that cannot start), and Spark's error then names no reason.

    Raises:
        BackendError: Spark stopped the context before the session was built: why its
            executors could not start, when Spark recorded it.
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    conf = (SparkConf().setMaster(master).setAppName("mlflow_hvd")
            .set("spark.ui.showConsoleProgress", "false"))
    java_options = jvm.driver_java_options()
    if java_options:
        conf.set("spark.driver.defaultJavaOptions", java_options)
    python: str | None = SHIPPED_PYTHON
    if archive is not None:
        conf.set("spark.archives", f"{archive}#{ARCHIVE_ALIAS}")
    elif not master.startswith("local") or os.environ.get("PYSPARK_PYTHON"):
        python = None  # a cluster's nodes: their own python3, as Spark does
    else:  # executors on this machine: the driver's interpreter, not whatever python3 is
        python = sys.executable  # on PATH (a venv run without activating it)
    before = os.environ.get("PYSPARK_PYTHON")
    if python is not None:
        os.environ["PYSPARK_PYTHON"] = python
    try:
        sc = SparkContext.getOrCreate(conf)
    finally:
        if before is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = before
    watching = removals.watch(sc)
    try:
        return SparkSession.builder.getOrCreate()  # on the context above
    except Exception as exc:
        if not private.context_stopped(sc):
            raise
        shipped = None if archive is None else fingerprint_of_archive(archive)
        raise BackendError(
            f"the Spark application on {master} was stopped before its session was built: "
            f"{summarize_spark_error(exc, shipped, removed=watching.removed())}") from exc


def shipped_environment(conf: Any) -> EnvironmentFingerprint | None:
    """What the environment this session ships to its executors (``spark.archives``'
    ``#environment`` entry, packed by :mod:`mlflow_hvd.common.env_archive`) needs on each
    host; None when it ships none, or one this package did not pack (unchecked)."""
    archive = shipped_archive(conf.get("spark.archives", "") or "")
    if archive is None or not os.path.isfile(archive):
        return None
    return fingerprint_of_archive(archive)


def check_executor_env(conf: Any) -> None:
    """Refuse ``spark.executorEnv.HOROVOD_*`` settings of the variables the runner sets for
    each rank (Horovod's tuning variables there are welcome: they reach every rank)."""
    prefix = "spark.executorEnv."
    names = [key[len(prefix):] for key, _ in conf.getAll() if key.startswith(prefix)]
    refuse_owned(names, "Spark's configuration (spark.executorEnv.*)")


def check_barrier_supported(conf: Any) -> None:
    """Fail fast on configurations where Spark refuses or stalls barrier stages."""
    if str(conf.get("spark.dynamicAllocation.enabled", "false")).lower() == "true":
        raise SparkBarrierUnsupportedError(
            "Spark cannot run barrier-mode stages with dynamic allocation: set "
            "spark.dynamicAllocation.enabled=false (and a fixed spark.executor.instances) for "
            "the SparkSession that runs HorovodRunner, or use np<0 to run on the driver"
        )


def expected_slots(master: str, conf: Any) -> int | None:
    """Slots the cluster will offer once every executor is up, when the master tells it.

    ``local[N]`` and ``local-cluster[E,C,M]`` (and ``spark.executor.instances`` with
    ``spark.executor.cores``) determine it; otherwise None (the cluster may still grow).
    """
    task_cpus = int(conf.get("spark.task.cpus", "1") or 1)
    m = re.fullmatch(r"local\[(\d+)(?:,\s*\d+)?\]", master)
    if m:
        return int(m.group(1)) // task_cpus
    if master in ("local", "local[1]"):
        return 1
    m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    if m:
        return int(m.group(1)) * (int(m.group(2)) // task_cpus)
    instances, cores = conf.get("spark.executor.instances"), conf.get("spark.executor.cores")
    if instances and cores:
        return int(instances) * (int(cores) // task_cpus)
    return None


def wait_for_slots(api: SessionApi, np: int, timeout: float,
                   stop: threading.Event | None = None) -> int:
    """Wait up to ``timeout`` seconds (executors may still be registering) for ``np`` slots.

    Fails at once when the master's own size shows that ``np`` slots can never exist. A
    Spark Connect session cannot count registered slots: the master's declared size
    answers, else a probe (:func:`probe_slots`).

    Raises:
        InsufficientSlotsError: Fewer than ``np`` slots after the wait.
        JobStopped: ``stop`` was set meanwhile (``HorovodRunner.stop()``, SIGTERM).
    """
    deadline = time.monotonic() + timeout
    master, conf = api.master(), api.conf()
    ceiling = expected_slots(master, conf)
    while True:
        refuse_stopped(api, f"waited for {np} task slots")
        phases.refuse_stopped(stop, Phase.WAITING_FOR_SLOTS, f"waiting for {np} task slots")
        slots = api.task_slots()
        if slots is None:  # the scheduler's count is out of sight (Spark Connect)
            if ceiling is not None and ceiling >= np:
                return ceiling
            if ceiling is None:
                return probe_slots(api, np, timeout, stop)
            slots = 0
        if slots >= np:
            return slots
        if (ceiling is not None and ceiling < np) or time.monotonic() >= deadline:
            raise InsufficientSlotsError(_slots_message(api, np, slots, ceiling, timeout))
        time.sleep(0.25)


def elastic_slots(api: SessionApi, np: int, least: int, timeout: float,
                  stop: threading.Event | None = None) -> int:
    """How many ranks an elastic attempt (``JobConfig(min_np=least)``) runs on: ``np`` once
    ``np`` slots are there (waiting up to ``timeout`` seconds for them), else as many as
    there are if at least ``least``. Counted afresh (a host may have been lost since the
    last count): registered slots on a classic session; on a Spark Connect one, probes
    (:func:`probe_slots`): ``np`` for the whole wait (unless the master's declared size is
    smaller), then ``least`` (as long, at least :data:`SHORT_PROBE` seconds), ``least + 1``,
    ... for :data:`SHORT_PROBE` seconds each until one does not run.

    Raises:
        InsufficientSlotsError: Fewer than ``least`` slots after the wait, naming the
            count there was and the one needed.
        JobStopped: ``stop`` was set meanwhile (``HorovodRunner.stop()``, SIGTERM).
    """
    forget_probes(api)
    master, conf = api.master(), api.conf()
    ceiling = expected_slots(master, conf)
    if api.task_slots() is None:  # the scheduler's count is out of sight: probes tell
        most = np if ceiling is None else min(np, ceiling)  # what the master can ever give
        if most == np and _probe_runs(api, np, timeout, stop):
            return np
        found = 0
        for count in range(least, most + 1 if most < np else np):
            # the first may start the executors' Python workers: it gets the longer wait
            wait = max(timeout, SHORT_PROBE) if count == least else SHORT_PROBE
            if not _probe_runs(api, count, wait, stop):
                break
            found = count
        if found >= least:
            return found
        raise InsufficientSlotsError(_elastic_message(api, np, least, found, timeout, True))
    deadline = time.monotonic() + timeout
    enough = np if ceiling is None else min(np, ceiling)
    while True:
        refuse_stopped(api, f"waited for {least} to {np} task slots")
        phases.refuse_stopped(stop, Phase.WAITING_FOR_SLOTS,
                              f"waiting for {least} to {np} task slots")
        slots = api.task_slots() or 0
        if slots >= enough or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if slots >= least:
        return min(slots, np)
    raise InsufficientSlotsError(_elastic_message(api, np, least, slots, timeout, False))


def refuse_stopped(api: SessionApi, doing: str, cause: BaseException | None = None) -> None:
    """Fail at once, not at a deadline, when Spark stopped the session's context under the
    job (``doing``: what the job was doing), e.g. a standalone master that removed the
    application because its executors could not start (:func:`stopped_message`).

    Raises:
        BackendError: The context is stopped (from ``cause``, the error that showed it).
    """
    message = stopped_message(api, doing)
    if message is not None:
        raise BackendError(message) from cause


def stopped_message(api: SessionApi, doing: str) -> str | None:
    """What to tell a user whose classic session's context Spark stopped while the job was
    ``doing`` something: why its executors could not start, when Spark recorded it (Spark's
    own error says only "Master removed our application: FAILED", or that the context is
    stopped); None while the context runs."""
    if api.remote or not api.stopped():  # a Connect client cannot see the server's stop
        return None
    why = executors_not_started(api.removed_executors(), shipped_environment(api.conf()))
    return (f"the Spark application on {api.master()} was stopped while the job {doing}"
            + (f": {why}" if why else " (a standalone master removes an application whose "
               "executors keep failing to start: the master's and workers' logs say why)"))


def slots_back(api: SessionApi, np: int, running: int) -> bool:
    """Whether ``np`` slots are there now, ``running`` of them taken by the job that asks:
    registered slots on a classic session; on a Spark Connect one, whether a barrier stage
    of the ``np - running`` missing tasks runs within :data:`SHORT_PROBE` seconds."""
    slots = api.task_slots()
    if slots is not None:
        return slots >= np
    forget_probes(api)
    return _probe_runs(api, np - running, SHORT_PROBE, None)


SHORT_PROBE = 10.0  # seconds a Connect probe of fewer than np tasks gets (a probe that can
# run does in about a second; one that cannot waits for slots until its deadline)


def _probe_runs(api: SessionApi, count: int, timeout: float,
                stop: threading.Event | None) -> bool:
    try:
        probe_slots(api, count, timeout, stop)
    except InsufficientSlotsError:
        return False
    return True


def _elastic_message(api: SessionApi, np: int, least: int, found: int, timeout: float,
                     probed: bool) -> str:
    if not probed:
        how = f"it offers {found}"
    else:  # a Connect session: probes
        how = f"a barrier stage of {least} no-op tasks did not run"
    return (f"the job needs at least min_np={least} (at most np={np}) concurrent barrier task "
            f"slots, and after waiting {timeout:g}s for {np} the Spark cluster (master "
            f"{api.master()}) has fewer: {how}. Add executors, lower JobConfig(min_np=...), or "
            "raise JobConfig(slot_timeout=...) if executors are still coming back")


_probed: dict[tuple[str, int], int] = {}  # (application id, np) -> slots a probe confirmed


def forget_probes(api: SessionApi) -> None:
    """Forget what probes confirmed for ``api``'s application (a host may be gone)."""
    application = api.application_id()
    for key in [k for k in _probed if k[0] == application]:
        del _probed[key]


def probe_slots(api: SessionApi, np: int, timeout: float,
                stop: threading.Event | None = None) -> int:
    """``np`` when a barrier stage of ``np`` no-op tasks runs within ``timeout`` seconds (once
    per application and ``np``): how a Spark Connect client, which cannot ask the scheduler,
    learns that ``np`` tasks can run at once on a cluster whose master declares no size.

    Raises:
        InsufficientSlotsError: The probe did not run within ``timeout``.
    """
    key = (api.application_id(), np)
    if key in _probed:
        return _probed[key]
    outcome = run_stage(
        api, "slots", f"mlflow_hvd: can {np} tasks run at once?",
        lambda: api.session.range(0, np, 1, np).mapInArrow(_no_op, "id long",
                                                          barrier=True).collect(), timeout,
        stop)
    if outcome.error is not None or not outcome.finished:
        error = outcome.error
        why = (f"{type(error).__name__}: {str(error).splitlines()[0]}" if error is not None
               else f"not done within {timeout:g}s")
        raise InsufficientSlotsError(
            f"np={np} needs {np} concurrent barrier task slots, and a barrier stage of {np} "
            f"no-op tasks on the Spark cluster (master {api.master()}) did not run: {why}. "
            "(A Spark Connect client cannot count the cluster's slots; it probes when the "
            "master declares no size, e.g. spark.executor.instances and "
            "spark.executor.cores.) Lower np, add executors or cores, or raise "
            "HorovodRunner(job=JobConfig(slot_timeout=...)) if executors are still starting")
    _probed[key] = np
    return np


def _no_op(batches: Any) -> Any:
    yield from batches


def session_slots(session: Any, np: int, timeout: float) -> tuple[int, str]:
    """The task slots a session's cluster offers at once, and its master: the master's own
    size when it declares one, else the slots registered after waiting up to ``timeout``
    for ``np`` of them. The one place a session is asked for its slots (HorovodRunner's
    ``task_slots``, which the sweep's ``parallelism`` reads).

    Raises:
        InsufficientSlotsError: The master's size, or the slots after the wait, fall short
            of ``np``.
    """
    api = session_api(session)
    master = api.master()
    ceiling = expected_slots(master, api.conf())
    if ceiling is not None and ceiling >= np:
        return ceiling, master
    return wait_for_slots(api, np, timeout), master


def _task_resources(conf: Any) -> dict[str, str]:
    """``spark.task.resource.<name>.amount`` settings: name -> amount."""
    found = {}
    for key, value in conf.getAll():
        match = re.fullmatch(r"spark\.task\.resource\.([^.]+)\.amount", key)
        if match:
            found[match.group(1)] = value
    return found


def _slots_message(api: SessionApi, np: int, slots: int, ceiling: int | None,
                   timeout: float) -> str:
    conf = api.conf()
    text = (
        f"np={np} needs {np} concurrent barrier task slots but the Spark cluster (master "
        f"{api.master()}) offers {slots}"
        + (
            f" and can offer at most {ceiling}"
            if ceiling is not None and ceiling < np
            else f" after waiting {timeout:g}s"
        )
        + f" (spark.executor.cores={conf.get('spark.executor.cores', 'default')}, "
        f"spark.task.cpus={conf.get('spark.task.cpus', '1')}). Lower np, add executors or "
        "cores, or raise HorovodRunner(job=JobConfig(slot_timeout=...)) if executors are still "
        "starting"
    )
    resources = _task_resources(conf)
    if resources:
        # a task needing a resource (GPUs) runs only where one is free: often the limit
        text += ". Each task also needs " + ", ".join(
            f"{amount} {name} (spark.task.resource.{name}.amount; executors have "
            f"spark.executor.resource.{name}.amount="
            f"{conf.get(f'spark.executor.resource.{name}.amount', 'unset')})"
            for name, amount in resources.items()
        ) + ": too few are assigned for np tasks at once; lower np or add executors with them"
    if slots == 0 and not api.remote:  # a count of registered executors
        text += (
            ". No executor has registered at all: check that the cluster's workers are alive "
            "and can connect back to the driver at "
            f"spark.driver.host={conf.get('spark.driver.host', '?')}"
        )
    return text

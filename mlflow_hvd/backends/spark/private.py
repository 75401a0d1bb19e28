"""The names mlflow_hvd reads from pyspark that are not its public API, gathered here: each
with why no public API does it, and the pyspark versions it was checked on (the tested
range, 3.5.9 and 4.3.0: docs/install.md, Compatibility). A classic session only; Spark
Connect sessions have no JVM in this process and are asked through public API
(:mod:`.api`).
"""

from __future__ import annotations

from typing import Any


def context_stopped(sc: Any) -> bool:
    """Whether ``sc`` (a ``SparkContext``) was stopped, by this process or by Spark (a
    standalone master that removed the application stops the JVM's context itself, and
    every call on it then raises ``IllegalStateException``).

    Why private: pyspark has no public "is stopped" (``SparkSession.getActiveSession()``
    still returns a stopped session's object); ``stop()`` sets ``SparkContext._jsc`` to
    None, and the JVM's ``SparkContext.isStopped`` answers for a context stopped there.
    Checked on 3.5.9 and 4.3.0."""
    jsc = getattr(sc, "_jsc", None)
    if jsc is None:
        return True
    try:
        return bool(jsc.sc().isStopped())
    except Exception:  # py4j's error: the JVM is gone, and the context with it
        return True


def max_concurrent_tasks(sc: Any) -> int:
    """Tasks the cluster can run at once right now (executors x cores / task cpus), as
    Spark's scheduler counts them for barrier stages.

    Why private: pyspark exposes no slot count (``defaultParallelism`` is a setting, not
    the executors there); the JVM's ``SparkContext.maxNumConcurrentTasks(profile)`` is what
    Spark itself checks a barrier stage against, reached through ``SparkContext._jsc``.
    Checked on 3.5.9 and 4.3.0."""
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def gateway_process() -> Any:
    """The JVM process (a ``subprocess.Popen``) of this process's Spark gateway; None
    without one.

    Why private: pyspark offers no way to wait for its JVM to exit (``SparkSession.stop()``
    returns while the JVM still runs); the gateway's process is
    ``SparkContext._gateway.proc``, and the JVM exits when its stdin closes. Checked on
    3.5.9 and 4.3.0."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    return None if gateway is None else gateway.proc


def removed_executors(sc: Any) -> list[tuple[str, str, str]]:
    """The executors of ``sc``'s application that Spark removed, each as (executor id, host,
    the reason Spark recorded), oldest first: e.g. ``Unable to create executor due to tar:
    ...``, when a standalone worker could not unpack ``spark.archives`` for a new executor.
    Empty once the context has stopped (its status store is closed with it).

    Why private: pyspark exposes no executor list (``statusTracker()`` has jobs and stages
    only); the JVM's ``AppStatusStore.executorList(activeOnly=false)`` is what Spark's UI and
    REST API (``/executors``, ``removeReason``) read, reached through ``SparkContext._jsc``.
    Checked on 3.5.9 and 4.3.0."""
    executors = sc._jsc.sc().statusStore().executorList(False)
    removed = []
    for i in range(executors.size()):
        summary = executors.apply(i)
        reason = summary.removeReason()
        if reason.isDefined():
            host = str(summary.hostPort()).rsplit(":", 1)[0]
            removed.append((str(summary.id()), host, str(reason.get()).strip()))
    return removed


def removed_executor_count(sc: Any) -> int:
    """How many executors of ``sc``'s application Spark removed so far: two calls, however
    many executors there are (:func:`removed_executors` makes several per executor).
    Private for the reason :func:`removed_executors` is."""
    store = sc._jsc.sc().statusStore()
    return int(store.executorList(False).size()) - int(store.executorList(True).size())

"""Driver side: what a failed Spark job says, in one line a user can act on."""

from __future__ import annotations

import re
from collections.abc import Sequence

from mlflow_hvd.protocol.environment import SHIPPED_PYTHON, EnvironmentFingerprint


def summarize_spark_error(exc: BaseException,
                          shipped: EnvironmentFingerprint | None = None,
                          connect: bool = False,
                          removed: Sequence[tuple[str, str]] = ()) -> str:
    """The useful line of a Spark job failure (:func:`_summary`), followed by why executors
    could not start, from ``removed``: the (host, reason) of each executor Spark removed
    (:func:`executors_not_started`)."""
    summary = _summary(exc, shipped, connect)
    not_started = executors_not_started(removed, shipped)
    return f"{summary}. {not_started}" if not_started else summary


def _summary(exc: BaseException, shipped: EnvironmentFingerprint | None,
             connect: bool) -> str:
    """The useful line of a Spark job failure: the Python error raised in the task if any.

    A failing task surfaces on the driver as a Py4JJavaError whose first line only says
    ``An error occurred while calling ...collectAndServe``; the task's own Python error is a
    line like ``ValueError: ...`` inside the embedded traceback. An executor that cannot
    start its Python at all (``Cannot run program``) is said in words naming the
    interpreter and what to do; ``shipped`` is the environment the session ships, if any;
    ``connect``: the session is a Spark Connect one (what to do differs).
    """
    text = str(exc)
    missing = re.search(r'Cannot run program "([^"]+)"', text)
    if missing:
        return _interpreter_missing(missing.group(1), shipped)
    if shipped is None and "No module named 'mlflow_hvd'" in text:
        return _connect_python() if connect else _other_python()
    python_errors = _python_errors(text)
    if python_errors:
        return python_errors[-1]
    for line in text.splitlines():  # why Spark gave up, e.g. a lost executor or worker
        at = line.find("Job aborted due to stage failure:")
        if at >= 0:
            return line[at:].strip()[:1000]
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}"


_PYTHON_ERROR = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit))\b.*:")


def _python_errors(text: str) -> list[str]:
    """The lines of ``text`` that state a Python error (``ValueError: ...``), not Java's."""
    return [line.strip() for line in text.splitlines()
            if _PYTHON_ERROR.match(line)
            and not line.strip().startswith(("at ", "org.apache", "py4j", "java."))]


def task_raised(exc: BaseException, error: type[BaseException]) -> bool:
    """Whether the Python error a failed task raised (the last one its traceback states, as
    :func:`_summary` shows it) is of class ``error``: the class crosses from the executor as
    its name only, matched here against the class's own (qualified or not), never against
    the words of its message."""
    errors = _python_errors(str(exc))
    if not errors:
        return False
    match = _PYTHON_ERROR.match(errors[-1])
    assert match is not None  # every line _python_errors keeps matches
    name = match.group(1)
    return name in (error.__name__, f"{error.__module__}.{error.__qualname__}")


# what a full disk leaves in an executor's removal reason: the OS's words, or tar's short
# write when a standalone worker unpacks spark.archives for a new executor
_DISK_FULL = re.compile(r"No space left on device|Wrote only \d+ of \d+ bytes")


def executors_not_started(removed: Sequence[tuple[str, str]],
                          shipped: EnvironmentFingerprint | None) -> str:
    """Why Spark could not start executors, from the reasons it recorded when it removed
    them (``removed``: (host, reason), oldest first), or "" when none failed to start.

    A standalone worker unpacks ``spark.archives`` into a new executor's directory before
    the executor starts; when that fails the executor is never created, the master retries
    (``spark.deploy.maxExecutorRetries``) and then removes the application, and the job
    ends with only "Master removed our application: FAILED". A full disk is named with the
    space the shipped environment takes unpacked (``shipped``: recorded when it was packed).
    """
    failed = [(host, reason) for host, reason in removed
              if reason.startswith("Unable to create executor")]
    if not failed:
        return ""
    hosts = sorted({host for host, _ in failed})
    host, reason = failed[-1]
    said = " ".join(line.strip() for line in reason.splitlines() if line.strip())[:500]
    text = (f"Spark could not start executors on {', '.join(hosts)} ({len(failed)} "
            f"tried): {said}")
    if _DISK_FULL.search(reason):
        needed = (f" needs {shipped.unpacked_bytes / 1e9:.2f} GB there"
                  if shipped is not None and shipped.unpacked_bytes else
                  " did not fit there")
        text += (
            f". The disk of {host} where Spark unpacks the environment shipped to the "
            f"executors is full: the environment{needed}. Free that much in the worker's "
            "directory for executors (--work-dir or SPARK_WORKER_DIR on a standalone "
            "worker; the node's local disk on YARN or Kubernetes), or ship a smaller "
            "environment (docs/cluster.md)")
    return text


def _interpreter_missing(program: str, shipped: EnvironmentFingerprint | None) -> str:
    """Spark names no host when a barrier task fails (the failed stage's reason only)."""
    if program == SHIPPED_PYTHON:
        base = shipped.base_python if shipped is not None else "the venv's base Python"
        return (
            f"an executor cannot start the shipped environment's interpreter {program}: it is a "
            f"link to {base}, which venv-pack does not copy into the archive. Install that "
            "Python at that path on every node (the same version: pyenv, a system package), "
            "or ship an environment that includes its interpreter (conda-pack)")
    return (
        f"an executor cannot start the Python interpreter {program} (PYSPARK_PYTHON when the "
        "session started): it does not exist on that node. Ship the driver's environment "
        "to the executors (HorovodRunner(cluster=ClusterConfig(ship_environment=True)), mlflow "
        "run ... -P "
        "ship_environment=true, or spark.archives from python -m mlflow_hvd.cli.pack_env), "
        "or install the same environment at that path on every node")


def _connect_python() -> str:
    return (
        "the executors' Python cannot import mlflow_hvd: the Spark Connect server runs its "
        "Python workers with its own interpreter (the server's PYSPARK_PYTHON, or this "
        "session's spark.sql.execution.pyspark.python), which lacks this package. Ship this "
        "client's environment to the session (HorovodRunner(cluster=ClusterConfig("
        "ship_environment=True)): uploaded as a session artifact and run by the executors), "
        "or install mlflow_hvd, Horovod and your framework on the server's nodes")


def _other_python() -> str:
    """The session's Python workers run an interpreter without this package: on a
    ``local[...]`` master most often Spark's default ``python3`` from PATH (a venv not
    activated), on a cluster the nodes' own Python."""
    import sys

    return (
        "the executors' Python cannot import mlflow_hvd: the SparkSession runs its Python "
        "workers with another interpreter than this driver's (PYSPARK_PYTHON when the "
        "session started, else 'python3' from PATH; a plain Python driver ignores "
        "spark.pyspark.python). Start the session with PYSPARK_PYTHON="
        f"{sys.executable} in the environment (os.environ['PYSPARK_PYTHON'] before "
        "SparkSession.builder...getOrCreate(), or activate that environment first); on a "
        "cluster, ship the driver's environment "
        "(HorovodRunner(cluster=ClusterConfig(ship_environment=True)) on a "
        "session it builds, or spark.archives from python -m mlflow_hvd.cli.pack_env) or "
        "install mlflow_hvd on every node")

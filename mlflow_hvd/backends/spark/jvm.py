"""Driver side: how the driver JVM of a SparkSession that mlflow_hvd creates itself starts
fast.

A new ``local[N]`` session spends most of its start, and much CPU, loading and verifying
Spark's classes and compiling them with C2 while the ranks, started right after, import
TensorFlow on the same cores. Two standard HotSpot options shorten it (figures: docs/benchmarks.md,
Benchmarks):

* a class-data-sharing archive (AppCDS, JDK 13+) of the classes Spark loads while starting
  a session and running a barrier job, built once per Java + Spark installation by
  :func:`build_archive` (``python -m mlflow_hvd.cli.jvm_archive``; ``make setup`` runs it)
  and kept in mlflow_hvd's cache directory;
* ``-XX:TieredStopAtLevel=1``: the JIT stops at C1. The driver JVM of a HorovodRunner job
  schedules tasks and pipes bytes; the training runs in Python. A user who also runs heavy
  Spark SQL in the same embedded session can switch it off (below).

They are passed as ``spark.driver.defaultJavaOptions``, which Spark puts before
``spark.driver.extraJavaOptions``: a user's own driver options still apply and win.
``MLFLOW_HVD_SPARK_JAVA_OPTIONS`` replaces them (set it empty for Spark's defaults). A
missing or stale archive costs nothing but the speed: the JVM checks the archive's Java
build and class path and starts without it when they differ, and the file name carries a
hash of both and of what its build runs, so an upgraded Java or Spark looks for a new
archive.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from mlflow_hvd.backends.spark import private
from mlflow_hvd.common.cache import cache_root, keep_newest
from mlflow_hvd.errors import BackendError, ConfigurationError

log = logging.getLogger(__name__)

OPTIONS_ENV = "MLFLOW_HVD_SPARK_JAVA_OPTIONS"
# What the archive's build runs (:func:`_dump`), part of its name: a new workload, a new
# archive (``make setup`` builds it)
WORKLOAD = "session, RDD barrier stage, barrier mapInArrow"
C1_ONLY = "-XX:TieredStopAtLevel=1"


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """mlflow_hvd's cache (:func:`mlflow_hvd.common.cache.cache_root`)."""
    return cache_root(env)


def java_binary(env: Mapping[str, str] = os.environ) -> str | None:
    """The ``java`` Spark's launcher runs: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    if env.get("JAVA_HOME"):
        candidate = os.path.join(env["JAVA_HOME"], "bin", "java")
        return candidate if os.access(candidate, os.X_OK) else None
    return shutil.which("java", path=env.get("PATH"))


def spark_jars(env: Mapping[str, str] = os.environ) -> Path:
    """The ``jars`` directory of the Spark that pyspark launches (``$SPARK_HOME`` or the
    pyspark package)."""
    if env.get("SPARK_HOME"):
        return Path(env["SPARK_HOME"]) / "jars"
    import pyspark

    return Path(pyspark.__file__).parent / "jars"


def archive_path(env: Mapping[str, str] = os.environ) -> Path | None:
    """Where the archive for this Java build and these Spark jars lives (whether or not it
    exists yet); ``None`` when there is no ``java`` or no Spark jars directory."""
    java = java_binary(env)
    jars = spark_jars(env)
    if java is None or not jars.is_dir():
        return None
    real_java = os.path.realpath(java)
    # the JVM uses an archive only on the class path it was built with (the jars' paths,
    # sizes and times): another pyspark install is another archive
    digest = hashlib.sha256(f"{WORKLOAD}\n{real_java}\n{os.path.realpath(jars)}".encode())
    release = Path(real_java).parents[1] / "release"  # the JDK's build identity
    digest.update(release.read_bytes() if release.is_file() else str(os.stat(real_java)).encode())
    # the class path is the directory's jars (``jars/*``): subdirectories are not on it
    for entry in sorted(os.scandir(jars), key=lambda e: e.name):
        if not (entry.is_file() and entry.name.endswith(".jar")):
            continue
        info = entry.stat()
        digest.update(f"{entry.name}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return cache_dir(env) / f"spark-driver-{digest.hexdigest()[:16]}.jsa"


def driver_java_options(env: Mapping[str, str] = os.environ) -> str:
    """The ``spark.driver.defaultJavaOptions`` of a session mlflow_hvd creates."""
    if OPTIONS_ENV in env:
        return env[OPTIONS_ENV]
    options = [C1_ONLY]
    archive = archive_path(env)
    if archive is not None and archive.is_file():
        options.append(f"-XX:SharedArchiveFile={archive}")
        _touch(archive)  # in use: the archives pruned are the ones no session used lately
    elif archive is not None:
        log.info(
            "Spark's driver JVM starts faster with a class-data archive; "
            "build it once with: python -m mlflow_hvd.cli.jvm_archive"
        )
    return " ".join(options)


KEEP_ARCHIVES = 3  # the most recently used archives kept (one per Spark installation)


def prune_archives(directory: Path, keep: int = KEEP_ARCHIVES) -> list[Path]:
    """Delete all but the ``keep`` most recently used archives in ``directory`` (each
    install of pyspark, e.g. every fresh venv, gets its own, 120-160 MiB); returns what was
    deleted. A venv whose archive is gone starts its JVM without one until it builds it
    again."""
    return keep_newest(directory, "spark-driver-*.jsa", keep)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError as exc:  # a read-only cache: pruning may then take it as unused
        log.debug("could not mark %s used: %s", path, exc)


def build_archive(timeout: float = 300.0, env: Mapping[str, str] = os.environ) -> Path:
    """Builds the archive :func:`driver_java_options` uses (unless it exists) and returns
    its path.

    A new Python process starts a ``local[2]`` session with
    ``-XX:ArchiveClassesAtExit``, runs one barrier job, stops the session and waits for the
    JVM to write the archive as it exits; the file is renamed into place only when complete,
    so concurrent builds and readers never see half an archive.

    Raises:
        ConfigurationError: No ``java`` or no Spark jars to build for.
        BackendError: The JVM failed or did not finish within ``timeout`` seconds.
    """
    target = archive_path(env)
    if target is None:
        raise ConfigurationError(
            "cannot build Spark's class-data archive: no 'java' on PATH (or in $JAVA_HOME) or "
            "no Spark jars directory; install Java 17 and pyspark first"
        )
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    child_env = {**env, "PYSPARK_PYTHON": env.get("PYSPARK_PYTHON", sys.executable)}
    child_env.pop(OPTIONS_ENV, None)
    cmd = [sys.executable, "-m", __name__, str(partial), str(timeout)]
    try:
        proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if proc.returncode != 0 or not partial.is_file():
            raise BackendError(
                f"building Spark's class-data archive failed (exit {proc.returncode}); the "
                f"end of its output:\n{(proc.stdout + proc.stderr)[-3000:]}"
            )
        os.replace(partial, target)
        prune_archives(target.parent, keep=KEEP_ARCHIVES)
    except subprocess.TimeoutExpired:
        raise BackendError(
            f"building Spark's class-data archive did not finish within {timeout:g} s"
        ) from None
    finally:
        partial.unlink(missing_ok=True)
    return target


def _dump(partial: str, timeout: float) -> None:
    """The child of :func:`build_archive`: load what a HorovodRunner job loads, then exit so
    the JVM writes the archive."""
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("mlflow_hvd-jvm-archive")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.defaultJavaOptions", f"-XX:ArchiveClassesAtExit={partial}")
        .getOrCreate()
    )
    # the launcher's own stages (backends/spark/backend): an RDD barrier stage (a job without
    # data) and a barrier mapInArrow (a job with DataFrames)
    spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(
        lambda rows: rows).collect()
    spark.range(0, 2, 1, 2).mapInArrow(lambda batches: batches, "id long", barrier=True).collect()
    spark.stop()
    jvm = private.gateway_process()
    if jvm is None:
        raise SystemExit("the Spark session left no JVM to wait for")
    jvm.stdin.close()  # Spark's gateway exits when its stdin closes: the archive is written
    code = jvm.wait(timeout=timeout)
    if code != 0:  # the archive may be incomplete: build_archive keeps nothing
        raise SystemExit(f"the JVM exited with status {code} while writing the archive")


if __name__ == "__main__":
    _dump(sys.argv[1], float(sys.argv[2]))

"""Start-up options of the driver JVM of a SparkSession that mlflow_hvd creates."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlflow_hvd.backends.spark import jvm
from mlflow_hvd.errors import BackendError, ConfigurationError


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != jvm.OPTIONS_ENV}
    return {**env, "MLFLOW_HVD_CACHE": str(tmp_path / "cache"), **extra}


def test_without_an_archive_the_jvm_gets_c1_only_and_a_hint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=jvm.__name__):
        options = jvm.driver_java_options(_env(tmp_path))
    assert options == jvm.C1_ONLY
    assert "python -m mlflow_hvd.cli.jvm_archive" in caplog.text


def test_an_archive_in_the_cache_is_used(tmp_path: Path) -> None:
    env = _env(tmp_path)
    archive = jvm.archive_path(env)
    assert archive is not None and archive.parent == tmp_path / "cache"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"")
    assert jvm.driver_java_options(env) == f"{jvm.C1_ONLY} -XX:SharedArchiveFile={archive}"


def test_the_environment_variable_replaces_the_options(tmp_path: Path) -> None:
    assert jvm.driver_java_options(_env(tmp_path, **{jvm.OPTIONS_ENV: ""})) == ""
    assert jvm.driver_java_options(_env(tmp_path, **{jvm.OPTIONS_ENV: "-Xss4m"})) == "-Xss4m"


def test_the_archive_name_follows_the_spark_jars_and_the_java(tmp_path: Path) -> None:
    jars = tmp_path / "spark" / "jars"
    jars.mkdir(parents=True)
    (jars / "spark-core.jar").write_bytes(b"1")
    env = _env(tmp_path, SPARK_HOME=str(tmp_path / "spark"))
    first = jvm.archive_path(env)
    assert first == jvm.archive_path(env)  # stable
    (jars / "spark-core.jar").write_bytes(b"22")  # an upgraded jar: a new archive
    assert jvm.archive_path(env) not in (None, first)
    # the same jars elsewhere (another venv's pyspark): another class path, another archive
    other = tmp_path / "other" / "jars"
    shutil.copytree(jars, other)  # copy2: the same names, sizes and times
    moved = jvm.archive_path(_env(tmp_path, SPARK_HOME=str(tmp_path / "other")))
    assert moved not in (None, jvm.archive_path(env))
    assert jvm.archive_path({**env, "JAVA_HOME": str(tmp_path / "no-jdk")}) is None


def test_building_without_java_names_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no 'java'"):
        jvm.build_archive(env=_env(tmp_path, JAVA_HOME=str(tmp_path / "no-jdk")))


@pytest.mark.slow
def test_a_new_session_loads_sparks_classes_from_the_archive(tmp_path: Path) -> None:
    """Builds the archive where ``make setup`` does (nothing to do when setup built it),
    then starts a session the way HorovodRunner does, with HotSpot's class-load log on:
    Spark's classes must come from the archive ("shared objects file (top)")."""
    archive = jvm.build_archive(timeout=300)
    assert archive == jvm.archive_path() and archive.stat().st_size > 10 * 2**20
    loads = tmp_path / "class-load.txt"
    env = {
        **{k: v for k, v in os.environ.items() if k != jvm.OPTIONS_ENV},
        "PYSPARK_SUBMIT_ARGS": "--conf spark.driver.extraJavaOptions="
        f"-Xlog:class+load=info:file={loads} pyspark-shell",
    }
    code = (
        "from mlflow_hvd.backends.spark.session import new_session\n"
        "s = new_session('local[1]')\n"
        "print(s.sparkContext.getConf().get('spark.driver.defaultJavaOptions'))\n"
        "s.stop()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"-XX:SharedArchiveFile={archive}" in proc.stdout
    spark_lines = [ln for ln in loads.read_text().splitlines()
                   if " org.apache.spark.SparkContext " in ln]
    assert spark_lines and "shared objects file (top)" in spark_lines[0], spark_lines


def test_a_build_whose_child_fails_names_its_exit_and_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    child = tmp_path / "python"  # stands in for the interpreter that would start the JVM
    child.write_text("#!/bin/sh\necho 'the JVM said no' >&2\nexit 3\n")
    child.chmod(0o755)
    monkeypatch.setattr(jvm.sys, "executable", str(child))
    with pytest.raises(BackendError) as info:
        jvm.build_archive(timeout=60, env=_env(tmp_path))
    assert str(info.value) == (
        "building Spark's class-data archive failed (exit 3); the end of its output:\n"
        "the JVM said no\n")
    assert list((tmp_path / "cache").rglob("*.jsa*")) == []  # nothing half-written is kept


def test_a_build_past_its_deadline_is_stopped_and_named(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match=(
        r"^building Spark's class-data archive did not finish within 0.5 s$"
    )):
        jvm.build_archive(timeout=0.5, env=_env(tmp_path))


@pytest.mark.slow
@pytest.mark.beside  # a JVM of its own running the archive's whole workload: nothing shared
def test_a_jvm_that_cannot_write_the_archive_is_a_failed_build(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", jvm.__name__, str(tmp_path / "no-such-dir" / "x.jsa"), "120"],
        capture_output=True, text=True, timeout=300, env=_env(tmp_path),
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.rstrip().endswith(
        "the JVM exited with status 1 while writing the archive")


def test_only_the_most_recently_used_archives_are_kept(tmp_path: Path) -> None:
    """Every fresh pyspark install (each CI clone's venv) gets its own archive: building one
    keeps the three used most recently, and a session using one marks it used."""
    names = [f"spark-driver-{i:016x}.jsa" for i in range(5)]
    for age, name in enumerate(names):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1_000_000 - age * 100, 1_000_000 - age * 100))
    (tmp_path / "other.txt").write_text("kept")
    gone = jvm.prune_archives(tmp_path, keep=3)
    assert sorted(p.name for p in gone) == names[3:]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names[:3], "other.txt"])
    jvm._touch(tmp_path / names[2])  # used now: the newest
    jvm.prune_archives(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[2], "other.txt"])

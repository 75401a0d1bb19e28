"""Choosing the Spark master the way spark-submit does, and failing fast when it is away."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from mlflow_hvd import ClusterConfig, HorovodRunner, TrackingConfig
from mlflow_hvd.backends.spark.master import (
    MasterChoice,
    check_reachable,
    choose_master,
    standalone_addresses,
)
from mlflow_hvd.errors import BackendError, ConfigurationError


def _conf_dir(tmp_path: Path, text: str) -> str:
    (tmp_path / "spark-defaults.conf").write_text(text)
    return str(tmp_path)


def test_nothing_configured_means_embedded_local(tmp_path: Path) -> None:
    assert choose_master(None, {}) is None
    assert choose_master("auto", {"SPARK_CONF_DIR": str(tmp_path)}) is None


def test_precedence_is_option_then_submit_args_then_defaults_then_master(tmp_path: Path) -> None:
    conf = _conf_dir(tmp_path, "# comment\nspark.driver.memory 1g\nspark.master  spark://d:7077\n")
    env = {
        "PYSPARK_SUBMIT_ARGS": "--conf x=y --master spark://s:7077 pyspark-shell",
        "SPARK_CONF_DIR": conf,
        "MASTER": "spark://m:7077",
    }
    assert choose_master("spark://o:7077", env) == MasterChoice(
        "spark://o:7077", "the spark_master option"
    )
    assert choose_master("auto", env) == MasterChoice(
        "spark://s:7077", "--master in PYSPARK_SUBMIT_ARGS"
    )
    del env["PYSPARK_SUBMIT_ARGS"]
    assert choose_master(None, env) == MasterChoice(
        "spark://d:7077", f"spark.master in {conf}/spark-defaults.conf"
    )
    del env["SPARK_CONF_DIR"]
    assert choose_master(None, env) == MasterChoice(
        "spark://m:7077", "the MASTER environment variable"
    )


def test_submit_args_with_equals_and_defaults_with_equals(tmp_path: Path) -> None:
    assert choose_master(None, {"PYSPARK_SUBMIT_ARGS": "--master=local[3] pyspark-shell"}) == (
        MasterChoice("local[3]", "--master in PYSPARK_SUBMIT_ARGS")
    )
    home = tmp_path / "home"
    (home / "conf").mkdir(parents=True)
    (home / "conf" / "spark-defaults.conf").write_text("spark.master=spark://h:1\n")
    assert choose_master(None, {"SPARK_HOME": str(home)}) == MasterChoice(
        "spark://h:1", f"spark.master in {home}/conf/spark-defaults.conf"
    )


def test_standalone_addresses() -> None:
    assert standalone_addresses("spark://a:7077,b:7078") == [("a", 7077), ("b", 7078)]
    assert standalone_addresses("local[2]") == []
    with pytest.raises(ConfigurationError) as info:
        standalone_addresses("spark://nohostport")
    assert str(info.value) == (
        "Spark master 'spark://nohostport': 'nohostport' is not host:port (e.g. "
        "spark://host:7077)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)  # the probe's own deadline is in the message below
def test_unreachable_master_fails_within_the_deadline_naming_it() -> None:
    port = _free_port()
    choice = MasterChoice(f"spark://127.0.0.1:{port}", "the MASTER environment variable")
    with pytest.raises(BackendError) as info:
        check_reachable(choice, timeout=1.0)
    message = str(info.value)
    assert message.startswith(
        f"cannot reach the Spark master spark://127.0.0.1:{port} (from the MASTER environment "
        f"variable) within 1s: 127.0.0.1:{port}: "
    )
    assert message.endswith(
        "Start the master, fix the URL, or raise HorovodRunner(job=JobConfig(slot_timeout=...)) "
        "if it is "
        "still starting"
    )


def test_a_listening_master_passes_the_check() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(5)
        port = listener.getsockname()[1]
        check_reachable(MasterChoice(f"spark://127.0.0.1:{port}", "test"), timeout=2.0)
        probe, _ = listener.accept()  # the check did connect (else: TimeoutError)
        probe.close()
    # a local master has no address: nothing is probed and nothing can fail
    assert standalone_addresses("local[2]") == []
    check_reachable(MasterChoice("local[2]", "test"), timeout=0.1)


def test_bad_spark_master_options_are_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError) as info:
        HorovodRunner(np=2, cluster=ClusterConfig(spark_master=7077))  # type: ignore[arg-type]
    assert str(info.value) == (
        "spark_master must be a master URL such as 'spark://host:7077' (or None), got int"
    )
    with pytest.raises(ConfigurationError, match="is not host:port"):
        HorovodRunner(np=2, cluster=ClusterConfig(spark_master="spark://host-without-port"))


@pytest.mark.spark
def test_an_explicit_master_that_differs_from_the_active_session_is_refused(spark: Any) -> None:
    from mlflow_hvd.backends.spark.session import resolve_master

    running = "local-cluster[2,1,1024]"
    assert resolve_master(2, None, 30.0) == (spark, running)
    assert resolve_master(2, "auto", 30.0) == (spark, running)
    assert resolve_master(2, running, 30.0) == (spark, running)
    runner = HorovodRunner(np=2, cluster=ClusterConfig(spark_master="spark://elsewhere:7077"),
                           tracking=TrackingConfig(track=False))
    with pytest.raises(ConfigurationError) as info:
        runner.run(dict)
    assert str(info.value) == (
        "spark_master='spark://elsewhere:7077' but this process already has a SparkSession on "
        "'local-cluster[2,1,1024]'; stop it first (spark.stop()) or leave spark_master unset"
    )

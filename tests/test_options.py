"""The checks of the options users pass (common/options.py): one message per option."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlflow_hvd.common.options import check_np, check_positive_int, check_seconds
from mlflow_hvd.errors import ConfigurationError


def test_option_validators_name_the_option() -> None:
    assert check_np(-2) == -2
    with pytest.raises(ConfigurationError) as info:
        check_np(True)
    assert str(info.value) == (
        "np must be a non-zero integer, got True (bool): use np=-N for N processes on the "
        "driver, np=N for N Spark barrier tasks"
    )
    assert check_seconds("t", 2) == 2.0
    with pytest.raises(ConfigurationError) as info:
        check_seconds("start_timeout", -1)
    assert str(info.value) == "start_timeout must be a positive number of seconds, got -1"
    assert check_positive_int("n", 3) == 3
    with pytest.raises(ConfigurationError) as info:
        check_positive_int("max_evals", 1.5)
    assert str(info.value) == "max_evals must be an integer >= 1, got 1.5"


def test_data_compression_is_none_lz4_or_zstd() -> None:
    from mlflow_hvd import ClusterConfig, HorovodRunner

    runner = HorovodRunner(np=-1, cluster=ClusterConfig(data_compression="lz4"))
    assert runner.cluster.data_compression == "lz4"
    with pytest.raises(ConfigurationError) as info:
        HorovodRunner(np=-1, cluster=ClusterConfig(data_compression="gzip"))
    assert str(info.value) == (
        "data_compression must be None (uncompressed: ranks memory-map their shards without "
        "copying), 'lz4' or 'zstd', got 'gzip'")


def test_ship_environment_is_a_bool_or_an_existing_archive(tmp_path: Path) -> None:
    from mlflow_hvd import ClusterConfig, HorovodRunner

    archive = tmp_path / "env.tar.gz"
    archive.write_bytes(b"")
    assert HorovodRunner(np=-1).cluster.ship_environment is False
    assert ClusterConfig(ship_environment=True).ship_environment is True
    assert ClusterConfig(ship_environment=archive).ship_environment == str(archive)
    for bad in ("missing.tar.gz", str(tmp_path), 1):
        with pytest.raises(ConfigurationError) as info:
            HorovodRunner(np=-1, cluster=ClusterConfig(ship_environment=bad))
        assert str(info.value) == (
            "ship_environment must be True (pack this venv for the executors: python -m "
            "mlflow_hvd.cli.pack_env), False, or the path of an existing archive ending in "
            f".tar.gz, .tgz, .tar, .zip, got {bad!r}")

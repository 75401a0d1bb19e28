"""The classic/Connect face over sessions (backends/spark/api.py), on stand-ins for what a
Connect client answers: the choices that need no server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from mlflow_hvd.backends.spark.api import ConnectApi, is_local_address, route_source
from mlflow_hvd.errors import BackendError


def connect_session(server_host: str, conf: dict[str, str]) -> Any:
    """What ConnectApi reads of a Connect session: the host its client dials and the
    session's configuration."""
    return SimpleNamespace(client=SimpleNamespace(host=server_host),
                           conf=SimpleNamespace(getAll=conf))


def test_a_server_dialled_on_loopback_on_this_machine_gives_its_own_driver_host() -> None:
    api = ConnectApi(connect_session("localhost", {"spark.driver.host": "127.0.0.1",
                                                   "spark.master": "local-cluster[2,1,1024]"}))
    assert api.driver_host() == "127.0.0.1"
    assert api.master() == "local-cluster[2,1,1024]"
    unsaid = ConnectApi(connect_session("127.0.0.1", {}))
    assert unsaid.driver_host() == "127.0.0.1" and unsaid.master() == "unknown"


def test_a_server_at_the_end_of_a_tunnel_is_refused_naming_both_hosts() -> None:
    # 198.18.0.0/15 (RFC 2544, benchmarking) is no address of this machine
    api = ConnectApi(connect_session("localhost", {"spark.driver.host": "198.18.0.1",
                                                   "spark.master": "spark://m:7077"}))
    with pytest.raises(BackendError, match=r"^the Spark Connect server is dialled on loopback "
                       r"\(localhost\) but is not on this machine \(its driver host is "
                       r"198\.18\.0\.1\): a tunnel\. Its executors \(master spark://m:7077\)"):
        api.driver_host()


def test_addresses_of_this_machine_and_routes() -> None:
    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("198.18.0.1")
    assert not is_local_address("no-such-host.invalid")
    assert route_source("127.0.0.1") == route_source("localhost") == "127.0.0.1"
    assert is_local_address(route_source("198.18.0.1"))  # the route's own source address


def test_a_configuration_snapshot_reads_like_spark_conf() -> None:
    api = ConnectApi(connect_session("h", {"spark.app.id": "app-1", "spark.task.cpus": "2"}))
    conf = api.conf()
    assert conf.get("spark.task.cpus") == "2" and conf.get("unset", "d") == "d"
    assert sorted(conf.getAll()) == [("spark.app.id", "app-1"), ("spark.task.cpus", "2")]
    assert api.application_id() == "app-1" and api.task_slots() is None

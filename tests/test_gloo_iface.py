"""The network interface a Spark task gives Gloo (agent/spark_task.py)."""

from __future__ import annotations

import socket

import pytest

from mlflow_hvd.errors import ConfigurationError


def test_no_interface_holding_the_route_source_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import psutil

    from mlflow_hvd.agent.spark_task import iface_towards

    assert iface_towards("127.0.0.1") == "lo"
    own = [
        (name, a.address)
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    assert own, "this machine has no non-loopback IPv4 address"
    name, address = own[0]
    assert iface_towards(address) == name  # a route to ourselves: its own interface
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {})  # the address vanished
    with pytest.raises(ConfigurationError) as info:
        iface_towards(address)
    assert str(info.value) == (
        f"no network interface holds {address}, the address that routes to the driver at "
        f"{address}; pass HorovodRunner(cluster=ClusterConfig(gloo_iface=...)) with the "
        f"interface Gloo should use"
    )

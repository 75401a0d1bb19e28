"""The driver's rendezvous server: horovod's protocol, with requests for keys that are not
there yet held until they arrive, and an account of the load."""

from __future__ import annotations

import http.client
import threading

import pytest
from services import wait_until

from mlflow_hvd.driver import gloo_server
from mlflow_hvd.driver import rendezvous as rdv
from mlflow_hvd.driver.rendezvous import Rendezvous


def _call(port: int, method: str, path: str, body: bytes | None = None,
          host: str = "127.0.0.1") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_a_request_for_a_missing_key_is_answered_when_the_key_arrives() -> None:
    server = Rendezvous(2)
    try:
        got: list[tuple[int, bytes]] = []
        asker = threading.Thread(target=lambda: got.append(
            _call(server.port, "GET", "/global/1")))
        asker.start()
        wait_until(lambda: server.stats().requests == 1, 10, "the GET to reach the server")
        assert _call(server.port, "PUT", "/global/1", b"addresses")[0] == 200
        asker.join(timeout=10)
        # the GET arrived before the key and was answered with it: held, not "not yet"
        assert got == [(200, b"addresses")]
        stats = server.stats()
        assert (stats.requests, stats.not_found, stats.bytes_sent) == (2, 0, 9)
    finally:
        server.stop()


def test_a_key_that_never_comes_is_not_found_after_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gloo_server, "HOLD_SECONDS", 0.3)
    server = Rendezvous(2)
    try:
        assert _call(server.port, "GET", "/global/7")[0] == 404
        assert _call(server.port, "DELETE", "/global/0")[0] == 200
        stats = server.stats()
        assert (stats.requests, stats.not_found, stats.bytes_sent) == (2, 1, 0)
    finally:
        server.stop()


def test_stop_ends_the_serving_thread_and_closes_the_port() -> None:
    server = Rendezvous(2)
    port = server.port
    server.stop()
    assert not [t for t in threading.enumerate() if t.name == "mlflow-hvd-rendezvous"]
    with pytest.raises(ConnectionRefusedError):
        _call(port, "GET", "/global/0")


def test_a_channel_that_cannot_listen_leaves_no_rendezvous_server_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow_hvd.driver import generation

    def cannot_listen(*args: object, **kwargs: object) -> None:
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(generation, "ChannelServer", cannot_listen)
    with pytest.raises(OSError, match="Address already in use"):
        generation.Generation(2, object(), "127.0.0.1", warm=False)  # type: ignore[arg-type]
    assert not [t for t in threading.enumerate() if t.name == "mlflow-hvd-rendezvous"]


def _outside_address() -> str:
    """An address of this machine that is not loopback (where a neighbour would connect)."""
    from mlflow_hvd.driver.admission import local_addresses

    found = sorted(a for a in local_addresses() if ":" not in a and not a.startswith("127."))
    assert found, "this machine has no non-loopback IPv4 address to test with"
    return found[0]


def test_a_local_jobs_server_listens_on_loopback_only() -> None:
    """The store has no authentication: a local job's is not reachable from the network."""
    server = Rendezvous(2, "127.0.0.1")
    try:
        assert _call(server.port, "PUT", "/global/1", b"x")[0] == 200
        with pytest.raises(ConnectionRefusedError):
            _call(server.port, "GET", "/global/1", host=_outside_address())
    finally:
        server.stop()


def test_a_spark_jobs_server_answers_only_the_hosts_of_its_layout(
        caplog: pytest.LogCaptureFixture) -> None:
    """Before the layout nobody is answered; then the layout's hosts are, and everyone
    else gets 403, is counted and named in the lifecycle log."""
    from mlflow_hvd.protocol.messages import LayoutReport, RankSlot

    here = _outside_address()
    server = Rendezvous(2, here)
    try:
        assert _call(server.port, "GET", "/global/1", host=here)[0] == 403  # no layout yet
        elsewhere = (RankSlot("198.51.100.99", 0, 0, 0, 1, 1, 1),)
        assert server.on_layout(LayoutReport(0, elsewhere)) is None
        with caplog.at_level("WARNING", logger="mlflow_hvd.driver.rendezvous"):
            assert _call(server.port, "PUT", "/global/1", b"evil", host=here) == (403, b"")
        assert f"refused a request from {here}, not a host of this job" in caplog.text
        stats = server.stats()
        assert (stats.refused, stats.requests) == (2, 0)  # nothing reached the store
    finally:
        server.stop()
    server = Rendezvous(2, here)
    try:  # a task on this machine: its ranks may connect from any of its addresses
        assert server.on_layout(LayoutReport(0, (RankSlot(here, 0, 0, 0, 1, 1, 1),))) is None
        assert _call(server.port, "PUT", "/global/1", b"ok", host=here)[0] == 200
        assert server.stats().refused == 0
    finally:
        server.stop()


def test_a_driver_address_that_is_not_this_machines_listens_on_every_interface() -> None:
    """Behind NAT the address executors are told (spark.driver.host) is not one the driver
    can bind: the server listens on every interface instead, like the channel, and still
    answers only the layout's hosts."""
    from mlflow_hvd.common.network import listen_address
    from mlflow_hvd.protocol.messages import LayoutReport, RankSlot

    # a documentation address nobody here has: the generation's choice is every interface
    server = Rendezvous(2, listen_address("198.51.100.250"))
    try:
        assert server.on_layout(LayoutReport(0, (RankSlot("127.0.0.1", 0, 0, 0, 1, 1, 1),))) is None
        assert _call(server.port, "PUT", "/global/1", b"ok")[0] == 200
    finally:
        server.stop()


def test_without_horovod_no_server_starts_and_the_layout_is_still_agreed() -> None:
    """A driver without Horovod (torch.distributed code needs none) starts no server: port
    0, which the agent turns into no HOROVOD_GLOO_RENDEZVOUS_* for the ranks."""
    from mlflow_hvd.common.layout import assign_slots
    from mlflow_hvd.protocol.messages import LayoutReport

    before = {t.name for t in threading.enumerate()}
    server = Rendezvous(2, horovod=False)
    try:
        assert server.port == 0
        assert "mlflow-hvd-rendezvous" not in {t.name for t in threading.enumerate()} - before
        slots = assign_slots(["a", "b"])
        assert server.on_layout(LayoutReport(0, slots)) is None
        assert server.on_layout(LayoutReport(1, slots)) is None
        other = server.on_layout(LayoutReport(1, assign_slots(["a", "a"])))
        assert other is not None and other.partition == 1
        server.reset()
        assert server.stats() == rdv.NO_SERVER
    finally:
        server.stop()

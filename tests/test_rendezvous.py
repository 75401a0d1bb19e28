"""The driver's rendezvous server: horovod's protocol, with requests for keys that are not
there yet held until they arrive, and an account of the load."""

from __future__ import annotations

import http.client
import threading
import time

import pytest

from mlflow_hvd.driver import rendezvous as rdv
from mlflow_hvd.driver.rendezvous import Rendezvous


def _call(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_a_request_for_a_missing_key_is_answered_when_the_key_arrives() -> None:
    server = Rendezvous(2)
    try:
        got: list[tuple[int, bytes, float]] = []

        def ask() -> None:
            t0 = time.monotonic()
            status, body = _call(server.port, "GET", "/global/1")
            got.append((status, body, time.monotonic() - t0))

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(0.3)
        assert _call(server.port, "PUT", "/global/1", b"addresses")[0] == 200
        asker.join(timeout=10)
        (status, body, waited), = got
        assert (status, body) == (200, b"addresses")  # one request, no "not yet" in between
        assert 0.25 < waited < rdv.HOLD_SECONDS
        stats = server.stats()
        assert (stats.requests, stats.not_found, stats.bytes_sent) == (2, 0, 9)
        assert 0.25 < stats.seconds < rdv.HOLD_SECONDS  # the PUT's answer, then the GET's
    finally:
        server.stop()


def test_a_key_that_never_comes_is_not_found_after_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rdv, "HOLD_SECONDS", 0.3)
    server = Rendezvous(2)
    try:
        t0 = time.monotonic()
        assert _call(server.port, "GET", "/global/7")[0] == 404
        assert 0.3 <= time.monotonic() - t0 < 2
        assert _call(server.port, "DELETE", "/global/0")[0] == 200
        stats = server.stats()
        assert (stats.requests, stats.not_found, stats.bytes_sent) == (2, 1, 0)
    finally:
        server.stop()


def test_stop_returns_promptly_and_closes_the_port() -> None:
    server = Rendezvous(2)
    port = server.port
    t0 = time.monotonic()
    server.stop()
    assert time.monotonic() - t0 < 1
    with pytest.raises(ConnectionRefusedError):
        _call(port, "GET", "/global/0")


def test_a_channel_that_cannot_listen_leaves_no_rendezvous_server_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow_hvd.driver import job
    from mlflow_hvd.driver.supervisor import DriverSettings

    def cannot_listen(*args: object, **kwargs: object) -> None:
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(job, "ChannelServer", cannot_listen)
    with pytest.raises(OSError, match="Address already in use"):
        job.run_job(2, b"", object(), DriverSettings(), "127.0.0.1", "test")  # type: ignore[arg-type]
    assert not [t for t in threading.enumerate() if t.name == "mlflow-hvd-rendezvous"]

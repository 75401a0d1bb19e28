"""The authenticated channel: round trips, and forged messages never get unpickled."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from mlflow_hvd.channel import (
    MAGIC,
    ChannelClient,
    ChannelServer,
    encode_frame,
    sign,
)
from mlflow_hvd.errors import AuthenticationError, ChannelError
from mlflow_hvd.messages import OutputLines, Stream, WorkerStarted

SECRET = b"s" * 32


class _Evil:
    """Unpickling this creates a file: proof that the driver unpickled a message."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (open, (self.path, "w"))


@pytest.fixture()
def server() -> object:
    received: list[object] = []
    srv = ChannelServer(SECRET, received.append, bind_host="127.0.0.1")
    srv.start()
    srv.received = received  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def _wait_for(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_messages_arrive_in_order_and_send_returns_after_handling(server: object) -> None:
    client = ChannelClient("127.0.0.1", server.port, SECRET)  # type: ignore[attr-defined]
    msgs = [WorkerStarted(0, "h"), OutputLines(0, Stream.STDOUT, ("a", "b"))]
    for m in msgs:
        client.send(m)
    assert server.received == msgs  # type: ignore[attr-defined]
    client.close()


def test_concurrent_senders_share_one_client(server: object) -> None:
    client = ChannelClient("127.0.0.1", server.port, SECRET)  # type: ignore[attr-defined]
    threads = [
        threading.Thread(
            target=lambda i=i: [client.send(OutputLines(i, Stream.LOG, (str(j),)))
                                for j in range(50)]
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(server.received) == 200  # type: ignore[attr-defined]
    client.close()


def test_wrong_secret_is_rejected_before_unpickling(server: object, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    client = ChannelClient("127.0.0.1", server.port, b"x" * 32)  # type: ignore[attr-defined]
    with pytest.raises(AuthenticationError, match="wrong run secret"):
        client.send(_Evil(str(marker)))
    assert not marker.exists()
    assert server.received == []  # type: ignore[attr-defined]
    assert "signature does not match" in server.rejected[0]  # type: ignore[attr-defined]


def test_forged_frame_with_valid_header_but_bad_mac_is_rejected(
    server: object, tmp_path: Path
) -> None:
    marker = tmp_path / "unpickled"
    body = pickle.dumps(_Evil(str(marker)))
    with socket.create_connection(("127.0.0.1", server.port)) as s:  # type: ignore[attr-defined]
        s.sendall(MAGIC + struct.pack(">Q", len(body)) + os.urandom(32) + body)
        assert s.recv(1) == b"\x00"
    assert not marker.exists()
    assert server.received == []  # type: ignore[attr-defined]


def test_garbage_and_oversize_frames_are_rejected(server: object) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:  # type: ignore[attr-defined]
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert s.recv(1) == b"\x00"
    with socket.create_connection(("127.0.0.1", server.port)) as s:  # type: ignore[attr-defined]
        s.sendall(MAGIC + struct.pack(">Q", 1 << 40) + sign(SECRET, b""))
        assert s.recv(1) == b"\x00"
    _wait_for(lambda: len(server.rejected) == 2)  # type: ignore[attr-defined]
    assert "bad frame header" in server.rejected[0]  # type: ignore[attr-defined]
    assert "exceeds the limit" in server.rejected[1]  # type: ignore[attr-defined]
    assert server.received == []  # type: ignore[attr-defined]


def test_valid_frame_built_by_hand_is_accepted(server: object) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:  # type: ignore[attr-defined]
        s.sendall(encode_frame(SECRET, WorkerStarted(1, "h")))
        assert s.recv(1) == b"\x01"
    assert server.received == [WorkerStarted(1, "h")]  # type: ignore[attr-defined]


def test_unreachable_driver_names_address_and_what_to_check() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    expected = rf"cannot reach the mlflow_hvd driver at 127.0.0.1:{port}"
    with pytest.raises(ChannelError, match=expected):
        ChannelClient("127.0.0.1", port, SECRET, timeout=2)


def test_driver_closing_mid_send_is_a_channel_error() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    frame_len = len(encode_frame(SECRET, WorkerStarted(0, "h")))

    def accept_and_close() -> None:
        conn, _ = listener.accept()
        got = 0
        while got < frame_len:  # read the whole frame, then hang up without an ack
            got += len(conn.recv(frame_len - got))
        conn.close()

    t = threading.Thread(target=accept_and_close)
    t.start()
    client = ChannelClient("127.0.0.1", port, SECRET, timeout=5)
    with pytest.raises(ChannelError, match="closed the connection while handling WorkerStarted"):
        client.send(WorkerStarted(0, "h"))
    t.join()
    listener.close()

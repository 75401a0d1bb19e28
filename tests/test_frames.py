"""The channel's frames (protocol/channel.py): cut, closed and oversize frames, and a
driver that is gone."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from mlflow_hvd.driver.channel_server import ChannelServer
from mlflow_hvd.errors import AuthenticationError, ChannelError
from mlflow_hvd.protocol.channel import (
    MAGIC,
    ChannelClient,
    encode_frame,
    read_frame,
)
from mlflow_hvd.protocol.messages import RankDisconnected, WorkerStarted

SECRET = b"s" * 32


class _Pair:
    """A connected socket pair: ``a`` writes raw bytes, ``b`` is read by read_frame."""

    def __init__(self) -> None:
        self.a, self.b = socket.socketpair()
        self.b.settimeout(5)

    def close(self) -> None:
        self.a.close()
        self.b.close()


def test_frame_cut_short_is_an_eof_naming_the_missing_bytes() -> None:
    pair = _Pair()
    frame = encode_frame(SECRET, WorkerStarted(0, "h"))
    pair.a.sendall(frame[:-5])
    pair.a.close()
    with pytest.raises(EOFError, match=r"^connection closed with 5 of \d+ bytes unread$"):
        read_frame(pair.b, SECRET)
    pair.close()


def test_connection_closed_between_frames_is_a_plain_eof() -> None:
    pair = _Pair()
    pair.a.close()
    with pytest.raises(EOFError, match="^connection closed$"):
        read_frame(pair.b, SECRET)
    pair.close()


def test_oversize_frame_is_refused_from_its_header() -> None:
    pair = _Pair()
    pair.a.sendall(MAGIC + (1 << 40).to_bytes(8, "big"))
    with pytest.raises(AuthenticationError) as info:
        read_frame(pair.b, SECRET, max_frame=1024)
    assert str(info.value) == f"frame of {1 << 40} bytes exceeds the limit of 1024"
    pair.close()


def test_send_to_a_driver_that_is_gone_is_a_channel_error() -> None:
    received: list[Any] = []
    server = ChannelServer(SECRET, received.append, bind_host="127.0.0.1")
    port = server.start()
    client = ChannelClient("127.0.0.1", port, SECRET, timeout=5)
    client.send(WorkerStarted(0, "h"))
    # the peer resets the connection: the next send fails with a clear error
    client._sock.shutdown(socket.SHUT_RDWR)
    with pytest.raises(ChannelError) as info:
        client.send(WorkerStarted(0, "h"))
    assert str(info.value).startswith(
        f"lost the connection to the driver at 127.0.0.1:{port} while sending WorkerStarted: "
    )
    client.close()
    server.stop()
    assert received == [WorkerStarted(0, "h"), RankDisconnected(0)]

"""The authenticated channel: round trips, and forged messages never get unpickled."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from services import wait_until

from mlflow_hvd.driver.channel_server import ChannelServer
from mlflow_hvd.errors import AuthenticationError, ChannelError
from mlflow_hvd.protocol.channel import (
    MAGIC,
    ChannelClient,
    encode_frame,
    handshake_reply,
    read_frame,
    sign,
)
from mlflow_hvd.protocol.messages import OutputLines, RankDisconnected, Stream, WorkerStarted

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


def _wait_for(cond: Callable[[], object], timeout: float = 5.0) -> None:
    wait_until(cond, timeout, "the server to see it")


def test_messages_arrive_in_order_and_send_returns_after_handling(server: object) -> None:
    client = ChannelClient("127.0.0.1", server.port, SECRET, timeout=5)  # type: ignore[attr-defined]
    msgs = [WorkerStarted(0, "h"), OutputLines(0, Stream.STDOUT, ("a", "b"))]
    for m in msgs:
        client.send(m)
    assert server.received == msgs  # type: ignore[attr-defined]
    client.close()


def test_concurrent_senders_share_one_client(server: object) -> None:
    client = ChannelClient("127.0.0.1", server.port, SECRET, timeout=5)  # type: ignore[attr-defined]
    threads = [
        threading.Thread(
            target=lambda i=i: [
                client.send(OutputLines(i, Stream.LOG, (str(j),))) for j in range(50)
            ]
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(server.received) == 200  # type: ignore[attr-defined]
    client.close()


def _raw(server: object) -> tuple[socket.socket, bytes]:
    """A plain TCP connection to the driver, and the driver's challenge read from it."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)  # type: ignore[attr-defined]
    challenge = s.recv(len(MAGIC) + 32, socket.MSG_WAITALL)
    assert challenge.startswith(MAGIC) and len(challenge) == len(MAGIC) + 32
    return s, challenge


def test_wrong_secret_is_rejected_at_the_handshake(server: object, tmp_path: Path) -> None:
    with pytest.raises(AuthenticationError) as info:
        ChannelClient("127.0.0.1", server.port, b"x" * 32, timeout=5)  # type: ignore[attr-defined]
    assert (
        str(info.value)
        == (
            f"the driver at 127.0.0.1:{server.port} rejected this connection: "  # type: ignore[attr-defined]
            "wrong run secret"
        )
    )
    _wait_for(lambda: len(server.rejected) == 1)  # type: ignore[attr-defined]
    assert server.rejected[0].endswith(  # type: ignore[attr-defined]
        "handshake signature does not match this run's secret"
    )
    assert server.received == []  # type: ignore[attr-defined]


def test_forged_handshake_is_cut_off_after_37_bytes(server: object) -> None:
    """A stranger streaming a huge body is disconnected, not read (37 bytes, not 64 MiB)."""
    s, s_challenge = _raw(server)
    with s:
        s.sendall(MAGIC + os.urandom(32))
        assert s.recv(1) == b"\x00"
        with pytest.raises(OSError) as info:  # the driver closed: the pipe breaks
            s.sendall(struct.pack(">Q", 1 << 30) + os.urandom(32) + b"x" * (64 << 20))
        assert not isinstance(info.value, TimeoutError)
    _wait_for(lambda: len(server.rejected) == 1)  # type: ignore[attr-defined]
    assert server.received == []  # type: ignore[attr-defined]


def test_a_handshake_cannot_be_replayed_on_another_connection(server: object) -> None:
    first, first_challenge = _raw(server)
    with first:
        reply = handshake_reply(SECRET, first_challenge)
        first.sendall(reply)
        assert first.recv(1) == b"\x01"
    second, second_challenge = _raw(server)
    with second:  # a new nonce: the recorded reply no longer matches
        second.sendall(reply)
        assert second.recv(1) == b"\x00"


def test_forged_frame_after_a_valid_handshake_is_rejected_before_unpickling(
    server: object, tmp_path: Path
) -> None:
    marker = tmp_path / "unpickled"
    body = pickle.dumps(_Evil(str(marker)))
    s, s_challenge = _raw(server)
    with s:
        s.sendall(handshake_reply(SECRET, s_challenge))
        assert s.recv(1) == b"\x01"
        s.sendall(MAGIC + struct.pack(">Q", len(body)) + os.urandom(32) + body)
        assert s.recv(1) == b"\x00"
    assert not marker.exists()
    assert server.received == []  # type: ignore[attr-defined]
    assert server.rejected[0].endswith(  # type: ignore[attr-defined]
        "message signature does not match this run's secret"
    )


def test_garbage_and_oversize_frames_are_rejected(server: object) -> None:
    s, s_challenge = _raw(server)
    with s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40)
        assert s.recv(1) == b"\x00"
    s, s_challenge = _raw(server)
    with s:
        s.sendall(handshake_reply(SECRET, s_challenge))
        assert s.recv(1) == b"\x01"
        s.sendall(MAGIC + struct.pack(">Q", 1 << 40) + sign(SECRET, b""))
        assert s.recv(1) == b"\x00"
    _wait_for(lambda: len(server.rejected) == 2)  # type: ignore[attr-defined]
    assert "bad handshake b'GET /'" in server.rejected[0]  # type: ignore[attr-defined]
    assert "exceeds the limit" in server.rejected[1]  # type: ignore[attr-defined]
    assert server.received == []  # type: ignore[attr-defined]


def test_valid_frame_built_by_hand_is_accepted(server: object) -> None:
    s, s_challenge = _raw(server)
    with s:
        s.sendall(handshake_reply(SECRET, s_challenge))
        assert s.recv(1) == b"\x01"
        s.sendall(encode_frame(SECRET, WorkerStarted(1, "h")))
        assert s.recv(1) == b"\x01"
    _wait_for(lambda: len(server.received) == 2)  # type: ignore[attr-defined]
    # closing the rank's own connection tells the driver its process is gone
    assert server.received == [WorkerStarted(1, "h"), RankDisconnected(1)]  # type: ignore[attr-defined]


def test_stop_closes_idle_connections() -> None:
    received: list[object] = []
    srv = ChannelServer(SECRET, received.append, bind_host="127.0.0.1")
    srv.start()
    client = ChannelClient("127.0.0.1", srv.port, SECRET, timeout=5)
    client.send(WorkerStarted(0, "h"))
    srv.stop()
    assert client._sock.recv(1) == b""  # the driver closed it; no thread is left reading
    _wait_for(lambda: received == [WorkerStarted(0, "h"), RankDisconnected(0)])
    client.close()


def test_a_frame_that_stalls_midway_is_dropped(
    server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow_hvd.driver.channel_server as channel_server

    monkeypatch.setattr(channel_server, "FRAME_TIMEOUT", 0.5)
    s, s_challenge = _raw(server)
    with s:
        s.sendall(handshake_reply(SECRET, s_challenge))
        assert s.recv(1) == b"\x01"
        s.sendall(MAGIC + struct.pack(">Q", 100))  # ...and never the rest
        assert s.recv(1) == b""  # closed by the driver after FRAME_TIMEOUT


def test_unreachable_driver_names_address_and_what_to_check() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    expected = (rf"cannot reach the mlflow_hvd driver at 127.0.0.1:{port} \(1 attempt in "
                r"[\d.]+s, deadline 2s\): connection refused: nothing listens there")
    with pytest.raises(ChannelError, match=expected):
        ChannelClient("127.0.0.1", port, SECRET, timeout=2)


def test_a_driver_that_never_sends_its_challenge_is_named_as_such() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # accepted by the kernel, never by anyone: no challenge comes
        port = listener.getsockname()[1]
        with pytest.raises(ChannelError, match=r"\(1 attempt in [\d.]+s, deadline 1.5s\): "
                           r"connected, but the driver sent no challenge within [\d.]+s"):
            ChannelClient("127.0.0.1", port, SECRET, timeout=1.5)


def test_a_refused_connection_fails_at_once() -> None:
    """Nothing listening means the driver is gone: no retrying for the whole deadline."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free, and closed again
    # one attempt, not retried for the 30 s deadline
    with pytest.raises(ChannelError,
                       match=r"\(1 attempt in [\d.]+s, deadline 30s\): connection refused"):
        ChannelClient("127.0.0.1", port, SECRET, timeout=30)


def test_a_reset_connection_is_tried_again() -> None:
    """A reset (what a full listen backlog gives with tcp_abort_on_overflow) is transient:
    the client connects again and gets through within its deadline."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    got: list[bytes] = []

    def serve() -> None:
        first, _ = listener.accept()
        first.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        first.close()  # RST
        conn, _ = listener.accept()
        with conn:
            conn.sendall(MAGIC + os.urandom(32))
            conn.recv(len(MAGIC) + 32, socket.MSG_WAITALL)
            conn.sendall(b"\x01")
            header = conn.recv(len(MAGIC) + 8 + 32, socket.MSG_WAITALL)
            (length,) = struct.unpack(">Q", header[len(MAGIC):len(MAGIC) + 8])
            got.append(conn.recv(length, socket.MSG_WAITALL))
            conn.sendall(b"\x01")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        client = ChannelClient("127.0.0.1", port, SECRET, timeout=10)
        client.send(WorkerStarted(0, "h"))
        client.close()
        assert pickle.loads(got[0]) == WorkerStarted(0, "h")
    finally:
        t.join(timeout=10)
        listener.close()


def test_driver_closing_mid_send_is_a_channel_error() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    frame_len = len(encode_frame(SECRET, WorkerStarted(0, "h")))

    def accept_and_close() -> None:
        conn, _ = listener.accept()
        conn.sendall(MAGIC + b"n" * 32)  # challenge; any reply is accepted by this fake
        conn.recv(len(MAGIC) + 32, socket.MSG_WAITALL)
        conn.sendall(b"\x01")
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


def test_a_request_the_driver_does_not_answer_in_time_is_a_channel_error() -> None:
    from mlflow_hvd.protocol.messages import AwaitJob, Retire

    release = threading.Event()
    srv = ChannelServer(SECRET, lambda message: None, bind_host="127.0.0.1",
                        on_request=lambda request: (release.wait(10), Retire())[1])
    srv.start()
    client = ChannelClient("127.0.0.1", srv.port, SECRET, timeout=5)
    try:
        with pytest.raises(ChannelError, match=(
            rf"^the driver at 127.0.0.1:{srv.port} did not answer AwaitJob within 0.5s$"
        )):
            client.request(AwaitJob(0), timeout=0.5)
    finally:
        release.set()
        client.close()
        srv.stop()


class _FakeDriver:
    """A listening socket that speaks the driver's side of the handshake by hand, then
    answers each frame with the byte the test chooses (or closes the connection)."""

    def __init__(self, answer: bytes | None, handshake: bool = True) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.answer, self.handshake = answer, handshake
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            if not self.handshake:
                return  # closes at once: the handshake never completes
            conn.sendall(MAGIC + os.urandom(32))
            conn.recv(len(MAGIC) + 32, socket.MSG_WAITALL)
            conn.sendall(b"\x01")
            header = conn.recv(len(MAGIC) + 8 + 32, socket.MSG_WAITALL)
            (length,) = struct.unpack(">Q", header[len(MAGIC):len(MAGIC) + 8])
            conn.recv(length, socket.MSG_WAITALL)
            if self.answer is not None:
                conn.sendall(self.answer)

    def close(self) -> None:
        self.thread.join(timeout=10)
        self.listener.close()


def test_a_driver_that_breaks_off_the_handshake_is_a_channel_error() -> None:
    fake = _FakeDriver(None, handshake=False)
    try:
        # closed before the challenge: the driver is stopping; no second attempt
        with pytest.raises(ChannelError, match=(
            rf"^cannot reach the mlflow_hvd driver at 127.0.0.1:{fake.port} \(1 attempt in "
            r"[\d.]+s, deadline 5s\): connected, but the driver closed the connection before its "
            r"challenge"
        )):
            ChannelClient("127.0.0.1", fake.port, SECRET, timeout=5)
    finally:
        fake.close()


def test_a_message_the_driver_rejects_is_an_authentication_error() -> None:
    fake = _FakeDriver(b"\x00")  # ACK_REJECTED
    client = ChannelClient("127.0.0.1", fake.port, SECRET, timeout=5)
    try:
        with pytest.raises(AuthenticationError,
                           match="^the driver rejected the message: wrong run secret$"):
            client.send(WorkerStarted(0, "h"))
    finally:
        client.close()
        fake.close()


def test_a_request_answered_with_a_plain_ack_is_a_channel_error() -> None:
    from mlflow_hvd.protocol.messages import AwaitJob

    fake = _FakeDriver(b"\x01")  # ACK_OK: no answer frame follows
    client = ChannelClient("127.0.0.1", fake.port, SECRET, timeout=5)
    try:
        with pytest.raises(ChannelError, match=(
            rf"^the driver at 127.0.0.1:{fake.port} did not answer AwaitJob \(ack b'\\x01'\)$"
        )):
            client.request(AwaitJob(0), timeout=5)
    finally:
        client.close()
        fake.close()


def test_a_send_that_cannot_get_the_connection_in_time_is_not_sent() -> None:
    received: list[object] = []
    srv = ChannelServer(SECRET, received.append, bind_host="127.0.0.1")
    srv.start()
    client = ChannelClient("127.0.0.1", srv.port, SECRET, timeout=5)
    try:
        # another send in progress (e.g. interrupted by a signal handler)
        with client._lock, pytest.raises(ChannelError, match=(
            "^another send is in progress; WorkerStarted not sent$"
        )):
            client.send(WorkerStarted(0, "h"), lock_timeout=0.1)
        assert received == []
    finally:
        client.close()
        srv.stop()


def test_a_challenge_or_frame_from_a_stranger_is_refused_before_anything_is_read() -> None:
    with pytest.raises(AuthenticationError, match=r"^bad challenge b'HTTP/1\.1': not an "
                       "mlflow_hvd driver$"):
        handshake_reply(SECRET, b"HTTP/1.1 200 OK\r\n" + b"x" * 20)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"GET / HTTP/1.1\r\n")
        with pytest.raises(AuthenticationError, match=r"^bad frame header b'GET /': not an "
                           "mlflow_hvd peer$"):
            read_frame(b, SECRET)


def test_a_driver_that_goes_away_before_its_answer_is_a_channel_error() -> None:
    from mlflow_hvd.protocol.messages import AwaitJob

    fake = _FakeDriver(b"\x02")  # ACK_REPLY, then the connection closes: no answer frame
    client = ChannelClient("127.0.0.1", fake.port, SECRET, timeout=5)
    try:
        with pytest.raises(ChannelError, match=(
            rf"^lost the connection to the driver at 127.0.0.1:{fake.port} while waiting for "
            "its answer to AwaitJob: connection closed$"
        )):
            client.request(AwaitJob(0), timeout=5)
    finally:
        client.close()
        fake.close()

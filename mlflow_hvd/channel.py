"""The authenticated channel that carries messages from workers and tasks to the driver.

Frame: ``MAGIC | 8-byte body length | 32-byte HMAC-SHA256(secret, body) | body``. The
driver verifies the HMAC with :func:`hmac.compare_digest` *before* unpickling the body, so a
peer without the per-run secret can never make the driver unpickle anything. Every frame is
acknowledged with one byte, which gives senders back-pressure and ordering: when
:meth:`ChannelClient.send` returns, the driver has handled the message.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import pickle
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from typing import Any

from mlflow_hvd.errors import AuthenticationError, ChannelError

log = logging.getLogger(__name__)

MAGIC = b"MHVD1"
_LEN = struct.Struct(">Q")
_MAC_SIZE = 32
ACK_OK = b"\x01"
ACK_REJECTED = b"\x00"
DEFAULT_MAX_FRAME = 1 << 31  # 2 GiB: a rank-0 return value larger than this is refused


def sign(secret: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 of ``body`` under the run's secret."""
    return hmac.new(secret, body, hashlib.sha256).digest()


def encode_frame(secret: bytes, message: object) -> bytes:
    """Pickle and sign one message into a frame."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return MAGIC + _LEN.pack(len(body)) + sign(secret, body) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    remaining = n
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise EOFError(f"connection closed with {remaining} of {n} bytes unread")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, secret: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> Any:
    """Read one frame, verify its signature, and only then unpickle it.

    Raises:
        EOFError: The peer closed the connection between frames.
        AuthenticationError: Bad magic, oversize frame or wrong signature (nothing unpickled).
    """
    magic = sock.recv(len(MAGIC), socket.MSG_WAITALL)
    if not magic:
        raise EOFError("connection closed")
    if magic != MAGIC:
        raise AuthenticationError(f"bad frame header {magic!r}: not an mlflow_hvd peer")
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > max_frame:
        raise AuthenticationError(f"frame of {length} bytes exceeds the limit of {max_frame}")
    mac = _recv_exact(sock, _MAC_SIZE)
    body = _recv_exact(sock, length)
    if not hmac.compare_digest(mac, sign(secret, body)):
        raise AuthenticationError("message signature does not match this run's secret")
    return pickle.loads(body)


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        while True:
            try:
                message = read_frame(sock, self.server.secret)
            except EOFError:
                return
            except AuthenticationError as exc:
                self.server.note_rejected(self.client_address, exc)
                with contextlib.suppress(OSError):
                    sock.sendall(ACK_REJECTED)
                return
            except OSError:
                return
            try:
                self.server.on_message(message)
            except Exception:  # the driver's handler must not kill the connection thread
                log.exception("driver failed to handle %r", type(message).__name__)
            try:
                sock.sendall(ACK_OK)
            except OSError:
                return


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], secret: bytes, on_message: Callable[[Any], None]
    ) -> None:
        self.secret = secret
        self.on_message = on_message
        self.rejected: list[str] = []
        self._lock = threading.Lock()
        super().__init__(address, _Handler)

    def note_rejected(self, peer: Any, exc: Exception) -> None:
        with self._lock:
            self.rejected.append(f"{peer}: {exc}")
        log.warning("mlflow_hvd: rejected a message from %s: %s", peer, exc)


class ChannelServer:
    """Driver side of the channel.

    Args:
        secret: The per-run secret.
        on_message: Called with each authenticated message, in the connection's thread;
            the sender waits until it returns.
        bind_host: Interface to listen on ("" for all, as Spark executors may be remote).
    """

    def __init__(
        self, secret: bytes, on_message: Callable[[Any], None], bind_host: str = ""
    ) -> None:
        self._server = _TCPServer((bind_host, 0), secret, on_message)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def rejected(self) -> list[str]:
        """Descriptions of rejected (unauthenticated or malformed) messages."""
        return list(self._server.rejected)

    def start(self) -> int:
        """Serve in a daemon thread; returns the bound port (the socket already listens)."""
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},  # stop() returns within 50 ms
            name="mlflow-hvd-channel",
            daemon=True,
        )
        self._thread.start()
        return self.port

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
        self._server.server_close()


class ChannelClient:
    """Worker side of the channel: a connection that sends messages and awaits each ack.

    Thread-safe. Every operation has a deadline of ``timeout`` seconds.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 60.0) -> None:
        self._address = (host, port)
        self._secret = secret
        self._timeout = timeout
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection(self._address, timeout=timeout)
        except OSError as exc:
            raise ChannelError(
                f"cannot reach the mlflow_hvd driver at {host}:{port} within {timeout:g}s: "
                f"{exc}. Check that executors can open connections to the driver host "
                "(spark.driver.host) and that no firewall blocks the port."
            ) from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, message: object, lock_timeout: float | None = None) -> None:
        """Send one message and wait until the driver has handled it.

        ``lock_timeout``: wait at most this long for another send in progress (a signal
        handler must not wait for the code it interrupted).

        Raises:
            AuthenticationError: The driver rejected the message (wrong secret).
            ChannelError: The driver is gone or did not answer within the timeout.
        """
        frame = encode_frame(self._secret, message)
        if not self._lock.acquire(timeout=-1 if lock_timeout is None else lock_timeout):
            raise ChannelError(f"another send is in progress; {type(message).__name__} not sent")
        try:
            self._sock.sendall(frame)
            ack = self._sock.recv(1)
        except OSError as exc:
            raise ChannelError(
                f"lost the connection to the driver at {self._address[0]}:"
                f"{self._address[1]} while sending {type(message).__name__}: {exc}"
            ) from exc
        finally:
            self._lock.release()
        if ack == ACK_REJECTED:
            raise AuthenticationError("the driver rejected the message: wrong run secret")
        if ack != ACK_OK:
            raise ChannelError(
                f"the driver at {self._address[0]}:{self._address[1]} closed the connection "
                f"while handling {type(message).__name__}"
            )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

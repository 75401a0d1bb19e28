"""The authenticated channel that carries messages from workers and tasks to the driver:
its frames and handshake, and the client every sender uses (the driver's server is
:mod:`mlflow_hvd.driver.channel_server`).

Connection: the driver first sends ``MAGIC | 32-byte nonce``; the peer must answer
``MAGIC | HMAC-SHA256(secret, HELLO + nonce)`` within ``HANDSHAKE_TIMEOUT`` seconds, and the
driver answers one ack byte. Until then the driver reads at most 37 bytes from a peer, so a
stranger can neither make it read a large body nor replay another connection's handshake.

Frame: ``MAGIC | 8-byte body length | 32-byte HMAC-SHA256(secret, body) | body``. The
driver verifies the HMAC with :func:`hmac.compare_digest` *before* unpickling the body, so a
peer without the per-run secret can never make the driver unpickle anything. Every frame is
acknowledged with one byte, which gives senders back-pressure and ordering: when
:meth:`ChannelClient.send` returns, the driver has handled the message. Once a frame has
begun, the rest must arrive within ``FRAME_TIMEOUT``; between frames a connection may stay
idle (a rank trains for hours without a word) until the driver stops, which closes every
connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import pickle
import socket
import struct
import threading
from typing import Any

from mlflow_hvd.errors import AuthenticationError, ChannelError
from mlflow_hvd.protocol.messages import Request

log = logging.getLogger(__name__)

MAGIC = b"MHVD2"
HELLO = b"mlflow_hvd hello"
_LEN = struct.Struct(">Q")
MAC_SIZE = 32
NONCE_SIZE = 32
ACK_OK = b"\x01"
ACK_REJECTED = b"\x00"
ACK_REPLY = b"\x02"  # a signed frame with the driver's answer follows (requests only)
DEFAULT_MAX_FRAME = 1 << 31  # 2 GiB: a rank-0 return value larger than this is refused
HANDSHAKE_TIMEOUT = 10.0
FRAME_TIMEOUT = 60.0


def sign(secret: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 of ``body`` under the run's secret."""
    return hmac.new(secret, body, hashlib.sha256).digest()


def encode_frame(secret: bytes, message: object) -> bytes:
    """Pickle and sign one message into a frame."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return MAGIC + _LEN.pack(len(body)) + sign(secret, body) + body


def handshake_reply(secret: bytes, challenge: bytes) -> bytes:
    """The peer's answer to the driver's ``MAGIC | nonce`` challenge."""
    if len(challenge) != len(MAGIC) + NONCE_SIZE or not challenge.startswith(MAGIC):
        raise AuthenticationError(f"bad challenge {challenge[:8]!r}: not an mlflow_hvd driver")
    return MAGIC + sign(secret, HELLO + challenge[len(MAGIC):])


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    remaining = n
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise EOFError(f"connection closed with {remaining} of {n} bytes unread")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame(
    sock: socket.socket,
    secret: bytes,
    max_frame: int = DEFAULT_MAX_FRAME,
    frame_timeout: float | None = None,
) -> Any:
    """Read one frame, verify its signature, and only then unpickle it.

    Waits for a frame to begin as long as the socket's own timeout allows; once it has,
    the rest must arrive within ``frame_timeout`` seconds (None: the socket's timeout).

    Raises:
        EOFError: The peer closed the connection between frames.
        AuthenticationError: Bad magic, oversize frame or wrong signature (nothing unpickled).
        TimeoutError: A frame began but did not complete in time.
    """
    magic = sock.recv(len(MAGIC), socket.MSG_WAITALL)
    if not magic:
        raise EOFError("connection closed")
    if magic != MAGIC:
        raise AuthenticationError(f"bad frame header {magic!r}: not an mlflow_hvd peer")
    previous = sock.gettimeout()
    if frame_timeout is not None:
        sock.settimeout(frame_timeout)
    try:
        (length,) = _LEN.unpack(recv_exact(sock, _LEN.size))
        if length > max_frame:
            raise AuthenticationError(f"frame of {length} bytes exceeds the limit of {max_frame}")
        mac = recv_exact(sock, MAC_SIZE)
        body = recv_exact(sock, length)
    finally:
        sock.settimeout(previous)
    if not hmac.compare_digest(mac, sign(secret, body)):
        raise AuthenticationError("message signature does not match this run's secret")
    return pickle.loads(body)


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
        try:
            challenge = recv_exact(self._sock, len(MAGIC) + NONCE_SIZE)
            self._sock.sendall(handshake_reply(secret, challenge))
            ack = self._sock.recv(1)
        except (OSError, EOFError) as exc:
            self.close()
            raise ChannelError(
                f"the mlflow_hvd driver at {host}:{port} did not complete the handshake: {exc}"
            ) from exc
        if ack != ACK_OK:
            self.close()
            raise AuthenticationError(
                f"the driver at {host}:{port} rejected this connection: wrong run secret"
            )

    def another(self) -> ChannelClient:
        """A new connection to the same driver, with the same secret and timeout.

        Raises:
            ChannelError, AuthenticationError: As the constructor.
        """
        return ChannelClient(*self._address, self._secret, self._timeout)

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

    def request(self, message: Request, timeout: float) -> object:
        """Send a request and return the driver's signed answer, waiting at most
        ``timeout`` seconds for the driver to decide (a pooled rank idles here between jobs:
        the driver answers within its idle limit).

        Raises:
            AuthenticationError: The answer is not signed with this run's secret.
            ChannelError: The driver is gone, or did not answer within ``timeout``.
        """
        frame = encode_frame(self._secret, message)
        what = type(message).__name__
        host, port = self._address
        with self._lock:
            try:
                self._sock.sendall(frame)
                self._sock.settimeout(timeout)
                try:
                    ack = self._sock.recv(1)
                finally:
                    self._sock.settimeout(self._timeout)
                if ack == ACK_REPLY:
                    return read_frame(self._sock, self._secret, frame_timeout=self._timeout)
            except TimeoutError as exc:
                raise ChannelError(
                    f"the driver at {host}:{port} did not answer {what} within {timeout:g}s"
                ) from exc
            except (OSError, EOFError) as exc:
                raise ChannelError(
                    f"lost the connection to the driver at {host}:{port} while waiting for "
                    f"its answer to {what}: {exc}"
                ) from exc
        raise ChannelError(f"the driver at {host}:{port} did not answer {what} (ack {ack!r})")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

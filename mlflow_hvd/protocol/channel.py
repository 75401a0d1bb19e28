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
import errno
import hashlib
import hmac
import logging
import pickle
import random
import select
import socket
import struct
import threading
import time
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
# A client that cannot connect tries again until its deadline: each attempt waits at most
# this long (a dropped connection request is not re-sent by the kernel for 1, 3, 7 s ...),
# with a pause between attempts that doubles up to RETRY_PAUSE_MAX (with jitter, so that
# a whole job's ranks do not come back at once). A refused connection, or one the driver
# closes before its challenge, is final: the driver listens before any rank starts and
# closes connections only when it stops, so the driver is gone (a rank orphaned by a
# cancelled Spark task must then exit at once, not retry for a minute).
CONNECT_ATTEMPT = 5.0
RETRY_PAUSE = 0.05
RETRY_PAUSE_MAX = 2.0
GONE = (ConnectionRefusedError, EOFError, socket.gaierror)


def _no_route(exc: BaseException) -> bool:
    """This host has no route to the driver's address at all (``ENETUNREACH``)."""
    return isinstance(exc, OSError) and exc.errno == errno.ENETUNREACH


def connect_failure(exc: BaseException) -> str:
    """Why a connection to the driver failed, in words that say what to check."""
    if isinstance(exc, HandshakeTimeout):
        return (f"connected, but the driver sent no challenge within {exc.seconds:.3g}s (its "
                "accept queue is full, or the driver is overloaded)")
    if isinstance(exc, EOFError):
        return ("connected, but the driver closed the connection before its challenge (it "
                "is exiting, or this is not an mlflow_hvd driver)")
    if isinstance(exc, ConnectionRefusedError):
        return ("connection refused: nothing listens there (the driver has exited, or the "
                "address is not the driver's)")
    if isinstance(exc, TimeoutError):
        return ("connection timed out: nothing answered the connection request (a firewall "
                "drops it, or the driver's listen backlog is full)")
    if isinstance(exc, socket.gaierror):
        return f"the driver's host name does not resolve here: {exc}"
    if _no_route(exc):
        return ("network is unreachable: this host has no route to the driver's address "
                "(the driver is on a network the executors are not on)")
    if isinstance(exc, ConnectionResetError):
        return ("connection reset: the driver's host refused it (its listen backlog "
                "overflowed, or the driver is exiting)")
    return f"{type(exc).__name__}: {exc}"


class HandshakeTimeout(TimeoutError):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"no challenge within {seconds:.3g}s")
        self.seconds = seconds


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

    def __init__(self, host: str, port: int, secret: bytes, timeout: float) -> None:
        self._address = (host, port)
        self._secret = secret
        self._timeout = timeout
        self._lock = threading.Lock()
        self._sock, challenge = self._connect()
        try:
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

    def _connect(self) -> tuple[socket.socket, bytes]:
        """Connect and read the driver's challenge, trying again until the deadline.

        Raises:
            ChannelError: No attempt got a challenge in time; names the last cause.
        """
        host, port = self._address
        deadline = time.monotonic() + self._timeout
        pause = RETRY_PAUSE
        attempts = 0
        started = time.monotonic()
        while True:
            attempts += 1
            remaining = deadline - time.monotonic()
            sock: socket.socket | None = None
            try:
                sock = socket.create_connection(
                    self._address, timeout=max(0.01, min(CONNECT_ATTEMPT, remaining)))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                wait = max(0.01, min(HANDSHAKE_TIMEOUT, deadline - time.monotonic()))
                sock.settimeout(wait)
                try:
                    challenge = recv_exact(sock, len(MAGIC) + NONCE_SIZE)
                except TimeoutError:
                    raise HandshakeTimeout(wait) from None
                sock.settimeout(self._timeout)
                return sock, challenge
            except (OSError, EOFError) as exc:
                if sock is not None:
                    sock.close()
                cause = exc
                if isinstance(exc, GONE) or _no_route(exc):  # waiting cannot help
                    break
            pause_now = min(pause * random.uniform(0.5, 1.5), deadline - time.monotonic())
            if pause_now <= 0:
                break
            time.sleep(pause_now)
            pause = min(pause * 2, RETRY_PAUSE_MAX)
        raise ChannelError(
            f"cannot reach the mlflow_hvd driver at {host}:{port} ({attempts} "
            f"{'attempt' if attempts == 1 else 'attempts'} in "
            f"{time.monotonic() - started:.1f}s, deadline {self._timeout:g}s): "
            f"{connect_failure(cause)}. Check that executors can open connections to the "
            "driver host (spark.driver.host) and that no firewall blocks the port."
        ) from cause

    def fileno(self) -> int:
        """The connection's file descriptor: a child process given a copy keeps the
        connection open until it too is gone (how the driver learns a Spark task's worker
        ended even when the task was killed first)."""
        return self._sock.fileno()

    def driver_gone(self) -> bool:
        """Whether the driver closed this connection (its process ended): the socket reads
        as closed. Never waits; False while another thread sends (that send learns it)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if not readable:  # open, nothing to read: the driver is there
                return False
            return self._sock.recv(1, socket.MSG_PEEK) == b""  # readable: does not wait
        except OSError:  # reset, or closed here: gone
            return True
        finally:
            self._lock.release()

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

"""Driver side of the authenticated channel (:mod:`mlflow_hvd.protocol.channel`): a
threaded TCP server that checks each peer's handshake, verifies every frame before
unpickling it, hands messages to the driver and answers requests."""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlflow_hvd.errors import AuthenticationError
from mlflow_hvd.protocol.channel import (
    ACK_OK,
    ACK_REJECTED,
    ACK_REPLY,
    FRAME_TIMEOUT,
    HANDSHAKE_TIMEOUT,
    HELLO,
    MAC_SIZE,
    MAGIC,
    NONCE_SIZE,
    encode_frame,
    read_frame,
    recv_exact,
    sign,
)
from mlflow_hvd.protocol.messages import (
    LayoutReport,
    RankDisconnected,
    Request,
    TaskDisconnected,
    Unanswered,
    WorkerStarted,
)

log = logging.getLogger(__name__)

# Every rank of a job connects at once (its agent, then its worker). Python's socketserver
# listens with a backlog of 5: connections beyond it are dropped and the kernel retries them
# with exponential backoff (seconds, then minutes), so large jobs missed their start deadline.
# The kernel caps this at net.core.somaxconn.
LISTEN_BACKLOG = 4096


@dataclass(frozen=True)
class ChannelStats:
    """What the channel server handled for one job (or one generation of warm ranks)."""

    connections: int  # authenticated
    messages: int  # frames handled, requests included
    max_open: int  # most connections open at once


def _check_handshake(sock: socket.socket, secret: bytes) -> None:
    """Driver side of the handshake (reads at most ``len(MAGIC) + 32`` bytes).

    Raises:
        AuthenticationError: Bad magic or a reply not signed with this run's secret.
        EOFError, TimeoutError: The peer left or did not answer within the deadline.
    """
    nonce = os.urandom(NONCE_SIZE)
    sock.settimeout(HANDSHAKE_TIMEOUT)
    sock.sendall(MAGIC + nonce)
    reply = recv_exact(sock, len(MAGIC))
    if reply != MAGIC:
        raise AuthenticationError(f"bad handshake {reply!r}: not an mlflow_hvd peer")
    mac = recv_exact(sock, MAC_SIZE)
    if not hmac.compare_digest(mac, sign(secret, HELLO + nonce)):
        raise AuthenticationError("handshake signature does not match this run's secret")
    sock.settimeout(None)  # idle between frames is allowed; stop() closes the socket


def departure(message: object) -> RankDisconnected | TaskDisconnected | None:
    """What the end of a connection that sent ``message`` tells the driver (its first
    message that says whose it is): a rank's process announces itself (``WorkerStarted``),
    a Spark task its layout; any other connection (a thread's own) ends meaning nothing."""
    match message:
        case WorkerStarted(rank=rank):
            return RankDisconnected(rank)
        case LayoutReport(partition=partition):
            return TaskDisconnected(partition)
        case _:
            return None


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        # what the connection's end means: the rank or task it turned out to belong to
        gone: RankDisconnected | TaskDisconnected | None = None
        self.server.track(sock, True)
        try:
            try:
                _check_handshake(sock, self.server.secret)
            except AuthenticationError as exc:
                self._reject(sock, exc)
                return
            except (OSError, EOFError):
                return
            sock.sendall(ACK_OK)
            self.server.count(connection=True)
            while True:
                try:
                    message = read_frame(sock, self.server.secret, frame_timeout=FRAME_TIMEOUT)
                except EOFError:
                    return
                except AuthenticationError as exc:
                    self._reject(sock, exc)
                    return
                except OSError:
                    return
                self.server.count(connection=False)
                gone = gone or departure(message)
                match message:
                    case Request():
                        answer = ACK_REPLY + encode_frame(self.server.secret,
                                                          self._answer(message))
                    case _:
                        answer = ACK_OK
                        try:
                            self.server.on_message(message)
                        except Exception:  # the driver's handler must not kill this thread
                            log.exception("driver failed to handle %r", type(message).__name__)
                try:
                    sock.sendall(answer)
                except OSError:
                    return
        finally:
            self.server.track(sock, False)
            if gone is not None:  # the process is gone (or closed its channel)
                try:
                    self.server.on_message(gone)
                except Exception:  # the driver's handler must not kill this thread
                    log.exception("driver failed to handle %r", gone)

    def _answer(self, request: Request) -> object:
        """The driver's answer to ``request`` (may wait as long as the driver decides);
        :class:`Unanswered` when nobody answers requests or the answer failed."""
        if self.server.on_request is None:
            return Unanswered("this channel answers no requests")
        try:
            return self.server.on_request(request)
        except Exception as exc:
            log.exception("driver failed to answer %r", type(request).__name__)
            return Unanswered(f"the driver failed to answer {type(request).__name__}: "
                              f"{type(exc).__name__}: {exc}")

    def _reject(self, sock: socket.socket, exc: Exception) -> None:
        self.server.note_rejected(self.client_address, exc)
        with contextlib.suppress(OSError):
            sock.sendall(ACK_REJECTED)


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        secret: bytes,
        on_message: Callable[[Any], None],
        on_request: Callable[[Any], object] | None = None,
    ) -> None:
        self.secret = secret
        self.on_message = on_message
        self.on_request = on_request
        self.rejected: list[str] = []
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._connections = self._messages = self._max_open = 0
        super().__init__(address, _Handler)

    def track(self, sock: socket.socket, is_open: bool) -> None:
        with self._lock:
            (self._open.add if is_open else self._open.discard)(sock)
            self._max_open = max(self._max_open, len(self._open))

    def count(self, connection: bool) -> None:
        with self._lock:
            if connection:
                self._connections += 1
            else:
                self._messages += 1

    def stats(self) -> ChannelStats:
        with self._lock:
            return ChannelStats(self._connections, self._messages, self._max_open)

    def close_connections(self) -> None:
        with self._lock:
            socks = list(self._open)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

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
        bind_host: Address to listen on: the one workers connect to (loopback for local
            processes, the driver's address for Spark executors).
        on_request: Answers a :class:`~mlflow_hvd.protocol.messages.Request` (in the connection's
            thread; the sender waits for the answer). None: every request gets ``Unanswered``.
    """

    def __init__(
        self,
        secret: bytes,
        on_message: Callable[[Any], None],
        bind_host: str = "",
        on_request: Callable[[Any], object] | None = None,
    ) -> None:
        self._server = _TCPServer((bind_host, 0), secret, on_message, on_request)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def stats(self) -> ChannelStats:
        return self._server.stats()

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
        """Stop listening and close every connection (their threads then end)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
        self._server.server_close()
        self._server.close_connections()



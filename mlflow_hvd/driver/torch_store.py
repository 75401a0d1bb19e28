"""Driver side: the store ``torch.distributed`` ranks meet at, one per job.

``init_process_group(backend)`` with its default ``env://`` reads ``MASTER_ADDR`` and
``MASTER_PORT`` and joins a ``TCPStore`` there. Under ``torchrun`` the agent of the first
node hosts that store and every worker is a client (``TORCHELASTIC_USE_AGENT_STORE``); here
the driver does, at the address the ranks already reach it at (the job's channel and
Horovod's rendezvous), so no rank's host needs a port open to the others but Gloo's own.

Each job gets a new store on a new port: a warm rank's next job, a restarted attempt and
an elastic attempt on fewer ranks all find a store holding none of the last one's keys.
The port is bound when the job starts (a socket, no torch: the port reaches every rank
with its environment); torch is imported and the store serves only once a rank says it
imported ``torch.distributed`` (:class:`~mlflow_hvd.protocol.messages.TorchStoreWanted`).
A rank that connects before then waits in the socket's backlog. A driver without torch
offers no store (the ranks get no ``MASTER_PORT``, and torch says so at once).

A store that cannot start is the job's failure at once, naming why (``on_failure``): the
ranks would otherwise wait in ``init_process_group`` for torch's 30 minutes.

Security: torch's ``TCPStore`` has no authentication, and every rank trusts the peer
addresses it reads there. The ``TCPStore`` itself listens on loopback only; the job's port
is a gate in front of it that forwards a connection only from an address the job's
:class:`~mlflow_hvd.driver.admission.Admission` admits (the layout's hosts, as the
rendezvous answers), and closes any other before reading or writing a byte, counting it
and naming it in the lifecycle log. The gate listens only on the job's own address (on
every interface only where that address is not one of this host's, as the job's channel
does), only for the job's life, on a port chosen for it.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from mlflow_hvd.driver.admission import Admission

log = logging.getLogger(__name__)

BACKLOG = 4096  # every rank connects at once (the kernel caps it at net.core.somaxconn)
STORE_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default for Gloo's process group
CONNECT_TIMEOUT = 10.0  # seconds the gate gives the loopback store to accept a connection
CHUNK = 1 << 16


def torch_available() -> bool:
    """Whether this driver can host a store (torch is installed here; not imported)."""
    return importlib.util.find_spec("torch") is not None


class TorchStore:
    """One job's store: the job's port is bound at construction; :meth:`serve` starts the
    ``TCPStore`` on loopback and the gate on the job's port (once, in a thread of its own:
    the first import of torch takes seconds); :meth:`close` ends both. Thread-safe.

    Args:
        host: Where the generation's servers listen (``network.listen_address``: "" is
            every interface, behind NAT).
        admission: The addresses whose connections are forwarded to the store.
        on_failure: Told, once, why the store could not start (the job then fails).
    """

    def __init__(self, host: str, admission: Admission,
                 on_failure: Callable[[str], None] = lambda _: None) -> None:
        self._lock = threading.Lock()
        listening = socket.create_server((host, 0), family=_family(host), backlog=BACKLOG)
        self.host = host
        self._admission = admission
        self._on_failure = on_failure
        self._gate: socket.socket | None = listening
        self.port: int = listening.getsockname()[1]
        self._store: Any = None
        self._store_port = 0
        self._links: set[socket.socket] = set()  # open connections, both sides
        self._serving = False
        self._closed = False
        self.refused = 0  # connections from addresses the job does not admit

    def serve(self) -> None:
        """Start serving (idempotent; returns at once)."""
        with self._lock:
            if self._serving or self._closed:
                return
            self._serving = True
        threading.Thread(target=self._start, name="mlflow-hvd-torch-store", daemon=True).start()

    def _open_store(self) -> tuple[Any, int]:
        """The ``TCPStore`` server on a loopback port of its own, and that port."""
        from torch.distributed import TCPStore

        inner = socket.create_server(("127.0.0.1", 0), backlog=BACKLOG)
        try:
            store = TCPStore("127.0.0.1", inner.getsockname()[1], None, True, STORE_TIMEOUT,
                             wait_for_workers=False, master_listen_fd=inner.fileno())
        except BaseException:
            inner.close()
            raise
        port = int(inner.getsockname()[1])
        inner.detach()  # the store owns the socket from now on (and closes it)
        return store, port

    def _start(self) -> None:
        try:
            store, port = self._open_store()
        except Exception as exc:  # the job fails at once rather than its ranks in 30 min
            log.error("mlflow_hvd: the torch.distributed store on %s:%d could not start "
                      "(%s: %s)", self.host, self.port, type(exc).__name__, exc)
            self.close()
            self._on_failure(f"the driver's torch.distributed store (port {self.port}) "
                             f"could not start: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            if self._closed:
                return
            self._store, self._store_port = store, port
            gate = self._gate
        log.info("torch.distributed store: serving on %s:%d", self.host, self.port)
        if gate is not None:
            threading.Thread(target=self._admit, args=(gate,), name="mlflow-hvd-store-gate",
                             daemon=True).start()

    def _admit(self, gate: socket.socket) -> None:
        """Accept connections on the job's port until it closes: forward the admitted ones,
        close the others unread."""
        while True:
            try:
                conn, address = gate.accept()
            except OSError:  # closed: the job is over
                return
            if address[0] not in self._admission:
                with self._lock:
                    self.refused += 1
                log.warning("torch.distributed store: refused a connection from %s, not a "
                            "host of this job", address[0])
                conn.close()
                continue
            try:
                inner = socket.create_connection(("127.0.0.1", self._store_port),
                                                 timeout=CONNECT_TIMEOUT)
            except OSError as exc:
                log.warning("torch.distributed store: cannot reach the store for %s: %s",
                            address[0], exc)
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    inner.close()
                    return
                self._links |= {conn, inner}
            for sock in (conn, inner):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for src, dst in ((conn, inner), (inner, conn)):
                threading.Thread(target=self._pump, args=(src, dst),
                                 name="mlflow-hvd-store-link", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Copy ``src`` to ``dst`` until either ends; then end both. No deadline of its
        own: a link lasts as long as the rank's connection to the store, and :meth:`close`
        (the job's end) shuts every link down."""
        try:
            while data := src.recv(CHUNK):
                dst.sendall(data)
        except OSError as exc:  # a side went away (a rank ended, or the job closed the link)
            log.debug("torch.distributed store: a link ended: %s", exc)
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                gone = {src, dst} & self._links
                self._links -= gone
            for sock in gone:
                sock.close()

    @property
    def serving(self) -> bool:
        with self._lock:
            return self._store is not None

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
            gate, self._gate = self._gate, None
            links, self._links = self._links, set()
        if gate is not None:
            with contextlib.suppress(OSError):
                gate.shutdown(socket.SHUT_RDWR)  # wakes the gate's accept
            gate.close()
        for sock in links:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        del store  # the server stops with its last reference


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET

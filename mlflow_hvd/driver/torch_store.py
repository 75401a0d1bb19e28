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

Security: torch's ``TCPStore`` has no authentication; anyone who can reach the driver's
address during the job can read and write its keys (Gloo's peer addresses). It listens
only on the job's own address (on every interface only where that address is not one of
this host's, as the job's channel does), only for the job's life, on a port chosen for it.
"""

from __future__ import annotations

import datetime
import importlib.util
import logging
import socket
import threading
from typing import Any

log = logging.getLogger(__name__)

BACKLOG = 4096  # every rank connects at once (the kernel caps it at net.core.somaxconn)
STORE_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default for Gloo's process group


def torch_available() -> bool:
    """Whether this driver can host a store (torch is installed here; not imported)."""
    return importlib.util.find_spec("torch") is not None


class TorchStore:
    """One job's store: its port is bound at construction; :meth:`serve` starts the
    ``TCPStore`` on it (once, in a thread of its own: the first import of torch takes
    seconds); :meth:`close` ends both. Thread-safe."""

    def __init__(self, host: str) -> None:
        self._lock = threading.Lock()
        # ``host``: where the generation's servers listen (network.listen_address: "" is
        # every interface, behind NAT)
        listening = socket.create_server((host, 0), family=_family(host), backlog=BACKLOG)
        self.host = host
        self._socket: socket.socket | None = listening
        self.port: int = listening.getsockname()[1]
        self._store: Any = None
        self._serving = False
        self._closed = False

    def serve(self) -> None:
        """Start serving (idempotent; returns at once)."""
        with self._lock:
            if self._serving or self._closed:
                return
            self._serving = True
        threading.Thread(target=self._start, name="mlflow-hvd-torch-store", daemon=True).start()

    def _start(self) -> None:
        try:
            from torch.distributed import TCPStore

            with self._lock:
                if self._closed or self._socket is None:
                    return
                # the store owns the listening socket from now on (and closes it)
                # the server's own client connects to it: loopback when on every interface
                self._store = TCPStore(self.host or "127.0.0.1", self.port, None, True,
                                       STORE_TIMEOUT,
                                       wait_for_workers=False,
                                       master_listen_fd=self._socket.fileno())
                self._socket.detach()
                self._socket = None
            log.info("torch.distributed store: serving on %s:%d", self.host, self.port)
        except Exception as exc:  # the ranks' init_process_group waits on its own deadline
            log.error("mlflow_hvd: the torch.distributed store on %s:%d could not start (%s: "
                      "%s); ranks calling init_process_group will time out", self.host,
                      self.port, type(exc).__name__, exc)
            self.close()

    @property
    def serving(self) -> bool:
        with self._lock:
            return self._store is not None

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
            listening, self._socket = self._socket, None
        del store  # the server stops with its last reference
        if listening is not None:
            listening.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET

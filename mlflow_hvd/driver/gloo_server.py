"""horovod's Gloo rendezvous server: what ``hvd.init()`` in a rank talks to. Only
:class:`~mlflow_hvd.driver.rendezvous.Rendezvous` starts it, and only where the driver has
Horovod; Horovod itself is imported when the first :class:`GlooServer` starts, not with
this module.

horovod's own server class and request handler (the key-value protocol its Gloo
``HTTPStore`` speaks), with three things changed for jobs of many ranks:

* it listens with a backlog for a whole job (socketserver's default of 5 drops connections
  that the kernel then retries with backoff; horovod's store gives up after 3 tries);
* a pool of threads serves the requests (socketserver starts a thread per request: half the
  driver's CPU went to creating and reaping them, 64 ranks sending 25,800 requests);
* requests for keys that are not there yet are held (below);
* Horovod elastic's workers are refused (:data:`ELASTIC_REFUSED`): ``hvd.elastic.run``
  publishes each worker's notification address in the scope ``worker_addresses`` as it
  starts, which only an elastic driver reads. In-memory elastic state cannot outlive a lost
  host here (a Spark barrier stage ends every task when one fails), so the job is ended at
  once with the way that works: ``JobConfig(min_np=...)`` and checkpoints in the run.

At ``hvd.init()`` every rank sends horovod's ``RendezvousServer`` about ``2.5 x size``
requests per scope, each on a new connection: it publishes its addresses, then asks for
every peer's, and a key that is not there yet is asked again every 10 ms until it is. Ranks
reach ``hvd.init()`` seconds apart (importing TensorFlow takes that long), so the early ones
would fill the server with thousands of "not yet" answers per second while they wait for
the late ones. Our handler (a subclass of horovod's, same protocol) holds such a request
until the key arrives or :data:`HOLD_SECONDS` pass: one request per awaited key instead of a
hundred per second.

The store has no authentication (horovod's C++ Gloo client cannot send any), and every rank
trusts the addresses it reads there. So the server listens where the job's channel does
(loopback for local ranks, the driver's address for Spark) and answers only the job's
hosts (:mod:`mlflow_hvd.driver.admission`, shared with the torch.distributed store):
loopback for a local job; for Spark, the addresses of the hosts in the layout the barrier
tasks report. Anyone else gets 403, is counted, and is named in the lifecycle log.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mlflow_hvd.driver.admission import Admission
from mlflow_hvd.driver.channel_server import LISTEN_BACKLOG
from mlflow_hvd.protocol.messages import RankSlot

log = logging.getLogger(__name__)

# How long a request for a key that is not there yet waits for it. Below the 3 s horovod's
# server allows for reading a request, far below Gloo's 30 s rendezvous timeout; the client
# (horovod's HTTPStore) simply sees a later answer.
HOLD_SECONDS = 1.0
ELASTIC_SCOPE = "worker_addresses"  # horovod.runner.elastic.rendezvous.PUT_WORKER_ADDRESSES
ELASTIC_REFUSED = (
    "Horovod elastic (hvd.elastic.run, hvd.elastic.TorchState/KerasState, state.commit()) "
    "does not run under HorovodRunner: a Spark barrier stage ends every task when one fails, "
    "so in-memory state cannot survive a lost host. Keep the training loop plain and use "
    "HorovodRunner(job=JobConfig(min_np=..., max_failures=...)) with checkpoints in the "
    "job's run (mlflow_hvd.keras.restore_from_checkpoint; for torch "
    "mlflow_hvd.tracking.checkpoints.save/latest): a job that loses a host goes on with fewer "
    "ranks from its latest checkpoint (docs/usage.md#elastic-jobs)")


@dataclass(frozen=True)
class RendezvousStats:
    """What the server did for one job (or one generation of warm ranks)."""

    requests: int
    not_found: int  # answered "not there yet" after holding
    bytes_sent: int  # values returned by GETs
    seconds: float  # from the first request's arrival to the last answer
    refused: int = 0  # connections from hosts that are not the job's (answered 403)


class _Keys:
    """Counts the server's requests and wakes held requests when a key is written."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = 0  # bumped on every write, under ``cond``
        self.requests = 0
        self.not_found = 0
        self.bytes_sent = 0
        self.refused = 0
        self.first = self.last = 0.0

    def arrived(self) -> None:
        """Count one request as it arrives."""
        with self.cond:
            self.requests += 1
            if self.requests == 1:
                self.first = time.monotonic()

    def answered(self) -> None:
        with self.cond:
            self.last = time.monotonic()

    def stats(self) -> RendezvousStats:
        with self.cond:
            return RendezvousStats(self.requests, self.not_found, self.bytes_sent,
                                   self.last - self.first, self.refused)


def _handler_for(keys: _Keys, on_elastic: Callable[[], None]) -> type[Any]:
    from mlflow_hvd.common.horovod_launcher import RendezvousHandler

    class Handler(RendezvousHandler):
        """horovod's handler, counting, with GETs of missing keys held and Horovod elastic
        refused (see module doc)."""

        def do_PUT(self) -> None:
            parts = self.path.split("/")
            if len(parts) != 3 or parts[1] != ELASTIC_SCOPE:
                super().do_PUT()
                return
            keys.arrived()
            on_elastic()  # the job ends before the rank raises
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            # the reason phrase is what the rank's error shows (urllib's HTTPError)
            self.send_response(409, ELASTIC_REFUSED)
            self.send_header("Content-Length", "0")
            self.end_headers()
            keys.answered()

        def _get_value(self, scope: str, key: str) -> Any:
            keys.arrived()
            deadline = time.monotonic() + HOLD_SECONDS
            while True:
                with keys.cond:
                    seen = keys.version
                value = super()._get_value(scope, key)
                remaining = deadline - time.monotonic()
                if value is not None or remaining <= 0:
                    break
                with keys.cond:
                    if keys.version == seen:
                        keys.cond.wait(remaining)
            with keys.cond:
                if value is None:
                    keys.not_found += 1
                else:
                    keys.bytes_sent += len(value)
            keys.answered()
            return value

        def _put_value(self, scope: str, key: str, value: Any) -> None:
            keys.arrived()
            super()._put_value(scope, key, value)
            with keys.cond:
                keys.version += 1
                keys.cond.notify_all()
            keys.answered()

        def do_DELETE(self) -> None:
            keys.arrived()
            super().do_DELETE()
            keys.answered()

    return Handler


FORBIDDEN = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@functools.cache
def _server_class() -> type[Any]:
    """horovod's server class, listening for a whole job and serving from a pool of
    threads (built at the first start: it imports Horovod)."""
    from mlflow_hvd.common.horovod_launcher import RendezvousHTTPServer

    class Server(RendezvousHTTPServer):
        """horovod's server, listening for a whole job and serving from a pool of threads,
        to the clients its :class:`~mlflow_hvd.driver.admission.Admission` admits."""

        request_queue_size = LISTEN_BACKLOG

        def __init__(self, handler: type[Any], threads: int, bind_host: str,
                     keys: _Keys, admission: Admission) -> None:
            # before binding: a failed bind closes the server, which shuts the pools down
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mlflow-hvd-rdv")
            # strangers are answered apart from the job's requests, never in the accept loop
            self._refusals = ThreadPoolExecutor(2, thread_name_prefix="mlflow-hvd-rdv-refuse")
            self._keys = keys
            self.admission = admission
            super().__init__((bind_host, 0), handler, 0)

        def process_request(self, request: Any, client_address: Any) -> None:
            if client_address[0] not in self.admission:
                with self._keys.cond:
                    self._keys.refused += 1
                log.warning("rendezvous: refused a request from %s, not a host of this job",
                            client_address[0])
                try:
                    self._refusals.submit(self._refuse, request)
                except RuntimeError:  # shutting down
                    self.shutdown_request(request)
                return
            try:
                self._pool.submit(self.process_request_thread, request, client_address)
            except RuntimeError:  # shutting down
                self.shutdown_request(request)

        def _refuse(self, request: Any) -> None:
            """Read the request's head (as a server does: closing unread data resets the
            connection before the client sees the answer), answer 403, close."""
            try:
                request.settimeout(1.0)
                request.recv(65536)
                request.sendall(FORBIDDEN)
                request.shutdown(socket.SHUT_WR)
                while request.recv(65536):  # the rest, until the client closes (or 1 s)
                    pass
            except OSError as exc:  # the stranger went away or stalled: nothing of the job's
                log.debug("rendezvous: a refused client's connection ended early: %s", exc)
            finally:
                self.shutdown_request(request)

        def handle_error(self, request: Any, client_address: Any) -> None:
            # a rank that was stopped mid-request (the job failed): not worth a traceback on
            # the user's console, as socketserver would print
            log.debug("rendezvous request from %s failed", client_address, exc_info=True)

        def server_close(self) -> None:
            super().server_close()
            # held requests end within HOLD_SECONDS, refusals within a second; nothing waits
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._refusals.shutdown(wait=False, cancel_futures=True)

    return Server


def _slot_infos(slots: tuple[RankSlot, ...]) -> list[Any]:
    """The layout as horovod's ``SlotInfo`` list (what its server's ``init`` takes)."""
    from mlflow_hvd.common.horovod_launcher import SlotInfo

    return [SlotInfo(**dataclasses.asdict(s)) for s in slots]


class GlooServer:
    """horovod's rendezvous server on a free port of ``bind_host``, serving from start.

    Args:
        size: The number of ranks. Each may hold one request while it waits for a key, so
            the server has a thread for each, and some for the requests that answer them.
        bind_host: The address it listens on.
        admission: Whom it answers (the generation's: loopback for a local job, the
            layout's hosts for a Spark job).
        on_elastic: Called when a rank starts Horovod elastic, before it is refused.

    Raises:
        UnsupportedVersionError: Horovod is missing here or of another version (from
            :mod:`mlflow_hvd.common.horovod_launcher`).
    """

    def __init__(self, size: int, bind_host: str, on_elastic: Callable[[], None],
                 admission: Admission) -> None:
        self._keys = _Keys()
        handler = _handler_for(self._keys, on_elastic)
        self._server = _server_class()(handler, size + 16, bind_host, self._keys, admission)
        self._server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.address = str(self._server.server_address[0])  # where it listens
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="mlflow-hvd-rendezvous", daemon=True)
        self._thread.start()

    def stats(self) -> RendezvousStats:
        return self._keys.stats()

    def init(self, slots: tuple[RankSlot, ...]) -> None:
        """A fresh round of ``hvd.init()`` for ranks laid out as ``slots``."""
        self._server.init(_slot_infos(slots))

    def stop(self) -> None:
        """Stop serving (within 50 ms) and close the socket."""
        self._server.shutdown()
        self._thread.join(timeout=10)
        self._server.server_close()

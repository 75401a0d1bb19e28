"""The job's rendezvous: the rank layout every Spark task computed, agreed, and horovod's
Gloo rendezvous server for ``hvd.init()`` where the driver has Horovod
(:mod:`mlflow_hvd.driver.gloo_server`). The first layout also says whom the job's servers
answer (:attr:`Rendezvous.admission`: the rendezvous and the torch.distributed store).

A job of torch.distributed code needs no Horovod anywhere: where the driver has none, no
server starts, the ranks are started without ``HOROVOD_GLOO_RENDEZVOUS_*``, and a rank that
imports ``horovod.torch`` or ``horovod.tensorflow`` is told why it cannot initialise
(:mod:`mlflow_hvd.rank.keras_guard`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from mlflow_hvd.common import compat
from mlflow_hvd.driver.admission import Admission
from mlflow_hvd.driver.gloo_server import ELASTIC_REFUSED, GlooServer, RendezvousStats
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.protocol.messages import LayoutReport, RankSlot

log = logging.getLogger(__name__)

NO_SERVER = RendezvousStats(0, 0, 0, 0.0)


@dataclass(frozen=True)
class ElasticRefused:
    """A rank of the job started Horovod elastic (:data:`ELASTIC_REFUSED`)."""

    def error(self) -> ConfigurationError:
        return ConfigurationError(ELASTIC_REFUSED)


@dataclass(frozen=True)
class LayoutMismatch:
    """Two Spark tasks computed different rank layouts: ranks would never find each other."""

    partition: int
    detail: str


class Rendezvous:
    """Agrees the job's layout and serves horovod's rendezvous for it, initialised exactly
    once from the first layout.

    Every task reports the layout it computed from the barrier's task addresses; all must agree
    with the first one, or the job cannot rendezvous.

    Args:
        size: The number of ranks.
        bind_host: The address the server listens on: the channel's (loopback for local
            ranks; ``""``, every interface, behind NAT: :func:`~mlflow_hvd.common.network
            .listen_address`).
        on_elastic: Called when a rank starts Horovod elastic, before it is refused.
        horovod: Whether to start horovod's server (None: where Horovod is installed here).
            Without it :attr:`port` is 0.

    Raises:
        UnsupportedVersionError: ``horovod`` and Horovod here is missing or of another
            version.
    """

    def __init__(self, size: int, bind_host: str = "127.0.0.1",
                 on_elastic: Callable[[], None] = lambda: None,
                 horovod: bool | None = None) -> None:
        if horovod is None:
            horovod = compat.HOROVOD.installed() is not None
        self.admission = Admission(bind_host)
        self._server = GlooServer(size, bind_host, on_elastic, self.admission) \
            if horovod else None
        if self._server is None:
            log.info("no Horovod on the driver: no Gloo rendezvous server for hvd.init() "
                     "(torch.distributed needs none)")
        self.port = self._server.port if self._server is not None else 0
        self.address = self._server.address if self._server is not None else ""
        self._lock = threading.Lock()
        self.slots: tuple[RankSlot, ...] | None = None

    def stats(self) -> RendezvousStats:
        return self._server.stats() if self._server is not None else NO_SERVER

    def on_layout(self, report: LayoutReport) -> LayoutMismatch | None:
        """Initialise the server from the first report; a later report that differs is
        returned as a :class:`LayoutMismatch` (the caller fails the job)."""
        with self._lock:
            if self.slots is None:
                self.slots = report.slots
                self.admission.admit_hosts({s.hostname for s in report.slots})
                if self._server is not None:
                    self._server.init(report.slots)
                return None
            if report.slots == self.slots:
                return None
        hosts = sorted({s.hostname for s in report.slots} | {s.hostname for s in self.slots})
        return LayoutMismatch(
            report.partition,
            f"task {report.partition} computed a different rank layout than the first task "
            f"(hosts seen: {', '.join(hosts)}); do the executors' hostnames resolve "
            "consistently?",
        )

    def reset(self) -> None:
        """A fresh round for the next ``hvd.init()`` of the same ranks (warm ranks)."""
        with self._lock:
            if self.slots is not None and self._server is not None:
                self._server.init(self.slots)

    def stop(self) -> None:
        """Stop serving (within 50 ms) and close the socket."""
        if self._server is not None:
            self._server.stop()

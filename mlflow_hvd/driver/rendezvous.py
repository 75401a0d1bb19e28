"""horovod's Gloo rendezvous server, initialised once from the first layout report."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from horovod.runner.http.http_server import RendezvousHTTPServer, RendezvousServer

from mlflow_hvd.common.layout import to_slot_infos
from mlflow_hvd.driver.channel_server import LISTEN_BACKLOG
from mlflow_hvd.protocol.messages import LayoutReport, RankSlot

# Every rank calls horovod's rendezvous server at hvd.init(), all at once: its HTTP server
# keeps socketserver's backlog of 5 unless configured (see channel_server.LISTEN_BACKLOG).
RendezvousHTTPServer.request_queue_size = LISTEN_BACKLOG


@dataclass(frozen=True)
class LayoutMismatch:
    """Two Spark tasks computed different rank layouts: ranks would never find each other."""

    partition: int
    detail: str


class Rendezvous:
    """Starts horovod's ``RendezvousServer`` on a free port and initialises it exactly once.

    Every task reports the layout it computed from the barrier's task addresses; all must agree
    with the first one, or the job cannot rendezvous.
    """

    def __init__(self) -> None:
        self.server = RendezvousServer()
        self.port = int(self.server.start())
        self._lock = threading.Lock()
        self.slots: tuple[RankSlot, ...] | None = None

    def on_layout(self, report: LayoutReport) -> LayoutMismatch | None:
        """Initialise the server from the first report; a later report that differs is
        returned as a :class:`LayoutMismatch` (the caller fails the job)."""
        with self._lock:
            if self.slots is None:
                self.slots = report.slots
                self.server.init(to_slot_infos(report.slots))
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

    def stop(self) -> None:
        self.server.stop()

"""Driver side of rank 0's tracking writes (:mod:`mlflow_hvd.rank.tracking.sender`): the
driver, which owns the run, makes the MLflow calls for the records rank 0 sends it.

Each :class:`~mlflow_hvd.protocol.messages.TrackingWrite` is answered with a
:class:`~mlflow_hvd.protocol.messages.TrackingWritten`: stored, a refusal, or an outage (rank 0 then
keeps the records, spilling to disk, and sends them again with backoff; see
:mod:`mlflow_hvd.rank.tracking.delivery`). MLflow's HTTP client retries for minutes by
default, and the driver's environment is the user's, so the driver does not wait for it to
give up: it answers "outage" as soon as the server stops accepting connections (a TCP probe
before each call and every ``PROBE_EVERY`` seconds during it), or when a call takes
``timeout`` seconds.
Such a call is left to finish in the background, and until it has, later writes are
answered "outage" at once: at most one call per job is in flight, so records reach the
store in the order rank 0 sent them (a batch sent again is deduplicated by MLflow). Hence
a server that dies *during* a call is noticed at once but written to again only when
MLflow's own retries of that call end (its backoff: up to minutes); records wait on rank 0
meanwhile, and what the job's end finds undelivered is saved for replay.

Only the job's own run is written: records for any other run id are refused.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from mlflow_hvd.common.deadline import Deadline, Running
from mlflow_hvd.common.tracking_server import check_server_reachable, is_outage
from mlflow_hvd.errors import TrackingError
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.messages import TrackingTarget, TrackingWrite, TrackingWritten

log = logging.getLogger(__name__)

WRITE_TIMEOUT = 20.0  # seconds one MLflow call may take before rank 0 hears "outage"
PROBE_TIMEOUT = 5.0  # seconds to connect to an HTTP tracking server
PROBE_EVERY = 1.0  # seconds between probes while a call runs


class Relay:
    """Writes one job's records from rank 0 into the job's run (see the module docstring)."""

    def __init__(self, target: TrackingTarget, timeout: float = WRITE_TIMEOUT) -> None:
        self.target = target
        self.timeout = timeout
        self._lock = threading.Lock()
        self._client: Any = None
        self._running: Running[None] | None = None  # a write given up on at its deadline
        self._outage = False  # the last answer was "outage" (for the lifecycle log)

    def answer(self, request: TrackingWrite) -> TrackingWritten:
        """Write ``request``'s records; never raises (the answer carries the error)."""
        written = self._answer(request)
        if written.outage and not self._outage:
            self._outage = True
            log.info("run %s: the driver sees a tracking outage: %s", self.target.run_id,
                     written.error)
        elif not written.error and self._outage:
            self._outage = False
            log.info("run %s: the tracking server takes the driver's writes again",
                     self.target.run_id)
        return written

    def _answer(self, request: TrackingWrite) -> TrackingWritten:
        uri, run_id = self.target.tracking_uri, self.target.run_id
        if request.run_id != run_id:
            return TrackingWritten(
                f"the driver writes only this job's run {run_id}; it refused records for run "
                f"{request.run_id}"
            )
        with self._lock:
            if self._running is not None and not self._running.done:
                return TrackingWritten(
                    f"the tracking server at {uri} has not yet answered the driver's previous "
                    "write", outage=True)
            self._running = None
            problem = self._unreachable()
            if problem:
                return TrackingWritten(problem, outage=True)
            return self._write(request.records)

    def _write(self, records: tuple[rec.Record, ...]) -> TrackingWritten:
        uri = self.target.tracking_uri
        call = Running("relay-write", rec.send, self._mlflow(), self.target.run_id, records)
        deadline = Deadline.after(self.timeout)
        while not call.wait(deadline.slice(PROBE_EVERY)):
            problem = self._unreachable() or (
                f"the tracking server at {uri} did not answer the driver within "
                f"{self.timeout:g}s" if deadline.passed() else "")
            if problem:
                self._running = call  # given up on: the next write waits for it to end
                return TrackingWritten(problem, outage=True)
        error = call.error
        if error is None:
            return TrackingWritten()
        return TrackingWritten(str(error) or type(error).__name__, outage=is_outage(error))

    def _unreachable(self) -> str:
        """Why an HTTP tracking server cannot be reached now, or ""."""
        try:
            check_server_reachable(self.target.tracking_uri, "the driver", PROBE_TIMEOUT)
        except TrackingError as exc:
            return (f"the driver cannot connect to the tracking server at "
                    f"{self.target.tracking_uri}: {exc.__cause__ or exc}")
        return ""

    def _mlflow(self) -> Any:
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.target.tracking_uri)
        return self._client

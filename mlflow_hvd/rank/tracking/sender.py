"""Rank side: how rank 0's delivery thread (:mod:`.delivery`) sends one batch of records.

Metric, param and tag batches and checkpoint commits go to the driver, as a
:class:`~mlflow_hvd.protocol.messages.TrackingWrite` on a channel connection of their own; the
driver, which owns the run, makes the MLflow call
(:mod:`mlflow_hvd.driver.tracking.relay`) and answers once the store
took them. For each batch rank 0 then spends a pickle and a socket round trip instead of
running MLflow's client (SQLAlchemy, or protobuf, JSON and HTTP) on the training process's
CPU and under its GIL, a measurable share of a small model's step when logging every step
(``benchmarks/logging_overhead.py``). Artifact files go from rank 0 straight to the
artifact store (their bytes need not travel through the driver). Records stay in order: the
delivery thread sends one batch at a time, whichever way it goes.

Once a batch holding a checkpoint's commit is written, rank 0 tells the driver on the same
connection (:class:`~mlflow_hvd.protocol.messages.CheckpointCommitted`): the driver loop
learns that the job can resume from that epoch in order with every other event of the job
(an elastic job grows back there), and before rank 0's return value, which is sent only
after every record is delivered.

The driver's answer becomes an exception that
:func:`~mlflow_hvd.common.tracking_server.is_outage` classifies: ``ConnectionError`` for an
outage (retried with backoff), :class:`TrackingError` for a refusal.

MLflow is never imported first by the delivery thread: its package imports itself in cycles
that break when two threads import it at once (``ImportError: cannot import name ...``, seen
when the training code imported ``mlflow.models`` while a checkpoint was being uploaded).
:meth:`client` is created on the training thread before an artifact is queued.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from mlflow_hvd.errors import ChannelError, TrackingError
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.channel import ChannelClient
from mlflow_hvd.protocol.messages import (
    CheckpointCommitted,
    TrackingTarget,
    TrackingWrite,
    TrackingWritten,
    Unanswered,
)
from mlflow_hvd.protocol.records import Record

RELAYED = (rec.Metric, rec.Param, rec.Tag, rec.Commit)  # written by the driver
# The driver answers a write within its own deadline (relay.WRITE_TIMEOUT plus a probe);
# a silence longer than this is treated as an outage and the batch sent again later.
ANSWER_TIMEOUT = 60.0


class Sender:
    """Sends batches for one job's rank 0: through the driver when ``connect`` (which opens
    a new connection to it) is given, else straight to MLflow.

    Called only from the delivery thread (one batch at a time); :attr:`client` may also be
    used by the training thread.
    """

    def __init__(self, target: TrackingTarget,
                 connect: Callable[[], ChannelClient] | None) -> None:
        self.target = target
        self.relayed = connect is not None  # False outside a worker (no driver to write)
        self._connect = connect
        self._channel: ChannelClient | None = None
        self._client: Any = None
        self._artifacts: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        """An ``MlflowClient`` for the run's store, created on first use: a rank 0 that only
        logs metrics, params and tags never imports MLflow."""
        with self._lock:
            if self._client is None:
                from mlflow import MlflowClient

                self._client = MlflowClient(tracking_uri=self.target.tracking_uri)
            return self._client

    @property
    def artifacts(self) -> Any:
        """The run's artifact repository, made from its artifact URI (not through
        ``MlflowClient``, whose per-run cache in this process holds the job's own repository,
        which queues files here: :mod:`.artifacts`)."""
        client = self.client
        with self._lock:
            if self._artifacts is None:
                from mlflow.store.artifact.artifact_repository_registry import (
                    get_artifact_repository,
                )

                root = (self.target.artifact_uri
                        or client.get_run(self.target.run_id).info.artifact_uri)
                self._artifacts = get_artifact_repository(
                    root, tracking_uri=self.target.tracking_uri)
            return self._artifacts

    def __call__(self, batch: Sequence[Record]) -> None:
        if self.relayed and isinstance(batch[0], RELAYED):
            self._relay(batch)
        else:
            rec.send(self.client, self.target.run_id, batch,
                     self.artifacts if isinstance(batch[0], rec.Artifact) else None)

    def _relay(self, batch: Sequence[Record]) -> None:
        request = TrackingWrite(self.target.run_id, tuple(batch))
        try:
            if self._channel is None and self._connect is not None:
                self._channel = self._connect()
            assert self._channel is not None  # relayed implies connect
            answer = self._channel.request(request, ANSWER_TIMEOUT)
        except ChannelError as exc:
            self.close()  # reconnect on the next try
            raise ConnectionError(
                f"cannot reach the driver, which writes rank 0's records to "
                f"{self.target.tracking_uri}: {exc}"
            ) from exc
        if not isinstance(answer, TrackingWritten):
            said = type(answer).__name__
            if isinstance(answer, Unanswered):
                said += f": {answer.reason}"
            raise TrackingError(
                f"the driver did not take rank 0's records for run {self.target.run_id} "
                f"(it answered {said}): is the driver running another version of mlflow_hvd?"
            )
        if answer.error and answer.outage:
            raise ConnectionError(answer.error)
        if answer.error:
            raise TrackingError(answer.error)
        self._tell_commits(batch)

    def _tell_commits(self, batch: Sequence[Record]) -> None:
        """Tell the driver of each checkpoint the written ``batch`` committed. The records
        are written: a lost connection here costs the driver only the news (an elastic job
        then grows back at a later checkpoint), never a write made twice."""
        for record in batch:
            if not isinstance(record, rec.Commit) or record.epoch is None:
                continue
            try:
                assert self._channel is not None  # the batch went through it
                self._channel.send(CheckpointCommitted(0, record.epoch, record.last))
            except ChannelError as exc:
                self.close()
                sys.stderr.write(f"mlflow_hvd: the driver was not told of epoch "
                                 f"{record.epoch}'s checkpoint ({exc})\n")

    def close(self) -> None:
        """Close the connection to the driver (the next relayed batch opens a new one)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()  # never raises (a socket already closed is fine)

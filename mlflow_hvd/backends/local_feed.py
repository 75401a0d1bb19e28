"""Driver side, ``np < 0``: the job's DataFrames written to the driver's disk, one
directory per local rank, from the DataFrame's ``np`` partitions streamed to the driver one
partition at a time (``toLocalIterator``: the driver holds one partition's Arrow chunks at
a time, not the whole DataFrame)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

from mlflow_hvd.agent.feed import agree, feed_partition, manifest
from mlflow_hvd.common import scratch
from mlflow_hvd.common.phases import Progress
from mlflow_hvd.protocol.feed import FeedSpec
from mlflow_hvd.protocol.messages import FeedAgreed

CHUNK_SCHEMA = "partition int, chunk binary"


def _encode(batches: Iterator[Any]) -> Iterator[Any]:
    """Executor side: each record batch of a partition as one row of Arrow IPC bytes."""
    import pyarrow as pa
    from pyspark import TaskContext

    context = TaskContext.get()
    partition = context.partitionId() if context is not None else 0
    for batch in batches:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        yield pa.RecordBatch.from_pydict(
            {"partition": pa.array([partition], pa.int32()),
             "chunk": pa.array([sink.getvalue().to_pybytes()], pa.binary())})


def _decoded(rows: Iterator[Any]) -> Iterator[Any]:
    import pyarrow as pa

    for row in rows:
        yield from pa.ipc.open_stream(bytes(row["chunk"]))


def _ticking(rows: Iterator[Any], progress: Progress) -> Iterator[Any]:
    for row in rows:
        progress.tick()
        yield row


def feed_locally(spec: FeedSpec, frame: Any, np: int, owned: contextlib.ExitStack,
                 progress: Progress | None = None) -> tuple[list[str], FeedAgreed]:
    """Write ``frame``'s ``np`` partitions to ``np`` new scratch directories (removed when
    ``owned`` closes); returns each rank's manifest path, in rank order, and the split.
    ``progress`` is ticked at every chunk read.

    Raises:
        DataInputError: As :func:`mlflow_hvd.agent.feed.agree` (nulls, lengths, no rows).
        FeedError: The driver's disk is full.
    """
    directories = [owned.enter_context(scratch.owned_dir("feed")) for _ in range(np)]
    reports = {}
    rows = frame.mapInArrow(_encode, CHUNK_SCHEMA).toLocalIterator()
    if progress is not None:
        rows = _ticking(rows, progress)
    for partition, group in itertools.groupby(rows, key=lambda row: row["partition"]):
        reports[partition] = feed_partition(spec, partition, _decoded(group),
                                            directories[partition])
    every = [reports.get(p) or feed_partition(spec, p, iter(()), directories[p])
             for p in range(np)]
    return ([manifest(spec, directories[p], every, p) for p in range(np)],
            FeedAgreed(agree(spec, every)))

"""Executor side: a barrier task's part in feeding the job's DataFrames — its partition
written to the executor's local directory, the tasks' exchange of counts, the manifest its
rank reads, and the directory's removal however the task ends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from mlflow_hvd.agent.feed import TaskFeed, agree, feed_partition, manifest
from mlflow_hvd.common import scratch
from mlflow_hvd.errors import DataInputError, FeedError
from mlflow_hvd.protocol.feed import FeedSpec, Written
from mlflow_hvd.protocol.messages import FeedAgreed, FeedFailed, FeedProgress

log = logging.getLogger(__name__)

PROGRESS_EVERY = 5.0  # seconds between a feeding task's progress reports


def local_dir() -> str:
    """The executor's local directory for this task (``SPARK_LOCAL_DIRS``' first, which
    Spark gives its Python workers), else the temporary directory."""
    dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d]
    return dirs[0] if dirs else tempfile.gettempdir()


def _reported(batches: Iterable[Any], partition: int,
              send: Callable[[object], None]) -> Iterator[Any]:
    """``batches``, with a :class:`FeedProgress` at the start and every few seconds."""
    rows = size = 0
    send(FeedProgress(partition, 0, 0))
    last = time.monotonic()
    for batch in batches:
        rows, size = rows + batch.num_rows, size + batch.nbytes
        if time.monotonic() - last > PROGRESS_EVERY:
            send(FeedProgress(partition, rows, size))
            last = time.monotonic()
        yield batch
    send(FeedProgress(partition, rows, size, done=True))


def _encode(report: TaskFeed) -> str:
    return json.dumps(dataclasses.asdict(report))


def _decode(text: str) -> TaskFeed:
    item = json.loads(text)
    written = tuple(
        Written(w["argument"], w["rows"], tuple((n, int(x)) for n, x in w["widths"]),
                w["bytes"])
        for w in item.pop("written")
    )
    return TaskFeed(written=written, **item)


@contextmanager
def fed_shards(spec: FeedSpec | None, ctx: Any, batches: Iterable[Any],
               send: Callable[[object], None]) -> Iterator[str | None]:
    """Feed this task's partition; yields the path of its rank's manifest ("" for a job
    without data), or None when the feed failed (task 0 has told the driver why; no task
    starts a rank). The files are removed when the block ends, on every path."""
    if spec is None:
        for _ in batches:  # the one row of spark.range(np)'s partition
            pass
        yield ""
        return
    partition = ctx.partitionId()
    with scratch.owned_dir("feed", local_dir()) as directory:
        mine = feed_partition(spec, partition, _reported(batches, partition, send), directory)
        for _ in batches:  # what a failed write left unread: Spark's input thread must end
            pass
        reports = [_decode(text) for text in ctx.allGather(_encode(mine))]
        try:
            path: str | None = manifest(spec, directory, reports, partition)
            if partition == 0:
                send(FeedAgreed(agree(spec, reports)))
        except (DataInputError, FeedError) as exc:
            if partition == 0:
                send(FeedFailed(str(exc), type(exc).__name__))
            log.info("task %d starts no rank: %s", partition, exc)
            path = None
        yield path

"""Executor side: a barrier task's part in feeding the job's DataFrames — its partition
written to the executor's local directory, the tasks' exchange of counts, the manifest its
rank reads (the rank starts meanwhile and waits for it), and the directory's removal however
the task ends.
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
from mlflow_hvd.protocol.feed import (
    FEED_FAILED_FILE,
    MANIFEST_FILE,
    FeedFault,
    FeedSpec,
    Written,
)
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
    fault = item.pop("fault")
    return TaskFeed(written=written, fault=FeedFault(fault) if fault else None, **item)


class TaskFeeding:
    """One barrier task's feed of its partition, run by :meth:`run` while its rank may
    already be starting: the rank is given :attr:`manifest` (not there yet) and waits for
    it, or for the failure file beside it (:mod:`mlflow_hvd.rank.shard`)."""

    def __init__(self, spec: FeedSpec | None, ctx: Any, batches: Iterable[Any],
                 send: Callable[[object], None], directory: str) -> None:
        self.spec, self.ctx, self.batches, self.send = spec, ctx, batches, send
        self.directory = directory
        self.manifest = os.path.join(directory, MANIFEST_FILE) if spec is not None else ""

    def run(self) -> bool:
        """Write this task's partition, agree on the counts with the other tasks and write
        the manifest; False when the feed failed (every task has told the driver why, then
        written the failure file its rank waits for)."""
        if self.spec is None:
            for _ in self.batches:  # the one row of spark.range(np)'s partition
                pass
            return True
        partition = self.ctx.partitionId()
        mine = feed_partition(self.spec, partition,
                              _reported(self.batches, partition, self.send), self.directory)
        for _ in self.batches:  # what a failed write left unread: Spark's input thread must end
            pass
        reports = [_decode(text) for text in self.ctx.allGather(_encode(mine))]
        try:
            manifest(self.spec, self.directory, reports, partition)
            if partition == 0:
                self.send(FeedAgreed(agree(self.spec, reports)))
            return True
        except (DataInputError, FeedError) as exc:
            # every task says so before its rank can exit: the driver ends the job with
            # this error, not with a rank's exit
            self.send(FeedFailed(str(exc), FeedFault.of(exc)))
            log.info("task %d: the feed failed: %s", partition, exc)
            with open(os.path.join(self.directory, FEED_FAILED_FILE), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
            return False


@contextmanager
def task_feeding(spec: FeedSpec | None, ctx: Any, batches: Iterable[Any],
                 send: Callable[[object], None]) -> Iterator[TaskFeeding]:
    """The task's :class:`TaskFeeding`; its files are removed when the block ends, on every
    path (the block outlives the task's rank)."""
    if spec is None:
        yield TaskFeeding(None, ctx, batches, send, "")
        return
    with scratch.owned_dir("feed", local_dir()) as directory:
        yield TaskFeeding(spec, ctx, batches, send, directory)

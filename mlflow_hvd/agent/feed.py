"""Where a rank is hosted: its partition of the fed DataFrame, written to a local Arrow IPC
file per argument, and the agreement of all tasks on how many rows every rank uses.

A task writes the Arrow record batches it receives as they come (array columns become
fixed-size lists; a null in any column, or arrays of different lengths, is refused naming
the column). The tasks then exchange what they wrote (:func:`agree`): every rank keeps
exactly the smallest count, so every rank runs the same number of steps; the rest are
dropped and counted.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mlflow_hvd.errors import DataInputError, FeedError
from mlflow_hvd.protocol.feed import (
    MANIFEST_FILE,
    TAG_COLUMN,
    Agreed,
    ColumnKind,
    FeedFault,
    FeedSpec,
    FrameSpec,
    ShardFile,
    Written,
    dump_manifest,
)


def _fixed(argument: str, name: str, array: Any, width: int | None) -> tuple[Any, int]:
    """A list column as a fixed-size list of ``width`` (the first batch's when None)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    lengths = pc.list_value_length(array)
    low, high = pc.min(lengths).as_py(), pc.max(lengths).as_py()
    if width is None:
        width = low
    if low != width or high != width:
        raise DataInputError(
            f"column {name!r} of the DataFrame passed as {argument}= holds arrays of "
            f"different lengths ({width} and {high if high != width else low}); every row "
            "must have the same length: pad or truncate them in Spark before run()")
    values = array.flatten()
    if values.null_count:
        raise DataInputError(f"column {name!r} of the DataFrame passed as {argument}= has "
                             "null elements in its arrays: fill or drop them before run()")
    return pa.FixedSizeListArray.from_arrays(values, width), width


class _FrameFile:
    """The IPC file of one argument on this host."""

    def __init__(self, frame: FrameSpec, path: str, compression: str | None) -> None:
        self.frame, self.path, self.compression = frame, path, compression
        self.rows = 0
        self.widths: dict[str, int] = {}
        self._writer: Any = None

    def write(self, batch: Any) -> None:
        import pyarrow as pa

        arrays, names = [], []
        for column in self.frame.columns:
            array = batch.column(column.field)
            if array.null_count:
                raise DataInputError(
                    f"column {column.name!r} of the DataFrame passed as "
                    f"{self.frame.argument}= has null values: fill them (fillna) or drop "
                    "those rows (dropna) before run()")
            if column.kind is ColumnKind.ARRAY:
                array, self.widths[column.name] = _fixed(
                    self.frame.argument, column.name, array, self.widths.get(column.name))
            arrays.append(array)
            names.append(column.name)
        out = pa.RecordBatch.from_arrays(arrays, names=names)
        if self._writer is None:
            options = pa.ipc.IpcWriteOptions(compression=self.compression)
            self._writer = pa.ipc.new_file(self.path, out.schema, options=options)
        self._writer.write_batch(out)
        self.rows += out.num_rows

    def close(self) -> Written:
        if self._writer is not None:
            self._writer.close()
        size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        return Written(self.frame.argument, self.rows, tuple(sorted(self.widths.items())),
                       size)


def write_partition(spec: FeedSpec, batches: Iterable[Any], directory: str) -> list[Written]:
    """Write one partition's record batches to ``directory``, a file per argument.

    Raises:
        DataInputError: Null values, or arrays of different lengths, naming the column.
        FeedError: The disk is full or cannot be written (naming the directory and bytes).
    """
    import pyarrow.compute as pc

    files = [_FrameFile(f, os.path.join(directory, f"{f.argument}.arrow"), spec.compression)
             for f in spec.frames]
    batch: Any = None
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if not spec.tagged:
                files[0].write(batch)
                continue
            tags = batch.column(TAG_COLUMN)
            for file in files:
                part = batch.filter(pc.equal(tags, file.frame.tag))
                if part.num_rows:
                    file.write(part)
        return [file.close() for file in files]
    except OSError as exc:
        raise _disk_error(exc, directory, files, batch) from exc


def _disk_error(exc: OSError, directory: str, files: Sequence[_FrameFile],
                batch: Any) -> FeedError:
    written = sum(os.path.getsize(f.path) for f in files if os.path.exists(f.path))
    free = shutil.disk_usage(directory).free if os.path.isdir(directory) else 0
    pending = int(batch.nbytes) if batch is not None else 0
    what = "the disk is full" if exc.errno == errno.ENOSPC else f"{exc.strerror or exc}"
    return FeedError(
        f"writing this task's rows to {directory} failed: {what}: it had written "
        f"{written:,} bytes and needed at least {pending:,} more, with {free:,} bytes free "
        "there; free space on that disk or point SPARK_LOCAL_DIRS (the executors' local "
        "directories) at a bigger one")


@dataclass(frozen=True)
class TaskFeed:
    """What one task wrote, or why it could not (what the tasks exchange)."""

    partition: int
    written: tuple[Written, ...] = ()
    error: str = ""
    fault: FeedFault | None = None  # with an error: the data's or the host's


def agree(spec: FeedSpec, reports: Sequence[TaskFeed]) -> tuple[Agreed, ...]:
    """Each argument's split, in the spec's order: rows every rank keeps (the minimum),
    every task's count and the array widths, from every task's report (in partition order).
    The same on every task.

    Raises:
        DataInputError: A task's data error, arrays of different lengths on different
            tasks, or an argument with no rows on some rank.
        FeedError: A task could not write its rows.
    """
    failed = [r for r in reports if r.error]
    if failed:
        first = failed[0]
        raise (first.fault or FeedFault.DATA).error(f"task {first.partition}: {first.error}")
    agreed = []
    for index, frame in enumerate(spec.frames):
        counts = tuple(r.written[index].rows for r in reports)
        widths: dict[str, int] = {}
        for report in reports:
            for name, width in report.written[index].widths:
                if widths.setdefault(name, width) != width:
                    raise DataInputError(
                        f"column {name!r} of the DataFrame passed as {frame.argument}= holds "
                        f"arrays of {widths[name]} and of {width} elements on different "
                        "ranks; every row must have the same length")
        if min(counts) == 0:
            empty = [i for i, n in enumerate(counts) if n == 0]
            raise DataInputError(
                f"the DataFrame passed as {frame.argument}= has {sum(counts)} rows, and "
                f"rank(s) {', '.join(map(str, empty))} of {len(counts)} got none (rows per "
                f"rank: {list(counts)}); every rank needs rows: pass more data or lower np")
        agreed.append(Agreed(frame.argument, min(counts), counts,
                             tuple(sorted(widths.items()))))
    return tuple(agreed)


def manifest(spec: FeedSpec, directory: str, reports: Sequence[TaskFeed],
             partition: int) -> str:
    """Agree on the counts and write the manifest of ``partition``'s rank; returns its path.

    Raises:
        DataInputError, FeedError: As :func:`agree`.
    """
    shards = [
        ShardFile(split.argument, split.rows, split.partition_rows, split.widths,
                  path=os.path.join(directory, f"{frame.argument}.arrow"),
                  written=written.rows, columns=frame.columns)
        for frame, split, written in zip(spec.frames, agree(spec, reports),
                                         reports[partition].written, strict=True)
    ]
    path = os.path.join(directory, MANIFEST_FILE)
    with open(path + ".tmp", "w") as f:  # whole or absent: a rank may be waiting for it
        f.write(dump_manifest(shards))
    os.replace(path + ".tmp", path)
    return path


def feed_partition(spec: FeedSpec, partition: int, batches: Iterable[Any],
                   directory: str) -> TaskFeed:
    """Write this partition (:func:`write_partition`) and describe it, errors included:
    a task always takes part in the exchange, so no task waits for one that gave up."""
    try:
        return TaskFeed(partition, tuple(write_partition(spec, batches, directory)))
    except (DataInputError, FeedError) as exc:
        return TaskFeed(partition, error=str(exc), fault=FeedFault.of(exc))

"""Training data from Spark DataFrames, as it crosses process boundaries: what the driver
asks each barrier task to write (:class:`FeedSpec`), the placeholder a DataFrame argument
becomes in the pickled kwargs (:class:`ShardArg`), what a task wrote (:class:`Written`) and
what a rank is given to read (:class:`ShardFile`, in the manifest file its agent writes).
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass

from mlflow_hvd.errors import DataInputError, FeedError

TAG_COLUMN = "__mlflow_hvd_argument"  # which argument a row of a fed DataFrame belongs to
MANIFEST_FILE = "shards.json"
FEED_FAILED_FILE = "shards.failed"  # beside the manifest, when the feed failed instead


class FeedFault(str, enum.Enum):
    """Why a job's DataFrames cannot be fed, as it crosses processes (a task's report, its
    message to the driver): the data (:class:`DataInputError`, the user's to fix) or a host
    (:class:`FeedError`: a full disk)."""

    DATA = "data"
    HOST = "host"

    @classmethod
    def of(cls, exc: DataInputError | FeedError) -> FeedFault:
        return cls.HOST if isinstance(exc, FeedError) else cls.DATA

    def error(self, text: str) -> DataInputError | FeedError:
        """The error this fault raises on the side that receives it."""
        return FeedError(text) if self is FeedFault.HOST else DataInputError(text)


class ColumnKind(enum.Enum):
    """How a column reaches a rank: a numeric scalar per row, a fixed-length numeric
    array per row (Spark arrays and ML vectors), or bytes / text per row."""

    SCALAR = "scalar"
    ARRAY = "array"
    BINARY = "binary"
    STRING = "string"


@dataclass(frozen=True)
class Column:
    """One column of a fed DataFrame.

    Attributes:
        name: The column's name in the user's DataFrame (and in the rank's batches).
        kind: How it is encoded.
        dtype: numpy dtype of a scalar or of an array's elements ("" for bytes / text).
        field: The column's name in the fed (tagged, unioned) DataFrame.
    """

    name: str
    kind: ColumnKind
    dtype: str
    field: str


@dataclass(frozen=True)
class FrameSpec:
    """One DataFrame argument of a job: its keyword, its tag value and its columns."""

    argument: str
    tag: int
    columns: tuple[Column, ...]


@dataclass(frozen=True)
class FeedSpec:
    """What every barrier task writes from its partition of the fed DataFrame.

    Attributes:
        frames: One entry per DataFrame argument, in keyword order.
        compression: Arrow IPC body compression ("lz4", "zstd") or None (a rank then
            memory-maps its file without copying).
    """

    frames: tuple[FrameSpec, ...]
    compression: str | None = None

    @property
    def tagged(self) -> bool:
        """Several arguments share the stage: rows carry :data:`TAG_COLUMN`."""
        return len(self.frames) > 1


@dataclass(frozen=True)
class ShardArg:
    """What a DataFrame keyword argument is in the pickled kwargs; each rank replaces it
    with its :class:`~mlflow_hvd.data.Shard` of that argument."""

    argument: str


@dataclass(frozen=True)
class Written:
    """What one task wrote of one argument (exchanged between the tasks)."""

    argument: str
    rows: int
    widths: tuple[tuple[str, int], ...]  # array column -> elements per row (0: no rows)
    bytes: int


@dataclass(frozen=True)
class Agreed:
    """How one argument was split, as every task agreed (and the driver is told).

    Attributes:
        argument: The keyword argument.
        rows: Rows every rank uses: the first ``rows`` of its file (the minimum over ranks).
        partition_rows: Rows every task wrote, in partition (task) order.
        widths: Elements per row of each array column.
    """

    argument: str
    rows: int
    partition_rows: tuple[int, ...]
    widths: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        """Rows of the argument's DataFrame, over all ranks."""
        return sum(self.partition_rows)

    @property
    def dropped(self) -> int:
        """Rows left out over all ranks so that every rank has exactly ``rows``."""
        return self.total - self.rows * len(self.partition_rows)


@dataclass(frozen=True)
class ShardFile(Agreed):
    """One rank's shard of one argument, as the rank reads it: the split (above) and

    Attributes:
        path: The Arrow IPC file on the rank's host.
        written: Rows in the file.
        columns: The argument's columns.
    """

    path: str = ""
    written: int = 0
    columns: tuple[Column, ...] = ()


def dump_manifest(shards: list[ShardFile]) -> str:
    """The JSON text of a rank's manifest."""
    return json.dumps([asdict(s) for s in shards], default=lambda kind: kind.value)


def load_manifest(text: str) -> list[ShardFile]:
    """The shards of a manifest written by :func:`dump_manifest`."""
    shards = []
    for item in json.loads(text):
        columns = tuple(
            Column(c["name"], ColumnKind(c["kind"]), c["dtype"], c["field"])
            for c in item.pop("columns")
        )
        shards.append(ShardFile(
            columns=columns,
            partition_rows=tuple(item.pop("partition_rows")),
            widths=tuple((str(n), int(w)) for n, w in item.pop("widths")),
            **item,
        ))
    return shards

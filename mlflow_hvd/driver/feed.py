"""Driver side: the DataFrame arguments of a ``run`` — found in its kwargs, their columns
checked, and projected into the one DataFrame whose ``np`` partitions the barrier stage's
tasks write to their own hosts (:mod:`mlflow_hvd.agent.feed`).

Several DataFrame arguments (a training and a validation set) share the stage: each is
projected to its own columns, tagged with its argument (:data:`TAG_COLUMN`) and unioned by
name; a column name two arguments use with different types gets a per-argument name. The
union is repartitioned round robin to ``np``: each task gets about ``1/np`` of the rows of
every argument.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlflow_hvd.errors import DataInputError
from mlflow_hvd.protocol.feed import (
    TAG_COLUMN,
    Column,
    ColumnKind,
    FeedSpec,
    FrameSpec,
    ShardArg,
)

# Spark's numeric types -> numpy dtype
_NUMERIC = {
    "ByteType": "int8", "ShortType": "int16", "IntegerType": "int32", "LongType": "int64",
    "FloatType": "float32", "DoubleType": "float64", "BooleanType": "bool",
}
_FED_TYPES = ("numeric scalars (byte, short, int, long, float, double, boolean), arrays of "
              "them, Spark ML vectors, binary and string")


def is_dataframe(value: object) -> bool:
    """True for a Spark DataFrame, classic or Spark Connect (without importing pyspark)."""
    if "pyspark.sql" not in sys.modules:
        return False
    for module, name in (("pyspark.sql.dataframe", "DataFrame"),
                         ("pyspark.sql.connect.dataframe", "DataFrame")):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(value, cls):
            return True
    return False


@dataclass(frozen=True)
class Feed:
    """The DataFrame arguments of one ``run`` (driver-only: DataFrames never pickle).

    Attributes:
        spec: What every task writes (crosses to the executors).
        frames: ``(argument, DataFrame)`` in keyword order.
        projections: Per argument, the Spark columns that project it into the fed frame.
    """

    spec: FeedSpec
    frames: tuple[tuple[str, Any], ...]
    projections: tuple[tuple[Any, ...], ...]

    @property
    def key(self) -> tuple[tuple[str, int], ...]:
        """Which DataFrames these are: warm ranks fed with them can run a job that passes
        the same ones (the same objects under the same keywords)."""
        return tuple((argument, id(frame)) for argument, frame in self.frames)

    def check_session(self, spark: Any) -> None:
        """Refuse DataFrames of another SparkSession than ``spark`` (the runner's).

        Raises:
            DataInputError: Naming the argument.
        """
        _check_sessions(list(self.frames), spark)

    def fed_frame(self, np: int) -> Any:
        """The one DataFrame of ``np`` partitions the barrier stage runs over."""
        projected = [frame.select(*projection) for (_, frame), projection
                     in zip(self.frames, self.projections, strict=True)]
        union = projected[0]
        for more in projected[1:]:
            union = union.unionByName(more, allowMissingColumns=True)
        return union.repartition(np)


def with_shard_args(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with each DataFrame replaced by a :class:`ShardArg` (what the ranks get)."""
    return {name: ShardArg(name) if is_dataframe(value) else value
            for name, value in kwargs.items()}


def split_frames(kwargs: Mapping[str, Any], spark: Any = None,
                 compression: str | None = None,
                 held: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], Feed | None]:
    """``kwargs`` with each DataFrame replaced by a :class:`ShardArg`, and the
    :class:`Feed` of those DataFrames and of ``held`` (None when there are none).

    Args:
        kwargs: The keyword arguments of ``run``.
        spark: The runner's SparkSession, if it has one; every DataFrame must belong to it.
        compression: How the tasks compress the shards they write ("lz4", "zstd", None).
        held: DataFrames the code holds (:mod:`mlflow_hvd.driver.captured`), by their
            argument names: fed as the keyword ones, after them.

    Raises:
        DataInputError: A column type that cannot be fed, a DataFrame of another (or a
            stopped) SparkSession.
    """
    found = [(name, value) for name, value in kwargs.items() if is_dataframe(value)]
    for name, value in (held or {}).items():
        if name in kwargs:
            raise DataInputError(f"the keyword {name}= is the name of a converter's "
                                 "DataFrame the function holds: rename the keyword")
        found.append((name, value))
    if not found:
        return dict(kwargs), None
    _check_sessions(found, spark)
    fields = _field_names(found)
    specs, projections = [], []
    for tag, (argument, frame) in enumerate(found):
        spec, projection = _project(argument, tag, frame, fields, tagged=len(found) > 1)
        specs.append(spec)
        projections.append(projection)
    return with_shard_args(kwargs), Feed(FeedSpec(tuple(specs), compression), tuple(found),
                          tuple(projections))


def _check_sessions(found: list[tuple[str, Any]], spark: Any) -> None:
    from mlflow_hvd.backends.spark.api import session_api

    for argument, frame in found:
        session = frame.sparkSession
        if spark is not None and session is not spark:
            raise DataInputError(
                f"the DataFrame passed as {argument}= belongs to another SparkSession than "
                "the one this HorovodRunner runs on: build it from that session (or pass "
                "HorovodRunner(spark=<its session>))")
        if session_api(session).stopped():
            raise DataInputError(
                f"the DataFrame passed as {argument}= belongs to a SparkSession that was "
                "stopped: build it again from an active session")


def _spark_type_key(data_type: Any) -> str:
    return data_type.simpleString() if hasattr(data_type, "simpleString") else str(data_type)


def _field_names(found: list[tuple[str, Any]]) -> dict[tuple[int, str], str]:
    """The fed frame's name of each (tag, column): the column's own name unless two
    arguments give it different types."""
    types: dict[str, set[str]] = {}
    for _, frame in found:
        for f in frame.schema.fields:
            types.setdefault(f.name, set()).add(_spark_type_key(f.dataType))
    return {
        (tag, f.name): f.name if len(types[f.name]) == 1 else f"{f.name}#{tag}"
        for tag, (_, frame) in enumerate(found)
        for f in frame.schema.fields
    }


def _column_kind(argument: str, name: str, data_type: Any) -> tuple[ColumnKind, str]:
    kind = type(data_type).__name__
    if kind in _NUMERIC:
        return ColumnKind.SCALAR, _NUMERIC[kind]
    if kind == "ArrayType" and type(data_type.elementType).__name__ in _NUMERIC:
        return ColumnKind.ARRAY, _NUMERIC[type(data_type.elementType).__name__]
    if kind == "VectorUDT":
        return ColumnKind.ARRAY, "float64"
    if kind == "BinaryType":
        return ColumnKind.BINARY, ""
    if kind == "StringType":
        return ColumnKind.STRING, ""
    raise DataInputError(
        f"column {name!r} of the DataFrame passed as {argument}= has type "
        f"{_spark_type_key(data_type)}, which cannot be fed to the ranks; columns can be "
        f"{_FED_TYPES}: cast it, encode it (e.g. to binary) or drop it before run()")


def _project(argument: str, tag: int, frame: Any, fields: dict[tuple[int, str], str],
             tagged: bool) -> tuple[FrameSpec, tuple[Any, ...]]:
    # the functions of the frame's own kind: pyspark's shared ones pick classic or Connect
    # by a process-wide switch that a Connect session made by its own builder leaves unset
    connect = type(frame).__module__.startswith("pyspark.sql.connect")
    if connect:
        from pyspark.sql.connect.functions import builtin as F
    else:
        from pyspark.sql import functions as F  # type: ignore[no-redef]

    schema = frame.schema
    if not schema.fields:
        raise DataInputError(f"the DataFrame passed as {argument}= has no columns")
    columns, projection = [], []
    if tagged:
        projection.append(F.lit(tag).cast("int").alias(TAG_COLUMN))
    for f in schema.fields:
        if f.name == TAG_COLUMN:
            raise DataInputError(f"column name {TAG_COLUMN!r} (argument {argument}=) is "
                                 "reserved by mlflow_hvd: rename the column")
        kind, dtype = _column_kind(argument, f.name, f.dataType)
        field = fields[(tag, f.name)]
        expr = F.col(f"`{f.name}`")
        if type(f.dataType).__name__ == "VectorUDT":
            if connect:
                from pyspark.ml.connect.functions import vector_to_array
            else:
                from pyspark.ml.functions import vector_to_array
            expr = vector_to_array(expr, "float64")
        projection.append(expr.alias(field))
        columns.append(Column(f.name, kind, dtype, field))
    return FrameSpec(argument, tag, tuple(columns)), tuple(projection)

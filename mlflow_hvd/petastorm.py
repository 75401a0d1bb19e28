"""Petastorm's Spark converter on this runner's DataFrame feed: notebooks written for
HorovodRunner with ``petastorm.spark`` run with their imports changed.

    from mlflow_hvd.petastorm import SparkDatasetConverter, make_spark_converter, TransformSpec

``make_spark_converter(df)`` on the driver; inside the training function
``converter.make_tf_dataset(...)`` / ``converter.make_torch_dataloader(...)`` as context
managers, as with Petastorm. What differs is where the rows are: Petastorm writes the
DataFrame to a cache directory every node must read; here a converter the training
function holds (in its closure or globals, or passed to ``run``) is fed like a DataFrame
passed to ``run``: each barrier task writes its partition to its own host, and each rank
reads its own equal shard there (docs/data.md). No cache directory:
``SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF`` may be set or not. Used on the driver,
outside a job, a converter reads the whole DataFrame (written once to the driver's disk).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import threading
from typing import Any

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.rank import converter as _rank
from mlflow_hvd.rank.converter import TransformSpec
from mlflow_hvd.rank.shard import Shard, job_shard

__all__ = ["SparkDatasetConverter", "TransformSpec", "make_spark_converter"]

DEFAULT_ROW_GROUP_SIZE_BYTES = 32 * 1024 * 1024
_CODECS = ("uncompressed", "bzip2", "gzip", "lz4", "snappy", "deflate")
_numbers = itertools.count(1)
_numbers_lock = threading.Lock()


class SparkDatasetConverter:
    """One DataFrame for the ranks of the jobs whose code holds it (``petastorm.spark``'s
    ``SparkDatasetConverter``). Made by :func:`make_spark_converter`.

    ``len(converter)`` is the DataFrame's rows. Pickled into a job, it carries no data: its
    DataFrame is fed to the job's ranks, and each rank's ``make_tf_dataset`` /
    ``make_torch_dataloader`` read that rank's shard.
    """

    PARENT_CACHE_DIR_URL_CONF = "petastorm.spark.converter.parentCacheDirUrl"

    def __init__(self, argument: str, dataset_size: int, df: Any = None) -> None:
        self.argument = argument  # the DataFrame's name in the job (its run's dataset input)
        self.dataset_size = dataset_size
        self._df = df  # on the driver only
        self._deleted = False
        self._local: tuple[contextlib.ExitStack, Shard] | None = None  # driver-side use

    def __len__(self) -> int:
        return self.dataset_size

    def __repr__(self) -> str:
        return f"SparkDatasetConverter({self.argument!r}, rows={self.dataset_size})"

    def __reduce__(self) -> tuple[Any, ...]:
        self._check_live()
        if self._df is not None:
            from mlflow_hvd.driver import captured

            captured.capture(self.argument, self._df)  # fed to the job being pickled
        return (SparkDatasetConverter, (self.argument, self.dataset_size))

    def __copy__(self) -> SparkDatasetConverter:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SparkDatasetConverter:
        return self

    def make_tf_dataset(self, batch_size: int | None = None, prefetch: int | None = None,
                        num_epochs: int | None = None, workers_count: int | None = None,
                        shuffling_queue_capacity: int | None = None,
                        **petastorm_reader_kwargs: Any
                        ) -> contextlib.AbstractContextManager[Any]:
        """A context manager for a ``tf.data.Dataset`` of batches of ``batch_size`` rows
        (default 32), each a namedtuple of the columns; ``num_epochs`` passes over this
        rank's shard (``None``: without end), each shuffled anew unless
        ``shuffle_row_groups=False``; ``shuffling_queue_capacity``: rows also shuffled
        through a buffer of that many (tf.data's ``shuffle``); ``prefetch``: batches
        prefetched (default: autotuned). In a job of more than one rank pass
        ``cur_shard=hvd.rank(), shard_count=hvd.size()``. Reader arguments honoured:
        ``transform_spec``, ``schema_fields`` (column names), ``seed``,
        ``shuffle_row_groups``, ``shuffle_rows``; ``workers_count`` changes nothing here.

        Raises:
            ConfigurationError: An argument this feed cannot honour, named, with what to do.
        """
        del workers_count  # Petastorm's reader threads: a rank reads its own file here
        plan = self._plan("make_tf_dataset", batch_size, num_epochs, None,
                          petastorm_reader_kwargs)
        return _rank.tf_dataset(plan, prefetch, shuffling_queue_capacity)

    def make_torch_dataloader(self, batch_size: int = 32, num_epochs: int | None = None,
                              workers_count: int | None = None,
                              shuffling_queue_capacity: int = 0, data_loader_fn: Any = None,
                              **petastorm_reader_kwargs: Any
                              ) -> contextlib.AbstractContextManager[Any]:
        """A context manager for a loader of batches of ``batch_size`` rows, each a dict of
        column -> tensor (strings and bytes: lists), as ``petastorm.pytorch.DataLoader``;
        ``num_epochs`` passes over this rank's shard (``None``: without end);
        ``shuffling_queue_capacity``: rows shuffled together in windows of at least that
        many. The other arguments as :meth:`make_tf_dataset`.

        Raises:
            ConfigurationError: ``data_loader_fn`` (it builds a loader from Petastorm's
                reader, which this feed replaces), or as :meth:`make_tf_dataset`.
        """
        del workers_count
        if data_loader_fn is not None:
            raise ConfigurationError(
                "make_torch_dataloader: data_loader_fn= builds a loader from Petastorm's "
                "reader, which this feed replaces: leave it out (batches come as "
                "petastorm.pytorch.DataLoader's: dicts of tensors)")
        if (isinstance(shuffling_queue_capacity, bool)
                or not isinstance(shuffling_queue_capacity, int)
                or shuffling_queue_capacity < 0):
            raise ConfigurationError(
                "make_torch_dataloader: shuffling_queue_capacity must be an int >= 0, got "
                f"{shuffling_queue_capacity!r}")
        plan = self._plan("make_torch_dataloader", batch_size, num_epochs,
                          shuffling_queue_capacity, petastorm_reader_kwargs)
        return contextlib.nullcontext(_rank.TorchLoader(plan))

    def delete(self) -> None:
        """Let go of the DataFrame (and of what a use on the driver wrote to its disk): a
        job whose code holds this converter afterwards is refused."""
        self._deleted = True
        self._df = None
        if self._local is not None:
            self._local[0].close()
            self._local = None

    # --- internals ---------------------------------------------------------------------
    def _check_live(self) -> None:
        if self._deleted:
            raise ConfigurationError(f"{self!r} was deleted (converter.delete()): make a new "
                                     "one with make_spark_converter(df)")

    def _plan(self, what: str, batch_size: int | None, num_epochs: int | None,
              shuffling_window: int | None, reader_kwargs: dict[str, Any]) -> _rank.Plan:
        self._check_live()
        return _rank.plan(self._shard(), self.argument, batch_size, num_epochs,
                          shuffling_window, reader_kwargs, what)

    def _shard(self) -> Shard:
        shard = job_shard(self.argument)
        if shard is not None:
            return shard
        if self._df is None:
            raise ConfigurationError(
                f"{self!r} has no data here: it reaches a rank in a job's code (run(main) "
                "with main holding it, or run(main, name=converter)); pickled any other way "
                "it carries no DataFrame")
        if self._local is None:
            self._local = _write_on_driver(self.argument, self._df)
        return self._local[1]


def make_spark_converter(df: Any, parquet_row_group_size_bytes: int =
                         DEFAULT_ROW_GROUP_SIZE_BYTES, compression_codec: str | None = None,
                         dtype: str | None = "float32") -> SparkDatasetConverter:
    """A :class:`SparkDatasetConverter` of ``df`` (a Spark DataFrame, classic or Connect, or
    the path of a Parquet data set read with the active SparkSession), as
    ``petastorm.spark.make_spark_converter``.

    ``dtype``: floating-point columns (and arrays of them) become this precision,
    ``"float32"`` (default) or ``"float64"``; None leaves them. Spark ML vectors become
    arrays of ``dtype`` (float64 with None), as Petastorm makes them.
    ``parquet_row_group_size_bytes`` and ``compression_codec`` shaped Petastorm's cache
    files; there are none here (the checks on them are kept).

    The DataFrame's columns are checked now (as ``run(..., data=df)`` would check them) and
    its rows counted (one Spark job, as Petastorm's).

    Raises:
        ConfigurationError: ``df`` is not a DataFrame or path, ``dtype`` or
            ``compression_codec`` unknown.
        DataInputError: A column of a type that cannot be fed, named.
    """
    from mlflow_hvd.driver.feed import is_dataframe, split_frames

    if isinstance(df, str):
        df = _read_parquet(df)
    if not is_dataframe(df):
        raise ConfigurationError(f"make_spark_converter: df must be a Spark DataFrame or the "
                                 f"path of a Parquet data set, got {type(df).__name__}")
    if dtype not in (None, "float32", "float64"):
        raise ConfigurationError(f"make_spark_converter: dtype {dtype!r} is not supported: "
                                 "use 'float32', 'float64' or None")
    if compression_codec is not None and str(compression_codec).lower() not in _CODECS:
        raise ConfigurationError(f"make_spark_converter: compression_codec should be None or "
                                 f"one of {', '.join(map(repr, _CODECS))}")
    if (isinstance(parquet_row_group_size_bytes, bool)
            or not isinstance(parquet_row_group_size_bytes, int)
            or parquet_row_group_size_bytes < 1):
        raise ConfigurationError("make_spark_converter: parquet_row_group_size_bytes must be a "
                                 f"positive int, got {parquet_row_group_size_bytes!r}")
    with _numbers_lock:
        argument = f"converter_{next(_numbers)}"
    df = _with_precision(df, dtype)
    split_frames({argument: df})  # the columns' checks, before any Spark job
    return SparkDatasetConverter(argument, int(df.count()), df)


def _read_parquet(path: str) -> Any:
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        raise ConfigurationError(f"make_spark_converter({path!r}): no active SparkSession to "
                                 "read it with: pass spark.read.parquet(path)")
    return spark.read.parquet(path)


def _with_precision(df: Any, dtype: str | None) -> Any:
    """``df`` with its floating-point columns (and arrays of them) made ``dtype`` and its
    Spark ML vectors arrays of ``dtype`` (float64 with None)."""
    connect = type(df).__module__.startswith("pyspark.sql.connect")
    if connect:
        from pyspark.sql.connect.functions import builtin as F
    else:
        from pyspark.sql import functions as F  # type: ignore[no-redef]
    target = {"float32": "float", "float64": "double"}.get(dtype or "")
    exprs, changed = [], False
    for field in df.schema.fields:
        kind = type(field.dataType).__name__
        column = F.col(f"`{field.name}`")
        if kind == "VectorUDT":
            if connect:
                from pyspark.ml.connect.functions import vector_to_array
            else:
                from pyspark.ml.functions import vector_to_array
            column, changed = vector_to_array(column, dtype or "float64"), True
        elif target and kind in ("FloatType", "DoubleType") and _spark_float(kind) != target:
            column, changed = column.cast(target), True
        elif (target and kind == "ArrayType"
              and type(field.dataType.elementType).__name__ in ("FloatType", "DoubleType")
              and _spark_float(type(field.dataType.elementType).__name__) != target):
            column, changed = column.cast(f"array<{target}>"), True
        exprs.append(column.alias(field.name))
    return df.select(*exprs) if changed else df


def _spark_float(kind: str) -> str:
    return "float" if kind == "FloatType" else "double"


def _write_on_driver(argument: str, df: Any) -> tuple[contextlib.ExitStack, Shard]:
    """The whole DataFrame written to the driver's disk (removed on ``delete()`` or at
    exit), as the shard of a one-rank job."""
    from mlflow_hvd.backends.local_feed import feed_locally
    from mlflow_hvd.driver.feed import split_frames
    from mlflow_hvd.rank.shard import open_shard

    _, feed = split_frames({argument: df})
    assert feed is not None
    owned = contextlib.ExitStack()
    try:
        manifests, _ = feed_locally(feed.spec, feed.fed_frame(1), 1, owned)
        shard = open_shard(manifests[0], argument)
    except BaseException:
        owned.close()
        raise
    atexit.register(owned.close)
    return owned, shard

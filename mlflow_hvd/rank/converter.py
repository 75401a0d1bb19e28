"""Rank side of :mod:`mlflow_hvd.petastorm`: Petastorm's ``make_tf_dataset`` and
``make_torch_dataloader`` over a rank's :class:`~mlflow_hvd.rank.shard.Shard`.

What they yield is what Petastorm's converter yields: TensorFlow batches as namedtuples of
the columns, PyTorch batches as dicts of tensors (strings and bytes: lists), ``batch_size``
rows per batch over a stream of ``num_epochs`` passes (``None``: without end), so the last
batch of a finite stream may be short. A finite pass reads every row the rank holds, so
that the ranks together read every row of the DataFrame once (their passes may differ in
length, as Petastorm's shards do); a stream without end reads the rank's equal shard.
What Petastorm's reader does with the arguments this feed cannot honour is refused by name
(:func:`plan`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlflow_hvd.common import compat
from mlflow_hvd.errors import ConfigurationError, DataInputError
from mlflow_hvd.rank import identity
from mlflow_hvd.rank.shard import Shard

TRANSFORM_ROWS = 1024  # rows per pandas DataFrame a TransformSpec's function receives
CROSSING_BYTES = 1 << 20  # about this much per crossing from Python into tf.data

# make_batch_reader's arguments that change nothing a rank receives here
_NO_EFFECT = ("results_queue_size", "zmq_copy_buffers", "convert_early_to_numpy")
# ...and those whose meaning this feed cannot give, with what to do instead
_REFUSED = {
    "predicate": "filter the DataFrame in Spark (df.filter(...)) before make_spark_converter",
    "filters": "filter the DataFrame in Spark (df.filter(...)) before make_spark_converter",
    "rowgroup_selector": "select the rows in Spark before make_spark_converter",
    "reader_pool_type": "leave it out: each rank reads its own shard in its own process",
    "shard_seed": "leave it out: the job's feed fixes each rank's rows (Spark's partitions)",
    "shuffle_row_drop_partitions": "leave it out (or sample the DataFrame in Spark)",
    "cache_type": "leave it out: each rank reads its shard from its own host's disk",
    "cache_location": "leave it out: each rank reads its shard from its own host's disk",
    "cache_size_limit": "leave it out: each rank reads its shard from its own host's disk",
    "cache_row_size_estimate": "leave it out: each rank reads its shard from its own disk",
    "cache_extra_settings": "leave it out: each rank reads its shard from its own disk",
    "hdfs_driver": "leave it out: no file system is read, the shard is on the rank's host",
    "storage_options": "leave it out: no file system is read, the shard is on the rank's host",
    "filesystem": "leave it out: no file system is read, the shard is on the rank's host",
    "dataset_url": "leave it out: the converter is the data set",
    "dataset_url_or_urls": "leave it out: the converter is the data set",
}
_HONOURED = ("cur_shard", "shard_count", "transform_spec", "schema_fields", "seed",
             "shuffle_row_groups", "shuffle_rows")


class TransformSpec:
    """``petastorm.TransformSpec``: a function of a pandas DataFrame (a chunk of rows)
    returning the DataFrame to train on, and how it changes the columns.

    Args:
        func: ``pandas.DataFrame -> pandas.DataFrame`` (array cells are numpy arrays); None
            for a change of columns only.
        edit_fields: ``(name, numpy_dtype, shape, nullable)`` of each column ``func`` adds
            or changes: its values are made that dtype and, per row, that shape.
        removed_fields: Columns left out of the result.
        selected_fields: The result's columns, in this order (instead of
            ``removed_fields``).
    """

    def __init__(self, func: Callable[[Any], Any] | None = None,
                 edit_fields: Sequence[tuple[Any, ...]] | None = None,
                 removed_fields: Sequence[str] | None = None,
                 selected_fields: Sequence[str] | None = None) -> None:
        if removed_fields is not None and selected_fields is not None:
            raise ValueError("User can only specify one of removed_fields and "
                             "selected_fields in TransformSpec.")
        if func is not None and not callable(func):
            raise ConfigurationError(f"TransformSpec(func=...) must be a function of a pandas "
                                     f"DataFrame, got {func!r}")
        self.func = func
        self.edit_fields = [tuple(f) for f in (edit_fields or [])]
        for field in self.edit_fields:
            if len(field) != 4:
                raise ConfigurationError(
                    f"TransformSpec edit_fields entry {field!r}: expected (name, numpy_dtype, "
                    "shape, nullable)")
        self.removed_fields = list(removed_fields or [])
        self.selected_fields = list(selected_fields) if selected_fields is not None else None

    def columns(self, before: Sequence[str]) -> list[str]:
        """The columns after the transform, in Petastorm's order: the columns kept, then the
        edited ones (or ``selected_fields`` as given)."""
        edited = [f[0] for f in self.edit_fields]
        if self.selected_fields is not None:
            known = set(before) | set(edited)
            unknown = [n for n in self.selected_fields if n not in known]
            if unknown:
                raise ConfigurationError(
                    f"TransformSpec selected_fields {unknown} are neither columns of the "
                    f"converter's DataFrame ({list(before)}) nor in edit_fields")
            return list(self.selected_fields)
        dropped = set(edited) | set(self.removed_fields)
        return [n for n in before if n not in dropped] + edited


@dataclass(frozen=True)
class Plan:
    """What one ``make_tf_dataset`` / ``make_torch_dataloader`` call reads and yields."""

    shard: Shard
    batch_size: int
    num_epochs: int | None
    columns: tuple[str, ...]  # read from the shard
    shuffle: bool
    seed: int
    window: int | None
    transform: TransformSpec | None


def plan(shard: Shard, argument: str, batch_size: int | None, num_epochs: int | None,
         shuffling_window: int | None, reader_kwargs: dict[str, Any], what: str) -> Plan:
    """Check a call's arguments against what this feed can honour.

    Raises:
        ConfigurationError: Naming the argument, why, and what to do.
    """
    unknown = sorted(set(reader_kwargs) - set(_HONOURED) - set(_NO_EFFECT) - set(_REFUSED))
    if unknown:
        raise ConfigurationError(
            f"{what}: unexpected argument(s) {unknown}; it takes batch_size, num_epochs, "
            f"workers_count, shuffling_queue_capacity and make_batch_reader's "
            f"{', '.join(_HONOURED)}")
    for name in sorted(set(reader_kwargs) & set(_REFUSED)):
        raise ConfigurationError(f"{what}: {name}= is Petastorm's reader's and has no "
                                 f"meaning for this feed: {_REFUSED[name]}")
    batch = 32 if batch_size is None else batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigurationError(f"{what}: batch_size must be a positive int, got "
                                 f"{batch_size!r}")
    if num_epochs is not None and (isinstance(num_epochs, bool)
                                   or not isinstance(num_epochs, int) or num_epochs < 1):
        raise ConfigurationError(f"{what}: num_epochs must be a positive int or None (without "
                                 f"end), got {num_epochs!r}")
    _check_shard(argument, reader_kwargs.get("cur_shard"), reader_kwargs.get("shard_count"),
                 what)
    spec = reader_kwargs.get("transform_spec")
    if spec is not None and not isinstance(spec, TransformSpec):
        raise ConfigurationError(
            f"{what}: transform_spec must be mlflow_hvd.petastorm.TransformSpec, got "
            f"{type(spec).__name__} (import TransformSpec from mlflow_hvd.petastorm)")
    columns = shard.columns
    fields = reader_kwargs.get("schema_fields")
    if fields is not None:
        names = [f if isinstance(f, str) else getattr(f, "name", f) for f in fields]
        bad = [n for n in names if not isinstance(n, str) or n not in columns]
        if bad:
            raise ConfigurationError(
                f"{what}: schema_fields {bad} are not columns of the converter's DataFrame "
                f"{columns} (give column names; patterns are not read)")
        columns = names
    if spec is not None:
        spec.columns(columns)  # checks selected_fields
    shuffle = bool(reader_kwargs.get("shuffle_row_groups", True)
                   or reader_kwargs.get("shuffle_rows", False) or shuffling_window)
    seed = reader_kwargs.get("seed")
    return Plan(shard, batch, num_epochs, tuple(columns), shuffle,
                0 if seed is None else int(seed), shuffling_window or None, spec)


def _check_shard(argument: str, cur_shard: Any, shard_count: Any, what: str) -> None:
    """A rank reads its own shard: ``cur_shard``/``shard_count`` must say so (or be left
    out in a one-rank job)."""
    me = identity.current()
    rank, size = me.rank, me.size
    if cur_shard is None and shard_count is None:
        if size > 1:
            raise ConfigurationError(
                f"{what} on rank {rank} of {size} without cur_shard/shard_count: Petastorm "
                "would give every rank all the rows; here each rank holds its own equal shard "
                "(written on its host): pass cur_shard=hvd.rank(), shard_count=hvd.size()")
        return
    if (cur_shard, shard_count) != (rank, size):
        raise ConfigurationError(
            f"{what}: cur_shard={cur_shard!r}, shard_count={shard_count!r} on rank {rank} of "
            f"{size}: each rank holds only its own shard of {argument}: pass "
            "cur_shard=hvd.rank(), shard_count=hvd.size()")


def stream(p: Plan) -> Iterator[dict[str, np.ndarray]]:
    """The plan's rows: chunks of consecutive rows, ``num_epochs`` passes (or without
    end; each pass the shard's next epoch), after the transform. A chunk's arrays are
    valid until the next is asked for."""
    done = 0
    while p.num_epochs is None or done < p.num_epochs:
        # a finite pass reads every row the rank holds (all ranks' passes: every row of the
        # DataFrame once, as Petastorm's); a stream without end reads the equal shard
        yield from _one_pass(p, None, every_row=p.num_epochs is not None)
        done += 1


def first_chunk(p: Plan) -> dict[str, np.ndarray]:
    """The first chunk of a pass in file order (its columns and types), counting no
    epoch."""
    chunk = next(_one_pass(p, 0, shuffle=False), None)
    if chunk is None:
        raise DataInputError(f"{p.shard.argument} has no rows on rank "
                             f"{identity.current().rank}")
    return chunk


def _one_pass(p: Plan, epoch: int | None, shuffle: bool | None = None,
              every_row: bool = False) -> Iterator[dict[str, np.ndarray]]:
    for chunk in p.shard.row_chunks(columns=list(p.columns),
                                    shuffle=p.shuffle if shuffle is None else shuffle,
                                    seed=p.seed, epoch=epoch, window=p.window,
                                    every_row=every_row):
        if p.transform is None:
            yield chunk
        else:
            yield from _transformed(p, chunk)


def _transformed(p: Plan, chunk: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
    import pandas as pd

    spec = p.transform
    assert spec is not None
    after = spec.columns(p.columns)
    edits = {f[0]: f for f in spec.edit_fields}
    rows = len(next(iter(chunk.values())))
    for lo in range(0, rows, TRANSFORM_ROWS):
        frame = pd.DataFrame({n: list(a[lo:lo + TRANSFORM_ROWS]) if a.ndim > 1
                              else a[lo:lo + TRANSFORM_ROWS] for n, a in chunk.items()})
        if spec.func is not None:
            try:
                frame = spec.func(frame)
            except Exception as exc:
                raise DataInputError(
                    f"rank {identity.current().rank}: the TransformSpec's function "
                    f"raised on {p.shard.argument}'s rows: {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(frame, pd.DataFrame):
                raise DataInputError(
                    f"the TransformSpec's function returned {type(frame).__name__}; it must "
                    "return a pandas DataFrame")
        missing = [n for n in after if n not in frame.columns]
        if missing:
            raise DataInputError(
                f"the TransformSpec's result has no column(s) {missing} (it has "
                f"{list(frame.columns)}): return them, or list them in removed_fields")
        yield {n: _column(frame[n], edits.get(n)) for n in after}


def _column(values: Any, edit: tuple[Any, ...] | None) -> np.ndarray:
    """One result column as an array of its rows (cells that are arrays: stacked)."""
    if values.dtype == object and len(values) and isinstance(values.iloc[0], np.ndarray | list):
        array = np.stack([np.asarray(v) for v in values])
    else:
        array = values.to_numpy()
    if edit is not None:
        name, dtype, shape = edit[0], edit[1], edit[2]
        if dtype is not None and np.dtype(dtype).kind not in "OSU":
            array = array.astype(dtype, copy=False)
        if shape:
            try:
                array = array.reshape(len(array), *[-1 if d is None else d for d in shape])
            except ValueError as exc:
                raise DataInputError(
                    f"the TransformSpec's column {name!r} does not fit edit_fields' shape "
                    f"{tuple(shape)}: {exc}") from exc
    return array


# --- TensorFlow --------------------------------------------------------------------------
@contextlib.contextmanager
def tf_dataset(p: Plan, prefetch: int | None, shuffling_queue_capacity: int | None
               ) -> Iterator[Any]:
    """``make_tf_dataset``'s dataset: rows as namedtuples of the columns, shuffled through a
    buffer of ``shuffling_queue_capacity`` rows if given (tf.data's ``shuffle``, as
    Petastorm), batched ``p.batch_size`` (a finite stream's last batch may be short)."""
    compat.require_tensorflow("make_tf_dataset()")
    import tensorflow as tf

    first = first_chunk(p)
    names = list(first)
    Row = collections.namedtuple("inferred_schema_view", names, rename=True)  # type: ignore[misc]
    specs = Row(*[_tf_spec(tf, first[n]) for n in names])

    def generate() -> Iterator[Any]:
        per = None
        for chunk in stream(p):
            if per is None:
                row_bytes = sum(_row_bytes(a) for a in chunk.values())
                per = max(1, CROSSING_BYTES // max(1, row_bytes))
            for lo in range(0, len(chunk[names[0]]), per):
                yield Row(*[chunk[n][lo:lo + per] for n in names])

    dataset = tf.data.Dataset.from_generator(generate, output_signature=specs)
    if shuffling_queue_capacity:
        dataset = dataset.unbatch().shuffle(shuffling_queue_capacity, seed=p.seed)
        dataset = dataset.batch(p.batch_size)
    else:  # the chunks' rows in batches: unbatch().batch(n) in one copy
        dataset = dataset.rebatch(p.batch_size)
    yield dataset.prefetch(tf.data.AUTOTUNE if prefetch is None else prefetch)


def _tf_spec(tf: Any, array: np.ndarray) -> Any:
    if array.dtype.kind in "OSU":
        return tf.TensorSpec((None,), tf.string)
    return tf.TensorSpec((None, *array.shape[1:]), tf.as_dtype(array.dtype))


def _row_bytes(array: np.ndarray) -> int:
    if array.dtype.kind == "O":
        return 64
    return int(array[0].nbytes) if len(array) else 1


# --- PyTorch -----------------------------------------------------------------------------
class TorchLoader:
    """``make_torch_dataloader``'s loader, as ``petastorm.pytorch.DataLoader``: an iterable
    of dicts of column -> tensor (strings and bytes: lists) of ``batch_size`` rows."""

    def __init__(self, p: Plan) -> None:
        self._plan = p
        self.batch_size = p.batch_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        pending: list[dict[str, np.ndarray]] = []
        held = 0
        for chunk in stream(self._plan):
            lo, rows = 0, len(next(iter(chunk.values())))
            while lo < rows:
                take = min(self.batch_size - held, rows - lo)
                pending.append({n: a[lo:lo + take].copy() for n, a in chunk.items()})
                held += take
                lo += take
                if held == self.batch_size:
                    yield _torch_batch(torch, pending)
                    pending, held = [], 0
        if pending:
            yield _torch_batch(torch, pending)


def _torch_batch(torch: Any, parts: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    out = {}
    for name in parts[0]:
        arrays = [part[name] for part in parts]
        joined = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        out[name] = (joined.tolist() if joined.dtype.kind in "OSU"
                     else torch.from_numpy(np.ascontiguousarray(joined)))
    return out

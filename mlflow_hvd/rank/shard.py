"""Rank side: this rank's rows of one DataFrame argument, read from the Arrow IPC file its
task wrote on this host (:class:`Shard`), and the kwargs a rank's function receives with
each DataFrame replaced by its shard (:func:`resolve`).

Every rank of a job has exactly :attr:`Shard.rows` rows, so ``steps(batch_size)`` is the
same on every rank. Batches hold exactly ``batch_size`` rows (the last partial batch of a
pass is left out, on every rank alike). A pass reads the file through a memory map and
hands back the pages it has read, so a rank's memory does not grow with its shard.

Shuffling, per pass (``seed + epoch``: reproducible, different every epoch): the order of
the file's record batches is permuted, and rows are permuted within a window of
consecutive batches of that order (``window`` rows; by default 65,536 rows or the rows of
about 32 MiB of the file, whichever is fewer). Which rows a rank has does not change
between epochs: shards are fixed for the job (as with every partition-local feed).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from mlflow_hvd.common import compat
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.protocol.feed import (
    FEED_FAILED_FILE,
    ColumnKind,
    ShardArg,
    ShardFile,
    load_manifest,
)
from mlflow_hvd.rank import context, identity
from mlflow_hvd.rank.passes import Pass, window_rows

_DATASET_OPTIONS = ("label", "features", "shuffle", "seed", "window", "transform")
CROSSING_BYTES = 1 << 20  # about this much of a window per step from Python into tf.data


class Shard:
    """This rank's rows of one DataFrame passed to ``run`` (received in place of it).

    Attributes:
        argument: The keyword the DataFrame was passed as.
        rows: Rows this rank uses; the same on every rank of the job.
        columns: The column names, as in the DataFrame.
        total_rows: Rows of the whole DataFrame.
        dropped: Rows no rank uses, so that every rank has exactly ``rows``.
        next_epoch: The epoch of the next pass that does not name one (counts up from 0
            with each pass; set it when resuming at a later epoch).
    """

    def __init__(self, file: ShardFile | Callable[[], ShardFile], argument: str = "",
                 on_load: Callable[[Shard], None] | None = None) -> None:
        # ``file``, or what waits for it: a rank starts while its task still writes the
        # shard, and waits for it on first use (:func:`resolve`)
        self._source = file
        self._loaded: ShardFile | None = None
        self._on_load = on_load
        self.argument = file.argument if isinstance(file, ShardFile) else argument
        self.next_epoch = 0

    @property
    def _file(self) -> ShardFile:
        if self._loaded is None:
            source = self._source
            self._loaded = source if isinstance(source, ShardFile) else source()
            if self._on_load is not None:
                self._on_load(self)
        return self._loaded

    @property
    def rows(self) -> int:
        return self._file.rows

    @property
    def columns(self) -> list[str]:
        return [c.name for c in self._file.columns]

    @property
    def total_rows(self) -> int:
        return self._file.total

    @property
    def dropped(self) -> int:
        return self._file.dropped

    @property
    def _widths(self) -> dict[str, int]:
        return dict(self._file.widths)

    def __len__(self) -> int:
        return self.rows

    def __repr__(self) -> str:
        return (f"Shard({self.argument!r}, rows={self.rows}, columns={self.columns}, "
                f"total_rows={self.total_rows}, dropped={self.dropped})")

    def steps(self, batch_size: int) -> int:
        """Full batches of ``batch_size`` in one pass: the same on every rank.

        Raises:
            ConfigurationError: ``batch_size`` < 1, or more than this rank's rows.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"batch_size must be a positive int, got {batch_size!r}")
        if batch_size > self.rows:
            raise ConfigurationError(
                f"batch_size={batch_size} but every rank has {self.rows} rows of "
                f"{self.argument}= ({self.total_rows} rows over "
                f"{len(self._file.partition_rows)} ranks): not one full batch; lower the "
                "batch size or np, or pass more data")
        return self.rows // batch_size

    # --- numpy ---------------------------------------------------------------------------
    def batches(self, batch_size: int, *, columns: Sequence[str] | None = None,
                shuffle: bool = True, seed: int = 0, epoch: int | None = None,
                window: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """One pass over the shard: ``steps(batch_size)`` dicts of column name -> numpy
        array of ``batch_size`` rows (arrays: ``(batch_size, width)``; binary and string
        columns: object arrays of ``bytes`` / ``str``).

        Args:
            columns: The columns to read (default: all).
            shuffle: Permute record batches and rows within ``window`` rows, from
                ``seed + epoch``; False reads the rows in file order.
            window: Rows shuffled together in memory (default: 65,536, or the rows of
                about 32 MiB of the shard's file if fewer).
            epoch: The pass's epoch (default: :attr:`next_epoch`, then counted up).
        """
        return self._pass(batch_size, columns, shuffle, seed, epoch, window).batches()

    def row_chunks(self, *, columns: Sequence[str] | None = None, shuffle: bool = True,
                   seed: int = 0, epoch: int | None = None, window: int | None = None,
                   every_row: bool = False) -> Iterator[dict[str, np.ndarray]]:
        """One pass over every row of the shard, none left out (unlike :meth:`batches`,
        which leaves out the last partial batch): chunks of consecutive rows of the pass,
        dicts of column -> array of the chunk's rows, each valid until the next chunk is
        asked for (copy what you keep). Shuffled as :meth:`batches` is.

        ``every_row``: also the rows this rank holds beyond :attr:`rows` (what equal shards
        leave out), so that the passes of all ranks together read every row of the
        DataFrame once, as a finite pass of Petastorm's reader does; ranks' passes may then
        differ in length."""
        one_pass = self._pass(1, columns, shuffle, seed, epoch, window,
                              rows=self._file.written if every_row else None)
        for group in one_pass.groups():  # (rows, 1, ...): one row per "batch"
            yield {n: a.reshape(a.shape[0], *a.shape[2:]) for n, a in group.items()}

    def _pass(self, batch_size: int, columns: Sequence[str] | None, shuffle: bool, seed: int,
              epoch: int | None, window: int | None, rows: int | None = None) -> Pass:
        """A pass over the first ``rows`` rows of the file (default: :attr:`rows`)."""
        steps = self.steps(batch_size)
        names = list(columns) if columns is not None else self.columns
        unknown = sorted(set(names) - set(self.columns))
        if unknown:
            raise ConfigurationError(f"{self.argument}= has no column(s) {unknown}; it has "
                                     f"{self.columns}")
        if epoch is None:
            epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        rng = np.random.default_rng([seed, epoch]) if shuffle else None
        return Pass(self._file.path, self.rows if rows is None else rows, names,
                    self._widths, batch_size, steps,
                    rng, window_rows(self._file.path, self._file.written, window, batch_size,
                                     shuffle))

    # --- TensorFlow ----------------------------------------------------------------------
    def tf_dataset(self, batch_size: int, *, label: str | None = "label",
                   features: Sequence[str] | None = None, shuffle: bool = True,
                   seed: int = 0, window: int | None = None, map: Any = None) -> Any:
        """A ``tf.data.Dataset`` of ``(features, label)`` batches with known cardinality
        (``steps(batch_size)``): ``model.fit(ds, epochs=n)`` needs no ``steps_per_epoch``.
        Each iteration (each epoch of ``fit``) is a new pass, shuffled for its epoch.

        ``features``: one column gives its array, several a dict of arrays (named model
        inputs); default: every column but ``label``. ``label=None``: features only.

        ``map``: a function of one row, ``(features, label)`` (or the features alone with
        ``label=None``) as tensors, returning the row to train on, e.g. an encoded image
        decoded with ``tf.io.decode_png`` and augmented. It runs as tf.data's parallel
        ``map`` (``num_parallel_calls=AUTOTUNE``, in order) between the rows and the batches:
        TensorFlow's threads, not Python's.
        """
        compat.require_tensorflow(f"{self.argument}.tf_dataset()")
        import tensorflow as tf

        steps = self.steps(batch_size)
        names, label = self._split(label, features)
        kinds = {c.name: c for c in self._file.columns}

        def spec(name: str) -> Any:  # of a group of batches: (batches, batch_size, ...)
            column = kinds[name]
            if column.kind in (ColumnKind.BINARY, ColumnKind.STRING):
                return tf.TensorSpec((None, batch_size), tf.string)
            shape = (None, batch_size) if column.kind is ColumnKind.SCALAR else (
                None, batch_size, self._widths[name])
            return tf.TensorSpec(shape, tf.as_dtype(column.dtype))

        feature_spec = spec(names[0]) if len(names) == 1 else {n: spec(n) for n in names}
        signature = feature_spec if label is None else (feature_spec, spec(label))
        read = [*names, *([label] if label else [])]

        def generate() -> Iterator[Any]:
            # several batches per crossing from Python (unbatch() below splits them in
            # TensorFlow), about CROSSING_BYTES at a time
            one_pass = self._pass(batch_size, read, shuffle, seed, None, window)
            per = None
            for group in one_pass.groups():
                if per is None:
                    row_bytes = sum(a[0].nbytes for a in group.values())
                    per = max(1, CROSSING_BYTES // max(1, row_bytes))
                for lo in range(0, len(group[read[0]]), per):
                    part = {n: a[lo:lo + per] for n, a in group.items()}
                    x = part[names[0]] if len(names) == 1 else {n: part[n] for n in names}
                    yield x if label is None else (x, part[label])

        dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
        dataset = dataset.unbatch()
        if map is not None:
            if not callable(map):
                raise ConfigurationError(f"map must be a function of one row, got {map!r}")
            dataset = dataset.unbatch().map(map, num_parallel_calls=tf.data.AUTOTUNE,
                                            deterministic=True)
            dataset = dataset.batch(batch_size, drop_remainder=True)
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(steps))
        return dataset.prefetch(2)

    # --- PyTorch -------------------------------------------------------------------------
    def torch_dataset(self, batch_size: int, *, label: str | None = "label",
                      features: Sequence[str] | None = None, shuffle: bool = True,
                      seed: int = 0, window: int | None = None,
                      transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                      ) -> Any:
        """A ``torch.utils.data.IterableDataset`` of ``(features, label)`` tensor batches
        (``len()`` is ``steps(batch_size)``), each iteration a new pass shuffled for its
        epoch (the first: :attr:`next_epoch`; ``set_epoch(n)`` numbers the next one). Use it
        with ``DataLoader(ds, batch_size=None, num_workers=k)`` (:meth:`torch_loader`): the
        ``k`` worker processes split each pass, every row once, in the pass's order
        (:mod:`mlflow_hvd.rank.torch_data`); it pickles, for the ``forkserver`` and
        ``spawn`` start methods. Binary and string columns stay lists of ``bytes`` /
        ``str``.

        ``transform``: a function of one row (a dict of column -> value) returning a dict
        of column -> value (e.g. an encoded image decoded to an array, augmented), run where
        the batch is made: in the loader's worker processes. Its results are stacked per
        column, so each row must return the same columns, shapes and types. A row it
        fails on, or whose result does not fit the batch, raises
        :class:`~mlflow_hvd.errors.DataInputError` naming the rank, the row's position in
        the pass and the argument.
        """
        from mlflow_hvd.rank.torch_data import ShardDataset

        steps = self.steps(batch_size)
        names, label = self._split(label, features)
        if transform is not None and not callable(transform):
            raise ConfigurationError(f"transform must be a function of one row, got "
                                     f"{transform!r}")
        return ShardDataset(self._file, batch_size, names, label, steps, shuffle, seed,
                            window, self.next_epoch, transform,
                            identity.current().rank)

    def torch_loader(self, batch_size: int, **options: Any) -> Any:
        """``DataLoader(torch_dataset(batch_size, ...), batch_size=None, ...)``: the
        options of :meth:`torch_dataset` go to the dataset, the others (``num_workers``,
        ``persistent_workers``, ``prefetch_factor``, ``pin_memory``,
        ``multiprocessing_context``, ...) to the ``DataLoader``. Batches are made by the
        shard (in the workers, with ``num_workers``) and handed on as they are."""
        import torch

        mine = {k: options.pop(k) for k in _DATASET_OPTIONS if k in options}
        return torch.utils.data.DataLoader(self.torch_dataset(batch_size, **mine),
                                           batch_size=None, collate_fn=_as_is, **options)

    def _split(self, label: str | None, features: Sequence[str] | None
               ) -> tuple[list[str], str | None]:
        if label is not None and label not in self.columns:
            raise ConfigurationError(
                f"{self.argument}= has no label column {label!r}; its columns are "
                f"{self.columns}: pass label=<column> (or label=None)")
        names = list(features) if features is not None else [
            c for c in self.columns if c != label]
        unknown = sorted(set(names) - set(self.columns))
        if unknown or not names:
            what = f"no such column(s) {unknown}" if unknown else "no feature column left"
            raise ConfigurationError(f"features of {self.argument}=: {what}; its columns are "
                                     f"{self.columns}")
        return names, label


def _as_is(batch: Any) -> Any:
    """A DataLoader's ``collate_fn`` for batches that are tensors already."""
    return batch


class FeedNotDelivered(Exception):
    """The job's data feed failed while this rank waited for its shard: the driver has the
    feed's own error and ends the job with it; the rank exits without an error of its own
    (``mlflow_hvd.rank.worker``)."""


WAIT_POLL = 0.05  # seconds between looks for the manifest
DRIVER_LOOK_EVERY = 1.0  # seconds between looks whether the driver is still there


def resolve(kwargs: dict[str, Any], manifest_path: str,
            on_load: Callable[[Shard], None] | None = None) -> dict[str, Any]:
    """``kwargs`` with every :class:`ShardArg` replaced by this rank's :class:`Shard`.

    The rank may start while its task still writes the shards: a shard then waits for the
    manifest on first use (the wait is bounded by the driver, which ends the job when a
    task's feed stops progressing; a failed feed raises :class:`FeedNotDelivered`, as do
    the task's directory removed and the driver's connection closed: a wait of the rank's
    own ends when the driver is gone, as on Spark Connect, where the client's end need not
    end the stage).
    ``on_load`` is called with each shard when it is first used.

    Raises:
        ConfigurationError: A DataFrame argument this rank was not fed (its ranks were
            started for other data).
    """
    global _job
    waiting = _Manifest(manifest_path) if manifest_path else None
    _job = _JobShards(waiting, on_load)
    wanted = [v.argument for v in kwargs.values() if isinstance(v, ShardArg)]
    if not wanted:
        return kwargs
    if waiting is None:
        raise ConfigurationError(f"this rank was not fed the DataFrame argument(s) {wanted}")
    if waiting.ready():
        waiting.check(wanted)
    return {k: _job.shard(v.argument) if isinstance(v, ShardArg) else v
            for k, v in kwargs.items()}


def settle(kwargs: dict[str, Any]) -> None:
    """Wait for every shard in ``kwargs`` the function did not use, and for the job's feed
    when it has one (DataFrames the function holds otherwise, such as a converter of
    :mod:`mlflow_hvd.petastorm`): a job whose data could not be fed fails even when its
    function never read it."""
    for value in kwargs.values():
        if isinstance(value, Shard):
            value._file  # noqa: B018 - loads it
    if _job is not None and _job.manifest is not None:
        _job.manifest.files()


def job_shard(argument: str) -> Shard | None:
    """This rank's shard of a DataFrame the job's code holds rather than receives as a
    keyword (a converter's, :mod:`mlflow_hvd.petastorm`): the same :class:`Shard` for
    every use in one job (its epochs count on). None outside a job (on the driver).

    Raises:
        ConfigurationError: Inside a job that was not fed ``argument``.
    """
    return None if _job is None else _job.shard(argument)


def open_shard(manifest_path: str, argument: str) -> Shard:
    """The :class:`Shard` of ``argument`` that a written manifest names (a feed written on
    the driver for the driver's own use)."""
    return Shard(_Manifest(manifest_path).file(argument))


class _JobShards:
    """The shards of the job this rank runs, made once per argument."""

    def __init__(self, manifest: _Manifest | None,
                 on_load: Callable[[Shard], None] | None) -> None:
        self.manifest, self._on_load = manifest, on_load
        self._shards: dict[str, Shard] = {}

    def shard(self, argument: str) -> Shard:
        if self.manifest is None:
            raise ConfigurationError(f"this rank was not fed the DataFrame argument(s) "
                                     f"{[argument]}")
        if argument not in self._shards:
            self._shards[argument] = Shard(functools.partial(self.manifest.file, argument),
                                           argument, self._on_load)
        return self._shards[argument]


_job: _JobShards | None = None  # set by :func:`resolve` for each job


class _Manifest:
    """A rank's manifest, read once its task has written it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._files: dict[str, ShardFile] | None = None

    def ready(self) -> bool:
        return os.path.exists(self.path)

    def check(self, wanted: list[str]) -> None:
        missing = [name for name in wanted if name not in self._read()]
        if missing:
            raise ConfigurationError(
                f"this rank was not fed the DataFrame argument(s) {missing}")

    def file(self, argument: str) -> ShardFile:
        self.check([argument])
        return self._read()[argument]

    def files(self) -> dict[str, ShardFile]:
        """Every argument's file, once the task has written them (waits)."""
        return self._read()

    def _read(self) -> dict[str, ShardFile]:
        if self._files is None:
            failed = os.path.join(os.path.dirname(self.path), FEED_FAILED_FILE)
            looked = time.monotonic()
            while not os.path.exists(self.path):
                if os.path.exists(failed):
                    with open(failed) as f:
                        raise FeedNotDelivered(f.read())
                if not os.path.isdir(os.path.dirname(self.path)):
                    raise FeedNotDelivered(
                        f"this rank's shards are gone: their task ended before writing them "
                        f"({os.path.dirname(self.path)} removed)")
                if time.monotonic() - looked > DRIVER_LOOK_EVERY:
                    looked = time.monotonic()
                    if context.driver_gone():
                        raise FeedNotDelivered(
                            "the mlflow_hvd driver closed this rank's connection while it "
                            "waited for its shards: the job is over")
                time.sleep(WAIT_POLL)
            with open(self.path) as f:
                self._files = {s.argument: s for s in load_manifest(f.read())}
        return self._files

"""Rank side: this rank's rows of one DataFrame argument, read from the Arrow IPC file its
task wrote on this host (:class:`Shard`), and the kwargs a rank's function receives with
each DataFrame replaced by its shard (:func:`resolve`).

Every rank of a job has exactly :attr:`Shard.rows` rows, so ``steps(batch_size)`` is the
same on every rank. Batches hold exactly ``batch_size`` rows (the last partial batch of a
pass is left out, on every rank alike). A pass reads the file through a memory map and
hands back the pages it has read, so a rank's memory does not grow with its shard.

Shuffling, per pass (``seed + epoch``: reproducible, different every epoch): the order of
the file's record batches is permuted, and rows are permuted within a window of
consecutive batches of that order (``window`` rows). Which rows a rank has does not change
between epochs: shards are fixed for the job (as with every partition-local feed).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.protocol.feed import ColumnKind, ShardArg, ShardFile, load_manifest

WINDOW_ROWS = 65536  # default rows shuffled together in memory
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

    def __init__(self, file: ShardFile) -> None:
        self._file = file
        self.argument = file.argument
        self.rows = file.rows
        self.columns = [c.name for c in file.columns]
        self.total_rows = file.total
        self.dropped = file.dropped
        self.next_epoch = 0
        self._widths = dict(file.widths)

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
                window: int = WINDOW_ROWS) -> Iterator[dict[str, np.ndarray]]:
        """One pass over the shard: ``steps(batch_size)`` dicts of column name -> numpy
        array of ``batch_size`` rows (arrays: ``(batch_size, width)``; binary and string
        columns: object arrays of ``bytes`` / ``str``).

        Args:
            columns: The columns to read (default: all).
            shuffle: Permute record batches and rows within ``window`` rows, from
                ``seed + epoch``; False reads the rows in file order.
            epoch: The pass's epoch (default: :attr:`next_epoch`, then counted up).
        """
        return self._pass(batch_size, columns, shuffle, seed, epoch, window).batches()

    def _pass(self, batch_size: int, columns: Sequence[str] | None, shuffle: bool, seed: int,
              epoch: int | None, window: int) -> _Pass:
        steps = self.steps(batch_size)
        names = list(columns) if columns is not None else self.columns
        unknown = sorted(set(names) - set(self.columns))
        if unknown:
            raise ConfigurationError(f"{self.argument}= has no column(s) {unknown}; it has "
                                     f"{self.columns}")
        if epoch is None:
            epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        rng = np.random.default_rng([seed, epoch]) if shuffle else None
        return _Pass(self._file.path, self.rows, names, self._widths, batch_size, steps,
                     rng, max(window, batch_size) if shuffle else batch_size)

    # --- TensorFlow ----------------------------------------------------------------------
    def tf_dataset(self, batch_size: int, *, label: str | None = "label",
                   features: Sequence[str] | None = None, shuffle: bool = True,
                   seed: int = 0, window: int = WINDOW_ROWS) -> Any:
        """A ``tf.data.Dataset`` of ``(features, label)`` batches with known cardinality
        (``steps(batch_size)``): ``model.fit(ds, epochs=n)`` needs no ``steps_per_epoch``.
        Each iteration (each epoch of ``fit``) is a new pass, shuffled for its epoch.

        ``features``: one column gives its array, several a dict of arrays (named model
        inputs); default: every column but ``label``. ``label=None``: features only.
        """
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
        dataset = dataset.unbatch().apply(tf.data.experimental.assert_cardinality(steps))
        return dataset.prefetch(2)

    # --- PyTorch -------------------------------------------------------------------------
    def torch_dataset(self, batch_size: int, *, label: str | None = "label",
                      features: Sequence[str] | None = None, shuffle: bool = True,
                      seed: int = 0, window: int = WINDOW_ROWS) -> Any:
        """A ``torch.utils.data.IterableDataset`` of ``(features, label)`` tensor batches
        (``len()`` is ``steps(batch_size)``), each iteration a new pass shuffled for its
        epoch; use it with ``DataLoader(ds, batch_size=None)`` (:meth:`torch_loader`).
        Binary and string columns stay lists of ``bytes`` / ``str``."""
        import torch

        steps = self.steps(batch_size)
        names, label = self._split(label, features)
        shard = self

        def tensor(array: np.ndarray) -> Any:
            return list(array) if array.dtype == object else torch.from_numpy(array)

        class ShardDataset(torch.utils.data.IterableDataset):
            def __len__(self) -> int:
                return steps

            def __iter__(self) -> Iterator[Any]:
                read = [*names, *([label] if label else [])]
                for batch in shard.batches(batch_size, columns=read, shuffle=shuffle,
                                           seed=seed, window=window):
                    x = tensor(batch[names[0]]) if len(names) == 1 else {
                        n: tensor(batch[n]) for n in names}
                    yield x if label is None else (x, tensor(batch[label]))

        return ShardDataset()

    def torch_loader(self, batch_size: int, **options: Any) -> Any:
        """``DataLoader(torch_dataset(batch_size, **options), batch_size=None)``: batches
        are made by the shard, in this process, and handed on as they are (tensors
        already: no per-batch conversion pass)."""
        import torch

        return torch.utils.data.DataLoader(self.torch_dataset(batch_size, **options),
                                           batch_size=None, collate_fn=_as_is)

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


class _Pass:
    """One pass over a shard file (see :meth:`Shard.batches`)."""

    def __init__(self, path: str, rows: int, names: list[str], widths: dict[str, int],
                 batch_size: int, steps: int, rng: np.random.Generator | None,
                 window: int) -> None:
        self.path, self.rows, self.names, self.widths = path, rows, names, widths
        self.batch_size, self.steps, self.rng, self.window = batch_size, steps, rng, window
        self._buffers: dict[str, np.ndarray] = {}

    def _target(self, name: str, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """The array a window's rows of ``name`` are put in: the same one for every window
        of the pass (numeric columns), so consumers copy a group before asking for the next
        (tf.data's ``from_generator`` does; :meth:`batches` copies each batch). A window's
        megabytes allocated again and again made glibc raise its mmap threshold and the
        heap grow with the number of windows of a pass (a rank's peak RSS +23% at 4x the
        rows in tf.data; +9% with this)."""
        if dtype.kind == "O":
            return np.empty(shape, dtype)
        buffer = self._buffers.get(name)
        if buffer is None or len(buffer) < shape[0]:
            buffer = self._buffers[name] = np.empty((shape[0] + self.batch_size, *shape[1:]),
                                                    dtype)
        return buffer[:shape[0]]

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        """The pass's batches, each its own arrays (a caller may keep them)."""
        for group in self.groups():
            for i in range(len(group[self.names[0]])):
                yield {n: a[i].copy() for n, a in group.items()}

    def groups(self) -> Iterator[dict[str, np.ndarray]]:
        """The pass's batches a window at a time: arrays of ``(batches, batch_size, ...)``,
        valid until the next group is asked for (see :meth:`_target`)."""
        import pyarrow as pa

        with open(self.path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        reader = pa.ipc.open_file(pa.py_buffer(mapped))
        counts = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int) if counts else []
        order = (self.rng.permutation(len(counts)) if self.rng is not None
                 else np.arange(len(counts)))
        pending: list[dict[str, np.ndarray]] = []
        pending_rows = 0
        for index in order:
            keep = min(counts[index], self.rows - int(starts[index]))
            if keep <= 0:
                continue
            pending.append(self._arrays(reader.get_batch(int(index)).slice(0, keep)))
            pending_rows += keep
            if pending_rows >= self.window:
                yield from self._emit(pending, final=False)
                pending_rows = len(next(iter(pending[0].values()))) if pending else 0
                _release(mapped)
        yield from self._emit(pending, final=True)
        _release(mapped)

    def _arrays(self, batch: Any) -> dict[str, np.ndarray]:
        out = {}
        for name in self.names:
            column = batch.column(name)
            width = self.widths.get(name)
            if width is not None:
                out[name] = column.flatten().to_numpy().reshape(-1, width)
            else:
                out[name] = column.to_numpy(zero_copy_only=False)
        return out

    def _emit(self, pending: list[dict[str, np.ndarray]], final: bool
              ) -> Iterator[dict[str, np.ndarray]]:
        """The full batches of the pending arrays (shuffled together), as one group; the
        rows short of a batch stay pending (or, at the end of the pass, are left out)."""
        if not pending:
            return
        total = sum(len(p[self.names[0]]) for p in pending)
        places = self.rng.permutation(total) if self.rng is not None else None
        merged = {}
        for n in self.names:
            first = pending[0][n]
            if places is None and len(pending) == 1:  # in file order: the rows as mapped
                merged[n] = first
                continue
            merged[n] = self._target(n, (total, *first.shape[1:]), first.dtype)
            if places is None:
                np.concatenate([p[n] for p in pending], out=merged[n])
                continue
            start = 0  # one copy: each row lands at its place in the permuted window
            for p in pending:
                merged[n][places[start:start + len(p[n])]] = p[n]
                start += len(p[n])
        total = len(merged[self.names[0]])
        full = total - total % self.batch_size
        if full:
            yield {n: a[:full].reshape(-1, self.batch_size, *a.shape[1:])
                   for n, a in merged.items()}
        pending.clear()
        if full < total and not final:
            pending.append({n: a[full:].copy() for n, a in merged.items()})


def _as_is(batch: Any) -> Any:
    """A DataLoader's ``collate_fn`` for batches that are tensors already."""
    return batch


def _release(mapped: mmap.mmap) -> None:
    """Hand the pages read so far back to the page cache: resident memory stays bounded
    by the window, not the file (pages are read again from the cache if needed)."""
    if hasattr(mmap, "MADV_DONTNEED") and len(mapped):
        mapped.madvise(mmap.MADV_DONTNEED)


def resolve(kwargs: dict[str, Any], manifest_path: str) -> dict[str, Any]:
    """``kwargs`` with every :class:`ShardArg` replaced by this rank's :class:`Shard`.

    Raises:
        ConfigurationError: A DataFrame argument this rank was not fed (its ranks were
            started for other data).
    """
    wanted = [v.argument for v in kwargs.values() if isinstance(v, ShardArg)]
    if not wanted:
        return kwargs
    files: dict[str, ShardFile] = {}
    if manifest_path and os.path.exists(manifest_path):
        with open(manifest_path) as f:
            files = {s.argument: s for s in load_manifest(f.read())}
    missing = [name for name in wanted if name not in files]
    if missing:
        raise ConfigurationError(f"this rank was not fed the DataFrame argument(s) {missing}")
    return {k: Shard(files[v.argument]) if isinstance(v, ShardArg) else v
            for k, v in kwargs.items()}

"""Rank side, PyTorch: a shard as a ``torch.utils.data.IterableDataset`` that
``DataLoader`` worker processes split between them (:class:`ShardDataset`).

PyTorch copies an ``IterableDataset`` into each worker process, and each copy iterates on
its own: a dataset that ignores this yields every row once per worker. Here each worker
runs the same pass (the same shuffle: ``seed`` and the pass's epoch) and keeps every
``k``-th batch, ``k`` the number of workers, starting at its worker id; the ``DataLoader``
takes one batch from each worker in turn, so the batches come out in the pass's order and
each row once. ``len()`` stays the pass's number of batches, the same on every rank.

Which epoch a pass is: the copies in the workers count passes, not the dataset in the
training process (which ``DataLoader`` never iterates when it has workers), and fresh
workers start each epoch from a fresh copy. So the passes are numbered in a small file
beside the shard, under a lock: the workers of one ``DataLoader`` iteration share its base
seed and have started as many passes each, which identifies the iteration; the first to
ask numbers it. That holds for forked, ``forkserver`` and ``spawn`` workers, with or
without ``persistent_workers``, and without workers (the training process counts).

Only what pickles travels (the shard file's description, the options and the transform,
by value), so the dataset works with the ``forkserver`` and ``spawn`` start methods
Horovod's examples use.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from mlflow_hvd.common.naming import callable_name
from mlflow_hvd.errors import DataInputError
from mlflow_hvd.protocol.feed import ShardFile
from mlflow_hvd.rank.passes import Pass, window_rows

Transform = Callable[[dict[str, Any]], dict[str, Any]]


class ShardDataset(torch.utils.data.IterableDataset):
    """One rank's shard as ``(features, label)`` batches (see the module docstring).

    Made by :meth:`mlflow_hvd.data.Shard.torch_dataset`; use it with
    ``DataLoader(ds, batch_size=None)`` and any ``num_workers``.
    """

    def __init__(self, file: ShardFile, batch_size: int, names: list[str], label: str | None,
                 steps: int, shuffle: bool, seed: int, window: int | None, start_epoch: int,
                 transform: Transform | None, rank: int) -> None:
        super().__init__()
        self.file, self.batch_size, self.names, self.label = file, batch_size, names, label
        self.steps, self.shuffle, self.seed, self.window = steps, shuffle, seed, window
        self.transform, self.rank = transform, rank
        self.start_epoch = start_epoch
        self._passes = 0  # passes this copy started
        self._counter = f"{file.path}.passes-{uuid.uuid4().hex[:12]}"

    def __len__(self) -> int:
        return self.steps

    def __getstate__(self) -> dict[str, Any]:
        """The transform travels by value (cloudpickle), so a lambda, a closure or a function
        of code sent to the rank by value works in ``forkserver`` and ``spawn`` workers."""
        import cloudpickle

        state = dict(self.__dict__)
        state["transform"] = cloudpickle.dumps(self.transform)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        import cloudpickle

        self.__dict__.update(state)
        self.transform = cloudpickle.loads(state["transform"])

    def set_epoch(self, epoch: int) -> None:
        """Number the next pass ``epoch`` (e.g. when resuming). Workers made after this
        call see it; ``persistent_workers`` made before do not."""
        self.start_epoch = epoch - self._epochs_so_far()

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        workers, me = (info.num_workers, info.id) if info is not None else (1, 0)
        key = f"{info.seed - info.id if info is not None else 'main'}:{self._passes}"
        self._passes += 1
        epoch = self.start_epoch + self._number(key)
        rng = np.random.default_rng([self.seed, epoch]) if self.shuffle else None
        read = [*self.names, *([self.label] if self.label else [])]
        one_pass = Pass(self.file.path, self.file.rows, read, dict(self.file.widths),
                         self.batch_size, self.steps, rng,
                         window_rows(self.file.path, self.file.written, self.window,
                                     self.batch_size, self.shuffle))
        index = 0
        for group in one_pass.groups():
            count = len(group[read[0]])
            if info is None and self.transform is None:
                # in the training process: the group's batches copied at once, each batch a
                # view (a copy and a buffer per batch cost more than reading it)
                columns = _Batch.of(group)
                for i in range(count):
                    yield self._pick({n: c[i] if isinstance(c, torch.Tensor) else list(c[i])
                                      for n, c in columns.items()})
                index += count
                continue
            for i in range(count):
                if index % workers == me:
                    yield self._output({n: a[i] for n, a in group.items()}, index, epoch)
                index += 1

    # --- a batch ----------------------------------------------------------------------------
    def _output(self, batch: dict[str, np.ndarray], index: int, epoch: int) -> Any:
        return self._pick(self._transformed(batch, index, epoch) if self.transform is not None
                          else _Batch.of(batch))

    def _pick(self, columns: dict[str, Any]) -> Any:
        x = columns[self.names[0]] if len(self.names) == 1 else {
            n: columns[n] for n in self.names}
        return x if self.label is None else (x, columns[self.label])

    def _transformed(self, batch: dict[str, np.ndarray], index: int,
                     epoch: int) -> dict[str, Any]:
        """The batch's rows through the transform, each written into the batch's output as
        it comes (in a worker, output in shared memory: it reaches the training process
        without another copy, and the rows' arrays are not all held at once)."""
        out: _Batch | None = None
        keys = list(batch)
        name = callable_name(self.transform)
        for i in range(self.batch_size):
            row = {k: batch[k][i] for k in keys}
            try:
                got = self.transform(row)  # type: ignore[misc]
            except Exception as exc:
                raise DataInputError(
                    f"rank {self.rank}: transform {name} failed on "
                    f"{self._where(index, i, epoch)}: {type(exc).__name__}: {exc}") from exc
            if not isinstance(got, dict):
                raise DataInputError(
                    f"rank {self.rank}: transform {name} must return a dict of "
                    f"the row's columns (as it was given one), got {type(got).__name__}")
            if out is None:
                out = _Batch(got, self.batch_size)
            problem = out.put(i, got)
            if problem:
                raise DataInputError(
                    f"rank {self.rank}: transform {name} returned, for "
                    f"{self._where(index, i, epoch)}, {problem}")
        assert out is not None
        return out.columns

    def _where(self, index: int, i: int, epoch: int) -> str:
        return (f"row {index * self.batch_size + i} of epoch {epoch}'s pass over "
                f"{self.file.argument}= (batch {index}, row {i} in it)")

    # --- pass numbers ---------------------------------------------------------------------
    def _number(self, key: str) -> int:
        """The number of the pass ``key`` names, agreed by every process iterating a copy
        of this dataset: assigned in order of first appearance."""
        with open(self._counter, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            text = f.read()
            numbers: dict[str, int] = json.loads(text) if text else {}
            if key not in numbers:
                numbers[key] = len(numbers)
                f.seek(0)
                f.truncate()
                f.write(json.dumps(numbers))
                f.flush()
            return numbers[key]

    def _epochs_so_far(self) -> int:
        if not os.path.exists(self._counter):
            return 0
        with open(self._counter) as f:
            text = f.read()
        return len(json.loads(text)) if text else 0


class _Batch:
    """The columns of one batch of transformed rows, filled row by row: numbers and arrays
    into tensors, strings, bytes and other objects into lists. The tensors are views of one
    buffer, in a ``DataLoader`` worker in shared memory: PyTorch hands a worker's tensors to
    the training process one shared buffer at a time (a file descriptor passed over a
    socket, ~0.4 ms each here), and would otherwise first copy each tensor into one."""

    def __init__(self, first: dict[str, Any], size: int) -> None:
        self.columns: dict[str, Any] = {}
        self._arrays: dict[str, np.ndarray] = {}
        layout: list[tuple[str, np.dtype[Any], tuple[int, ...], int]] = []
        end = 0
        for key, value in first.items():
            array = None if isinstance(value, bytes | str) else np.asarray(value)
            if array is None or array.dtype.kind in "OUSV":
                self.columns[key] = [None] * size
                continue
            self.columns[key] = None  # a tensor, below: the row's order of columns kept
            shape = (size, *array.shape)
            start = -(-end // 64) * 64  # each column at a 64-byte boundary
            layout.append((key, array.dtype, shape, start))
            end = start + int(np.prod(shape)) * array.dtype.itemsize
        buffer = torch.empty(end, dtype=torch.uint8)
        if torch.utils.data.get_worker_info() is not None:
            buffer.share_memory_()
        for key, dtype, shape, start in layout:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            tensor = buffer[start:start + nbytes].view(torch.from_numpy(
                np.empty(0, dtype)).dtype).view(shape)
            self.columns[key] = tensor
            self._arrays[key] = tensor.numpy()

    @classmethod
    def of(cls, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """A batch read from the shard (column -> array of rows), in the batch's buffer."""
        first = next(iter(batch.values()))
        out = cls({k: a[0] for k, a in batch.items()}, len(first))
        for key, array in batch.items():
            target = out._arrays.get(key)
            if target is None:
                out.columns[key] = list(array)
            else:
                target[...] = array
        return out.columns

    def put(self, i: int, row: dict[str, Any]) -> str | None:
        """Row ``i``; what is wrong with it if it does not fit the batch."""
        if row.keys() != self.columns.keys():
            return (f"the columns {sorted(row)}, but the batch's first row had "
                    f"{sorted(self.columns)}: return the same columns for every row")
        for key, value in row.items():
            target = self._arrays.get(key)
            if target is None:
                self.columns[key][i] = value
                continue
            array = np.asarray(value)
            if array.shape != target.shape[1:]:
                return (f"{key!r} of shape {array.shape}, but the batch's first row's was "
                        f"{target.shape[1:]}: rows of a batch are stacked, so return the same "
                        "shape for every row (e.g. crop or resize to a fixed size)")
            if array.dtype != target.dtype and not np.can_cast(array.dtype, target.dtype,
                                                               "same_kind"):
                return (f"{key!r} of type {array.dtype}, but the batch's first row's was "
                        f"{target.dtype}: return the same type for every row")
            target[i] = array
        return None


__all__ = ["ShardDataset", "Transform"]

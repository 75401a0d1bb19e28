"""Rank side (inside the training function): per-rank data sharding, every rank gets a
distinct, equal-size shard.

A Spark DataFrame passed to ``run`` arrives as this rank's :class:`Shard` (written by its
Spark task to this host; see docs/data.md). The helpers below
shard data every rank already holds (numpy arrays) or can read (a shared Parquet path).

Equal shard sizes matter in synchronous data-parallel training: with unequal shards one rank
runs out of batches first and the others block in an allreduce it never joins. The
remainder (``n % size`` rows) is therefore dropped; it is never more than ``size - 1`` rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.rank.shard import Shard

__all__ = ["Shard", "parquet_row_count", "read_parquet_shard", "shard_arrays", "shard_bounds",
           "shard_indices"]


def shard_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s contiguous shard of ``n`` rows.

    Every shard has ``n // size`` rows; the last ``n % size`` rows belong to no shard.

    Raises:
        ConfigurationError: ``size < 1``, ``rank`` outside ``[0, size)``, or fewer rows
            than ranks (some rank would get nothing to train on).
    """
    if size < 1:
        raise ConfigurationError(f"size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ConfigurationError(f"rank must be in [0, {size}), got {rank}")
    if n < size:
        raise ConfigurationError(
            f"cannot shard {n} rows over {size} ranks: every rank needs at least one row; "
            "use more data or fewer processes (np)"
        )
    per_rank = n // size
    return rank * per_rank, (rank + 1) * per_rank


def shard_indices(n: int, rank: int, size: int, seed: int | None = None) -> np.ndarray:
    """Row indices of ``rank``'s shard; with ``seed``, rows are shuffled first (the same
    permutation on every rank, so shards stay disjoint)."""
    start, stop = shard_bounds(n, rank, size)
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    return order[start:stop]


def shard_arrays(
    arrays: Sequence[np.ndarray], rank: int, size: int, seed: int | None = None
) -> list[np.ndarray]:
    """The same rows of every array (features, labels, ...) for ``rank``."""
    if not arrays:
        raise ConfigurationError("shard_arrays needs at least one array")
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ConfigurationError(
            f"arrays to shard have different lengths: {[len(a) for a in arrays]}"
        )
    idx = shard_indices(n, rank, size, seed)
    return [a[idx] for a in arrays]


def parquet_row_count(path: str) -> int:
    """Rows in a Parquet file or directory of files (from metadata only)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in _parquet_files(path))


def read_parquet_shard(
    path: str, rank: int, size: int, columns: Sequence[str] | None = None
) -> Any:
    """Read only ``rank``'s equal, contiguous shard of a Parquet data set.

    Files are taken in sorted name order; only the row groups that overlap the shard are
    read (so each rank reads about ``1/size`` of the data), then trimmed to the exact
    ``[start, stop)`` rows of :func:`shard_bounds`. Write the data shuffled: shards are
    contiguous.

    Returns:
        A ``pyarrow.Table`` with ``n // size`` rows.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = _parquet_files(path)
    counts = [pq.ParquetFile(f).metadata for f in files]
    total = sum(m.num_rows for m in counts)
    start, stop = shard_bounds(total, rank, size)
    pieces = []
    offset = 0
    for f, meta in zip(files, counts, strict=True):
        pf = pq.ParquetFile(f)
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            lo, hi = offset, offset + n
            offset = hi
            if hi <= start or lo >= stop:
                continue
            table = pf.read_row_group(g, columns=list(columns) if columns else None)
            pieces.append(table.slice(max(start - lo, 0), min(stop, hi) - max(start, lo)))
    return pa.concat_tables(pieces)


def _parquet_files(path: str) -> list[str]:
    import os

    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ConfigurationError(f"no Parquet data at {path!r}: not a file or directory")
    files = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(path)
        for name in names
        if name.endswith(".parquet") and not name.startswith((".", "_"))
    )
    if not files:
        raise ConfigurationError(f"no *.parquet files under {path!r}")
    return files

"""Per-rank sharding: disjoint, equal, covering everything but the documented remainder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlflow_hvd.data import (
    parquet_row_count,
    read_parquet_shard,
    shard_arrays,
    shard_bounds,
    shard_indices,
)
from mlflow_hvd.errors import ConfigurationError


@pytest.mark.parametrize(("n", "size"), [(10, 1), (10, 2), (10, 3), (1797, 4), (7, 7)])
def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder(n: int, size: int) -> None:
    shards = [set(shard_indices(n, r, size, seed=5).tolist()) for r in range(size)]
    assert {len(s) for s in shards} == {n // size}
    union = set().union(*shards)
    assert len(union) == (n // size) * size  # disjoint
    assert len(set(range(n)) - union) == n % size  # only the remainder is left out


def test_without_seed_shards_are_contiguous() -> None:
    assert [shard_bounds(10, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 9)]
    assert shard_indices(10, 1, 3).tolist() == [3, 4, 5]


def test_shard_arrays_keeps_rows_aligned() -> None:
    x = np.arange(20).reshape(10, 2)
    y = np.arange(10) * 100
    xs, ys = shard_arrays([x, y], 1, 2, seed=3)
    assert (xs[:, 0] // 2 * 100 == ys).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 0, 0), "size must be >= 1, got 0"),
        ((10, 2, 2), r"rank must be in \[0, 2\), got 2"),
        ((1, 0, 2), "cannot shard 1 rows over 2 ranks"),
    ],
)
def test_bad_shard_arguments(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        shard_bounds(*args)


def test_shard_arrays_rejects_misaligned_arrays() -> None:
    with pytest.raises(ConfigurationError, match=r"different lengths: \[3, 2\]"):
        shard_arrays([np.zeros(3), np.zeros(2)], 0, 1)
    with pytest.raises(ConfigurationError, match="at least one array"):
        shard_arrays([], 0, 1)


def test_parquet_shards_read_only_their_rows(tmp_path: Path) -> None:
    # 3 files x row groups of 4: shard boundaries fall inside row groups and across files
    for i in range(3):
        ids = np.arange(i * 10, i * 10 + 10)
        pq.write_table(pa.table({"id": ids, "x": ids * 2.0}), tmp_path / f"part-{i}.parquet",
                       row_group_size=4)
    (tmp_path / "_SUCCESS").write_text("")
    assert parquet_row_count(str(tmp_path)) == 30
    got = [read_parquet_shard(str(tmp_path), r, 4).column("id").to_pylist() for r in range(4)]
    assert got == [list(range(r * 7, r * 7 + 7)) for r in range(4)]  # 30 // 4 = 7, 2 dropped
    only_x = read_parquet_shard(str(tmp_path), 0, 2, columns=["x"])
    assert only_x.column_names == ["x"] and only_x.num_rows == 15


def test_parquet_path_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="not a file or directory"):
        read_parquet_shard(str(tmp_path / "missing"), 0, 1)
    with pytest.raises(ConfigurationError, match=r"no \*.parquet files under"):
        read_parquet_shard(str(tmp_path), 0, 1)

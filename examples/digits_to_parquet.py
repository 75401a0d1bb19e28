"""Write the digits training split as a Parquet data set for ``--data``.

    python examples/digits_to_parquet.py /tmp/digits_parquet [--files 4]

Columns ``p0``..``p63`` (pixels in [0, 1]) and ``label``; rows shuffled before writing,
because each rank reads one contiguous shard (mlflow_hvd.data.read_parquet_shard).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def write(path: str, files: int = 4, seed: int = 0, row_group_size: int = 128) -> int:
    from digits_keras import load_data

    x_train, y_train, _, _ = load_data(seed)
    order = np.random.default_rng(seed).permutation(len(x_train))
    flat = x_train.reshape(len(x_train), 64)[order]
    labels = y_train[order]
    os.makedirs(path, exist_ok=True)
    for i, idx in enumerate(np.array_split(np.arange(len(flat)), files)):
        table = pa.table({**{f"p{j}": flat[idx, j] for j in range(64)}, "label": labels[idx]})
        pq.write_table(table, os.path.join(path, f"part-{i:05d}.parquet"),
                       row_group_size=row_group_size)
    return len(flat)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--files", type=int, default=4)
    args = parser.parse_args()
    print(f"wrote {write(args.path, args.files)} rows to {args.path}")

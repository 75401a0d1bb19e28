"""Write the digits training split as a Parquet data set for ``--data``.

    python examples/digits_to_parquet.py /tmp/digits_parquet [--files 4]
    mlflow run . -P data=/tmp/digits_parquet

Columns ``pixels`` (64 floats in [0, 1], an array column) and ``label``. The training
entry point reads it with Spark (``spark.read.parquet``) and passes the DataFrame to
``run()``: each rank trains on its own partition, fed by its Spark task.
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
        pixels = pa.FixedSizeListArray.from_arrays(pa.array(flat[idx].ravel()), 64)
        table = pa.table({"pixels": pixels.cast(pa.list_(pa.float32())),
                          "label": labels[idx]})
        pq.write_table(table, os.path.join(path, f"part-{i:05d}.parquet"),
                       row_group_size=row_group_size)
    return len(flat)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--files", type=int, default=4)
    args = parser.parse_args()
    print(f"wrote {write(args.path, args.files)} rows to {args.path}")

"""The Petastorm arm of benchmarks/dataframe_feed.py, run in Petastorm's own venv:
``make_spark_converter`` on the benchmark's DataFrame, then two rank processes (shard 0 and
1 of 2) each reading ``PASSES`` passes into tf.data and as many into torch. Prints rank
0's figures as one JSON line.

    <petastorm venv>/bin/python benchmarks/petastorm_arm.py ROWS BATCH
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dataframe_feed import PASSES, PeakRss, count_rows, frame  # stdlib-only at import


def rank(converter: Any, shard: int, batch: int, t0: float, together: Any) -> dict[str, Any]:
    import petastorm.pytorch  # noqa: F401 - torch imported before the timed passes
    import tensorflow  # noqa: F401

    out: dict[str, Any] = {}
    with converter.make_tf_dataset(batch_size=batch, cur_shard=shard, shard_count=2,
                                   num_epochs=1) as ds:
        next(iter(ds))
        out["first_batch_s"] = time.time() - t0
    with converter.make_tf_dataset(batch_size=batch, cur_shard=shard, shard_count=2,
                                   num_epochs=PASSES) as ds:
        together.wait()  # both ranks begin each measured phase at once
        with PeakRss() as rss:
            start = time.perf_counter()
            rows = count_rows(ds)
            out["tf_rows_s"] = rows / (time.perf_counter() - start)
            with converter.make_torch_dataloader(batch_size=batch, cur_shard=shard,
                                                 shard_count=2, num_epochs=PASSES) as loader:
                together.wait()
                start, rows = time.perf_counter(), 0
                for b in loader:
                    rows += int(b["x"].shape[0])
                    float(b["label"].sum())
                out["torch_rows_s"] = rows / (time.perf_counter() - start)
        out["peak_rss_mib"] = rss.mib
    out["rows"] = rows // PASSES
    return out


def main() -> None:
    rows, batch = int(sys.argv[1]), int(sys.argv[2])
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.sql import SparkSession

    cache = tempfile.mkdtemp(prefix="petastorm-cache-")
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, f"file://{cache}")
    df = frame(spark, rows)
    t0 = time.time()
    converter = make_spark_converter(df)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs)
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(2) as pool:
        together = manager.Barrier(2)
        results = pool.starmap(rank, [(converter, r, batch, t0, together) for r in (0, 1)])
    converter.delete()
    spark.stop()
    shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({**results[0], "bytes": size, "rows_rank1": results[1]["rows"]}))


if __name__ == "__main__":
    main()

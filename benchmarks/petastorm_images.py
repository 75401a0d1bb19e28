"""The Petastorm arm of benchmarks/image_loader.py, run in Petastorm's own venv:
``make_spark_converter`` on the benchmark's DataFrame, then two rank processes (shard 0 and
1 of 2), each a ``make_torch_dataloader`` with a ``TransformSpec`` running the benchmark's
transform row by row: a warm-up epoch, then ``ROUNDS`` epochs, both ranks starting each
together, each a new loader, timed from its creation to its last batch.

    <petastorm venv>/bin/python benchmarks/petastorm_images.py ROWS SIZE CROP ROUNDS BATCH
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from image_loader import TreeRss, decode_crop_flip, frame  # numpy-only at import


def transform(pdf: Any, crop: int) -> Any:
    """The benchmark's row transform over one of Petastorm's pandas frames."""
    import pandas as pd

    rows = [decode_crop_flip({"image": image, "label": label}, crop)
            for image, label in zip(pdf["image"], pdf["label"], strict=True)]
    return pd.DataFrame({"image": [r["image"] for r in rows],
                         "label": [r["label"] for r in rows]})


def rank(converter: Any, shard: int, crop: int, rounds: int, batch: int,
         together: Any) -> dict[str, Any]:
    import numpy as np
    from petastorm import TransformSpec

    spec = TransformSpec(functools.partial(transform, crop=crop), edit_fields=[
        ("image", np.float32, (1, crop, crop), False)])

    def loader(epochs: int) -> Any:
        return converter.make_torch_dataloader(batch_size=batch, cur_shard=shard,
                                               shard_count=2, num_epochs=epochs,
                                               transform_spec=spec)

    rows = 0
    with loader(1) as warm:  # warm-up, and this shard's rows per epoch
        for b in warm:
            rows += len(b["image"])
    out: dict[str, Any] = {"epoch_s": [], "rows": rows}
    with TreeRss() as peak:
        for _ in range(rounds):
            together.wait()  # both ranks start each epoch at once
            start = time.perf_counter()  # the loader's start included, as in a training loop
            with loader(1) as one:
                for b in one:
                    len(b["image"])
            out["epoch_s"].append(time.perf_counter() - start)
    out["peak_mib"] = peak.mib
    return out


def main() -> None:
    rows, size, crop, rounds, batch = (int(v) for v in sys.argv[1:6])
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.sql import SparkSession

    cache = tempfile.mkdtemp(prefix="petastorm-cache-")
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "4g")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, f"file://{cache}")
    df = frame(spark, rows, size)
    t0 = time.perf_counter()
    converter = make_spark_converter(df)
    convert_s = time.perf_counter() - t0
    context = multiprocessing.get_context("spawn")
    try:
        with context.Manager() as manager, context.Pool(2) as pool:
            together = manager.Barrier(2)
            results = pool.starmap(rank, [(converter, r, crop, rounds, batch, together)
                                          for r in (0, 1)])
    finally:
        converter.delete()
        spark.stop()
        shutil.rmtree(cache, ignore_errors=True)
    rows_s = [(results[0]["rows"] + results[1]["rows"]) / max(a, b)  # the job's rows/s
              for a, b in zip(results[0]["epoch_s"], results[1]["epoch_s"], strict=True)]
    print(json.dumps({"rows_s": rows_s, "rows": [r["rows"] for r in results],
                      "peak_mib": results[0]["peak_mib"], "convert_s": convert_s}))


if __name__ == "__main__":
    main()

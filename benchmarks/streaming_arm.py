"""The Mosaic Streaming arm of benchmarks/streaming_feed.py, run in Mosaic Streaming's own venv:
``dataframe_to_mds`` of the data set's DataFrame to a local directory, then two rank
processes (``RANK``/``WORLD_SIZE``/``LOCAL_*`` and a Gloo process group, as torchrun gives
its workers) reading it through ``StreamingDataset`` + ``StreamingDataLoader``. Prints rank
0's figures as one JSON line.

    <streaming venv>/bin/python benchmarks/streaming_arm.py table|images ROWS PASSES
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import streaming_feed as bench  # noqa: E402 - stdlib-only at import

try:
    from streaming import StreamingDataset
except ImportError:  # the main venv (only streaming_feed.py's driver side runs there)
    StreamingDataset = object


# MDS encodings of the columns (x: a fixed shape; inferred, it would be "ndarray:float32")
COLUMNS = {"table": {"x": "ndarray:float32:64", "label": "int32"},
           "images": {"image": "bytes", "label": "int32"}}


class Decoded(StreamingDataset):  # type: ignore[misc, valid-type]
    """The images: a ``StreamingDataset`` whose samples go through the benchmark's transform
    (decode, crop, flip), as Mosaic's docs subclass it for a transform."""

    def __getitem__(self, index: int) -> Any:
        out = bench.transform("images")(super().__getitem__(index))
        return out["image"], out["label"]


def rank(r: int, port: int, local: str, kind: str, passes: int, t0: float,
         results: Any) -> None:
    os.environ.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from streaming import StreamingDataLoader

    sys.path.insert(0, HERE)
    import streaming_arm as arm  # the dataset class by an importable name (for the workers)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    batch = bench.SETS[kind]["batch"]
    kind_class = arm.Decoded if kind == "images" else StreamingDataset

    def loader(workers: int) -> Any:  # a dataset per loader: one iterated once cannot go to
        dataset = kind_class(local=local, batch_size=batch, shuffle=True)  # workers
        return StreamingDataLoader(dataset, batch_size=batch, **bench.loader_options(workers))

    first = iter(loader(0))
    bench.count(next(first))
    first_batch = time.time() - t0
    del first  # a pass begun, left (as the other arm)

    def together(name: str) -> None:
        dist.barrier()

    def gather(value: Any) -> list[Any]:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, value)
        return everyone

    out = bench.measure(loader, passes, together, gather)
    dist.barrier()
    dist.destroy_process_group()
    if r == 0:
        results.put({"first_batch_s": first_batch, **out})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    kind, rows, passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from pyspark.sql import SparkSession
    from streaming.base.converters import dataframe_to_mds
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()  # what an earlier run left, as Mosaic's docs advise

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "4g")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = bench.build_frame(spark, kind, rows)
    if kind == "table":  # dataframe_to_mds takes array<float> whose elements may be null only
        from pyspark.sql.types import ArrayType, FloatType
        df = df.withColumn("x", df["x"].cast(ArrayType(FloatType(), containsNull=True)))
    if kind == "images":
        df = df.cache()
        df.count()  # as the other arm: the PNGs are made before the clock starts
    root = tempfile.mkdtemp(prefix="mds-")
    local = os.path.join(root, "out")
    try:
        t0 = time.time()
        dataframe_to_mds(df, merge_index=True, mds_kwargs={"out": local, "columns": COLUMNS[kind]})
        written = sum(os.path.getsize(os.path.join(d, f))
                      for d, _, files in os.walk(local) for f in files)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        port = free_port()
        procs = [context.Process(target=rank, args=(r, port, local, kind, passes, t0, results))
                 for r in (0, 1)]
        for p in procs:
            p.start()
        out = None
        deadline = time.time() + 3000
        while out is None:
            try:
                out = results.get(timeout=5)
            except queue.Empty as empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.time() > deadline:
                    for p in procs:
                        p.kill()
                    raise SystemExit(f"the ranks failed ({failed}) or took over 3000 s"
                                     ) from empty
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise SystemExit(f"a rank process ended with {p.exitcode}")
        # the most on disk: reading a zstd shard writes it decompressed beside it
        written = max(written, sum(os.path.getsize(os.path.join(d, f))
                                   for d, _, files in os.walk(local) for f in files))
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({**out, "bytes": written}))


if __name__ == "__main__":
    main()

"""Decoding images in DataLoader worker processes: rows/s of a decode-bound pipeline with
2 workers against the same pipeline with none, on one rank.

The DataFrame: scikit-learn's digits rendered as ``--size`` x ``--size`` grayscale PNGs with
noise (so that decoding, not reading, dominates), repeated to ``--rows`` rows, built on a
``local[2]`` session and passed to ``HorovodRunner(np=-1).run``: one rank, so the machine's
second core is free for a second worker. In the rank, the shard's ``torch_loader`` runs
the same transform in both arms (PNG decode with PIL, a random crop back to ``--size - 8``,
a random flip, scale to float) and the loop only consumes the batches: the arms differ in
``num_workers`` (0, or 2 with ``forkserver`` and ``persistent_workers``) and nothing else.

Each round measures one epoch of each arm, in alternating order (AB, BA, ...), after one
warm-up epoch per arm (worker start-up is printed apart). Prints min/median/max rows/s per
arm and the ratio of the medians. Goal: 2 workers >= 1.6x no workers.

    .venv/bin/python benchmarks/image_loader.py [--rows 20000] [--size 96] [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
BATCH = 64


def frame(spark: Any, rows: int, size: int) -> Any:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    encoded = []
    for pixels in digits.images:
        big = np.kron(pixels / 16.0, np.ones((size // 8, size // 8)))
        noisy = np.clip(big * 200 + rng.normal(0, 25, big.shape), 0, 255).astype(np.uint8)
        png = io.BytesIO()
        Image.fromarray(noisy, mode="L").save(png, "PNG")
        encoded.append(png.getvalue())
    labels = digits.target.tolist()
    data = [(encoded[i % len(encoded)], int(labels[i % len(labels)])) for i in range(rows)]
    return spark.createDataFrame(data, "image binary, label int").repartition(2)


def decode_crop_flip(row: dict[str, Any]) -> dict[str, Any]:
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(row["image"])), dtype=np.float32) / 255.0
    rng = np.random.default_rng()
    y, x = rng.integers(0, 9, size=2)
    crop = image[y:y + image.shape[0] - 8, x:x + image.shape[1] - 8]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    return {"image": np.ascontiguousarray(crop)[None], "label": row["label"]}


def rank_rounds(data: Any, rounds: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)

    def loader(workers: int) -> Any:
        options: dict[str, Any] = {"num_workers": workers}
        if workers:
            options.update(multiprocessing_context="forkserver", persistent_workers=True)
        return data.torch_loader(BATCH, label="label", features=["image"],
                                 transform=decode_crop_flip, **options)

    def epoch(loaded: Any) -> float:
        start, rows = time.perf_counter(), 0
        for images, _ in loaded:
            rows += len(images)
        return rows / (time.perf_counter() - start)

    arms = {0: loader(0), 2: loader(2)}
    t0 = time.perf_counter()
    first = iter(arms[2])  # warm-up: starts the workers
    next(first)
    startup = time.perf_counter() - t0  # to the first batch, the workers' start included
    for _ in first:
        pass
    epoch(arms[0])
    seen: dict[int, list[float]] = {0: [], 2: []}
    for r in range(rounds):
        for workers in ((0, 2) if r % 2 == 0 else (2, 0)):
            seen[workers].append(epoch(arms[workers]))
    return {"rows_s": {str(k): v for k, v in seen.items()}, "workers_start_s": startup,
            "rows": data.rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    from mlflow_hvd import HorovodRunner, TrackingConfig

    spark = (SparkSession.builder.master("local[2]")
             .config("spark.driver.memory", "4g")  # the PNGs cross the driver's JVM once
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = frame(spark, args.rows, args.size)
    out = HorovodRunner(np=-1, tracking=TrackingConfig(track=False)).run(
        rank_rounds, data=df, rounds=args.rounds)
    print(f"{out['rows']} rows of {args.size}x{args.size} PNGs, batch {BATCH}, "
          f"{args.rounds} alternated rounds; first batch from fresh workers after "
          f"{out['workers_start_s']:.2f} s")
    for workers, values in out["rows_s"].items():
        print(f"  {workers} workers: rows/s min {min(values):,.0f} median "
              f"{statistics.median(values):,.0f} max {max(values):,.0f}")
    ratio = statistics.median(out["rows_s"]["2"]) / statistics.median(out["rows_s"]["0"])
    worst = min(out["rows_s"]["2"]) / max(out["rows_s"]["0"])
    print(f"  2 workers / 0 workers: {ratio:.2f}x (medians; worst pairing {worst:.2f}x); "
          "goal >= 1.6x")


if __name__ == "__main__":
    main()

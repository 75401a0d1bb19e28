"""Decoding images where the data is read: a decode-bound pipeline in DataLoader worker
processes, against the same pipeline without workers, PyTorch's own DataLoader over the
same rows in memory, and Petastorm's ``make_spark_converter`` + ``TransformSpec``.

The DataFrame: scikit-learn's digits rendered as ``--size`` x ``--size`` grayscale PNGs with
noise (so that decoding, not reading, dominates), repeated to ``--rows`` rows, built on a
``local[2]`` session. Every arm runs the same transform on every row (``decode_crop_flip``:
PNG decode with PIL, a random ``--crop`` x ``--crop`` crop (default ``--size - 8``), a random
flip, scale to float32) into batches of 64 ``(image, label)`` tensors that the loop only counts.

1. **One rank, workers** (``HorovodRunner(np=-1)``: the machine's second core is free for a
   second worker). Arms, in one rank process, each measured for one epoch per round, the
   arms' order rotating every round, after a warm-up epoch each (worker start-up apart):

   * ``shard.torch_loader(64, transform=...)`` with 0 and 2 workers (``forkserver``,
     ``persistent_workers``);
   * the PyTorch peer: the shard's rows in a list, a map-style ``Dataset`` whose
     ``__getitem__`` runs the transform, ``DataLoader(batch_size=64, shuffle=True)`` with 0
     and 2 workers, the same start method: what PyTorch itself does with these rows, so
     its 2-workers / 0-workers ratio is the most this machine gives.

2. **Two ranks against Petastorm** (``np=2``: each rank half the rows): ours with 0 and 2
   workers per rank; Petastorm (``dataframe_feed.PETASTORM``) in its own venv (as
   ``dataframe_feed.py`` builds it):
   ``make_spark_converter(df)``, then two processes each
   ``make_torch_dataloader(batch_size=64, cur_shard=r, shard_count=2,
   transform_spec=TransformSpec(...))`` running the same transform row by row on its
   pandas frames (its default pool: 4 threads), a new loader per epoch (its start timed).
   Per epoch, both ranks starting together, the job's rows/s: both ranks' rows over the
   slower rank's time (Petastorm shards by row group: its ranks' rows differ). Rank 0's
   peak memory: the PSS of the rank's process and its workers, summed, above that before
   the first epoch, sampled every 20 ms.

Prints min/median/max per arm and ratios of medians.

    .venv/bin/python benchmarks/image_loader.py [--rows 20000] [--size 96] [--rounds 5]
                                                [--no-petastorm]
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import random
import statistics
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from dataframe_feed import PETASTORM, PeakRss  # noqa: E402 - stdlib-only at import

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
BATCH = 64
START = "forkserver"


def frame(spark: Any, rows: int, size: int) -> Any:
    """The benchmark's DataFrame (also built by the Petastorm arm, in its own venv)."""
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


def decode_crop_flip(row: dict[str, Any], crop: int) -> dict[str, Any]:
    """The transform of every arm (with ``crop`` bound). Python's ``random``: PyTorch seeds
    it in each worker."""
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(row["image"])), dtype=np.float32) / 255.0
    y = random.randrange(image.shape[0] - crop + 1)
    x = random.randrange(image.shape[1] - crop + 1)
    patch = image[y:y + crop, x:x + crop]
    if random.random() < 0.5:
        patch = patch[:, ::-1]
    return {"image": np.ascontiguousarray(patch)[None], "label": row["label"]}


class RowsDataset:
    """The PyTorch peer: rows in memory, the transform in ``__getitem__`` (a map-style
    dataset: ``DataLoader`` batches, shuffles and collates it)."""

    def __init__(self, images: list[bytes], labels: list[int], crop: int) -> None:
        self.images, self.labels, self.crop = images, labels, crop

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Any:
        out = decode_crop_flip({"image": self.images[i], "label": self.labels[i]}, self.crop)
        return out["image"], out["label"]


class TreeRss(PeakRss):
    """Peak memory of this process and its children (DataLoader workers): their PSS
    (shared pages counted once, split between the processes mapping them), summed, above
    the sum at start; sampled every 20 ms."""

    EVERY = 0.02

    def _now(self) -> int:
        import psutil

        total = self._proc.memory_full_info().pss
        for child in self._proc.children(recursive=True):
            try:
                total += child.memory_full_info().pss
            except psutil.Error:
                pass  # a worker that just exited holds no memory
        return int(total)


def loader_options(workers: int) -> dict[str, Any]:
    """``DataLoader`` options of an arm with ``workers`` worker processes."""
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options.update(multiprocessing_context=START, persistent_workers=True)
    return options


def ours(data: Any, workers: int, crop: int) -> Any:
    """The shard's loader, the transform in its workers (or in the rank)."""
    return data.torch_loader(BATCH, label="label", features=["image"],
                             transform=functools.partial(decode_crop_flip, crop=crop),
                             **loader_options(workers))


def epoch_rows_s(loader: Any) -> float:
    start, rows = time.perf_counter(), 0
    for images, _ in loader:
        rows += len(images)
    return rows / (time.perf_counter() - start)


def rotate(arms: list[Any], r: int) -> list[Any]:
    """Round ``r``'s order of the arms: each arm in each position as often as the others."""
    k = r % len(arms)
    order = arms[k:] + arms[:k]
    return order if r % 2 == 0 else order[::-1]


def one_rank(data: Any, rounds: int, crop: int, here: str) -> dict[str, Any]:
    import torch

    sys.path.insert(0, here)  # the peer's Dataset class must import in the workers
    import image_loader as peer

    torch.set_num_threads(1)

    images, labels = [], []
    for batch in data.batches(BATCH, shuffle=False):
        images += list(batch["image"])
        labels += [int(v) for v in batch["label"]]
    rows = peer.RowsDataset(images, labels, crop)

    def plain(workers: int) -> Any:
        return torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=True,
                                           drop_last=True, **loader_options(workers))

    arms = {"ours 0": ours(data, 0, crop), "ours 2": ours(data, 2, crop),
            "torch 0": plain(0), "torch 2": plain(2)}
    start: dict[str, float] = {}
    for name, loader in arms.items():  # warm-up: starts the workers
        t0 = time.perf_counter()
        first = iter(loader)
        next(first)
        start[name] = time.perf_counter() - t0
        for _ in first:
            pass
    seen: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for name in rotate(list(arms), r):
            seen[name].append(epoch_rows_s(arms[name]))
    return {"rows_s": seen, "start_s": start, "rows": data.rows}


def two_ranks(data: Any, rounds: int, crop: int) -> dict[str, Any]:
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)

    arms = {"ours 0": ours(data, 0, crop), "ours 2": ours(data, 2, crop)}
    seen: dict[str, list[float]] = {name: [] for name in arms}
    rss: dict[str, float] = {}
    for name, loader in arms.items():
        hvd.allreduce(torch.zeros(1), name=f"warm {name}")
        with TreeRss() as peak:
            for _ in loader:
                pass
            for r in range(rounds):
                hvd.allreduce(torch.zeros(1), name=f"{name} {r}")  # both ranks at once
                start = time.perf_counter()
                for _ in loader:
                    pass
                slowest = max(hvd.allgather_object(time.perf_counter() - start))
                seen[name].append(data.steps(BATCH) * BATCH * hvd.size() / slowest)
        rss[name] = peak.mib
    return {"rows_s": seen, "peak_mib": rss, "rows": data.rows}


def petastorm(rows: int, size: int, crop: int, rounds: int) -> dict[str, Any]:
    from dataframe_feed import ensure_petastorm_venv, run_arm

    return run_arm(ensure_petastorm_venv(), "petastorm_images.py",
                   [rows, size, crop, rounds, BATCH], timeout=3600)


def line(name: str, values: list[float], unit: str) -> str:
    return (f"  {name:<26} min {min(values):>9,.0f}  median {statistics.median(values):>9,.0f}"
            f"  max {max(values):>9,.0f} {unit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--crop", type=int, default=None, help="default: size - 8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-petastorm", action="store_true")
    args = parser.parse_args()
    crop = args.crop or args.size - 8
    from pyspark.sql import SparkSession

    from mlflow_hvd import HorovodRunner, TrackingConfig

    spark = (SparkSession.builder.master("local[2]")
             .config("spark.driver.memory", "4g")  # the PNGs cross the driver's JVM once
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = frame(spark, args.rows, args.size).cache()
    df.count()
    untracked = TrackingConfig(track=False)
    one = HorovodRunner(np=-1, tracking=untracked).run(one_rank, data=df, rounds=args.rounds,
                                                        crop=crop, here=HERE)
    two = HorovodRunner(np=2, spark=spark, tracking=untracked).run(two_ranks, data=df,
                                                                   rounds=args.rounds, crop=crop)
    peta = None if args.no_petastorm else petastorm(args.rows, args.size, crop, args.rounds)
    spark.stop()

    med = {k: statistics.median(v) for k, v in one["rows_s"].items()}
    print(f"{one['rows']:,} rows of {args.size}x{args.size} PNGs -> float32 "
          f"{crop}x{crop}, batch {BATCH}, {START} workers, "
          f"{args.rounds} rounds")
    print("1. one rank (np=-1), rows/s per epoch:")
    for name, values in one["rows_s"].items():
        print(line(name + " workers", values,
                   f"rows/s  (first batch {one['start_s'][name]:.2f} s)"))
    print(f"  2 workers / 0 workers: ours {med['ours 2'] / med['ours 0']:.2f}x, "
          f"PyTorch's DataLoader {med['torch 2'] / med['torch 0']:.2f}x (goal >= 1.6x)")
    print(f"  ours / PyTorch's DataLoader: 0 workers {med['ours 0'] / med['torch 0']:.2f}x, "
          f"2 workers {med['ours 2'] / med['torch 2']:.2f}x")
    print(f"2. two ranks (np=2), {two['rows']:,} rows each; the job's rows/s (both ranks' rows "
          "over the slower rank's epoch), rank 0's peak memory:")
    for name, values in two["rows_s"].items():
        print(line(name + " workers", values, f"rows/s  peak {two['peak_mib'][name]:,.0f} MiB"))
    if peta is not None:
        print(line(f"petastorm {PETASTORM}", peta["rows_s"],
                   f"rows/s  peak {peta['peak_mib']:,.0f} MiB  "
                   f"(converter {peta['convert_s']:.1f} s; rows per rank "
                   f"{peta['rows'][0]:,} and {peta['rows'][1]:,})"))
        p = statistics.median(peta["rows_s"])
        for name, values in two["rows_s"].items():
            print(f"  {name} workers / petastorm: {statistics.median(values) / p:.2f}x rows/s, "
                  f"{two['peak_mib'][name] / peta['peak_mib']:.2f}x peak memory")


if __name__ == "__main__":
    main()

"""A Spark DataFrame into two PyTorch ranks: mlflow_hvd's feed against Mosaic Streaming, what
Databricks advises today for Spark data into PyTorch.

Two data sets, each built the same way in both environments (pyspark 4.3, the same seeds):

* ``table``: the 1M x float[64] + label DataFrame of ``dataframe_feed.py``, batch 256, each
  rank ``--passes`` passes over its half;
* ``images``: the 20,000 96x96 PNGs of ``image_loader.py``, batch 64, every row decoded,
  cropped and flipped (``decode_crop_flip``) where it is read, each rank one pass per round.

Arms, the same work on the same rows, two ranks on this one machine:

* **mlflow_hvd**: ``HorovodRunner(np=2).run(fn, data=df)`` on a ``local[2]`` session; each rank
  reads ``shard.torch_loader(batch, ...)`` (shuffled).
* **Mosaic Streaming** 0.13.0 in its own venv (``~/.cache/mlflow_hvd/streaming-venv``: it wants
  numpy < 2.2, torchvision (so PyPI's torch, a CUDA build that runs on a CPU), transformers
  and cloud SDKs): ``dataframe_to_mds(df, merge_index=True, mds_kwargs={"out": <local dir>,
  "columns": ...})`` (its default zstd compression; ``x`` cast to an array of nullable floats,
  the only float array it takes, encoded as ``ndarray:float32:64``), then two processes
  started like torchrun's workers (``RANK``, ``WORLD_SIZE``, ``LOCAL_*``, a Gloo process
  group) each reading ``StreamingDataset(local=<dir>, batch_size=batch, shuffle=True)``
  through ``StreamingDataLoader`` (for the images a ``StreamingDataset`` whose
  ``__getitem__`` runs the transform, as its docs show).

Per arm and round: time from ``run()`` (Mosaic: from ``dataframe_to_mds``) to rank 0's first
batch, everything before it included (writing the shards, starting the ranks); the most bytes
on disk (Mosaic decompresses a shard beside it when it reads it); then with 0 and with 2
DataLoader workers (``forkserver``, persistent): the job's rows/s (both ranks' rows over the
slower rank's time, the ranks starting together, timed from each loader's first batch) and
rank 0's peak memory (PSS of the rank and its workers above the rank's before the loader was
made, sampled every 20 ms). Arms alternate every round; prints min/median/max per arm and the
ratios of medians.

    .venv/bin/python benchmarks/streaming_feed.py [--data table|images] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
STREAMING_VENV = os.path.expanduser("~/.cache/mlflow_hvd/streaming-venv")
STREAMING_PACKAGES = ["mosaicml-streaming==0.13.0", "torch==2.13.0", "torchvision==0.28.0",
                      "pyspark==4.3.0",
                      "numpy<2.2", "pandas", "pyarrow", "psutil", "pillow", "scikit-learn"]
WORKERS = (0, 2)
START = "forkserver"
SETS = {"table": {"rows": 1_000_000, "batch": 256},
        "images": {"rows": 20_000, "batch": 64, "size": 96}}
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def build_frame(spark: Any, data: str, rows: int) -> Any:
    """The data set's DataFrame (the same in both environments)."""
    if data == "table":
        from dataframe_feed import frame
        return frame(spark, rows)
    from image_loader import frame as images
    return images(spark, rows, SETS["images"]["size"])


def transform(data: str) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """The per-row transform of the data set (images: decode, crop, flip)."""
    if data == "table":
        return None
    import functools

    from image_loader import decode_crop_flip
    return functools.partial(decode_crop_flip, crop=SETS["images"]["size"] - 8)


def loader_options(workers: int) -> dict[str, Any]:
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options.update(multiprocessing_context=START, persistent_workers=True)
    return options


def count(batch: Any) -> int:
    """Rows of a batch, its labels touched as a training step would."""
    if isinstance(batch, dict):  # Mosaic's default collate: a dict of columns
        features, labels = batch["x"], batch["label"]
    else:
        features, labels = batch[0], batch[1]
    float(labels.sum())
    return int(features.shape[0])


def measure(make_loader: Callable[[int], Iterable[Any]], passes: int,
            together: Callable[[str], None], gather: Callable[[Any], list[Any]]
            ) -> dict[str, Any]:
    """On every rank, for 0 and 2 workers: ``passes`` passes, the ranks starting together,
    timed from the first batch (the workers' start-up apart). Returns the job's rows/s and
    this rank's peak memory."""
    from image_loader import TreeRss

    out: dict[str, Any] = {}
    for workers in WORKERS:
        together(f"start {workers}")
        with TreeRss() as peak:
            loader = make_loader(workers)
            batches = iter(loader)
            count(next(batches))  # the workers are up
            together(f"timed {workers}")
            start, rows = time.perf_counter(), 0
            for i in range(passes):
                for batch in (batches if i == 0 else loader):
                    rows += count(batch)
            mine = (rows, time.perf_counter() - start)
        everyone = gather(mine)
        out[f"rows_s_{workers}"] = sum(r for r, _ in everyone) / max(t for _, t in everyone)
        out[f"peak_mib_{workers}"] = peak.mib
        out[f"rows_{workers}"] = [r // passes for r, _ in everyone]
        del loader
    return out


def ours_rank(data: Any, kind: str, batch: int, passes: int, t0: float, here: str
              ) -> dict[str, Any]:
    import horovod.torch as hvd
    import torch

    sys.path.insert(0, here)
    import streaming_feed as bench

    hvd.init()
    torch.set_num_threads(1)
    options: dict[str, Any] = {"label": "label",
                               "features": ["x"] if kind == "table" else ["image"]}
    if kind == "images":
        options["transform"] = bench.transform(kind)
    first = iter(data.torch_loader(batch, **options))
    bench.count(next(first))
    first_batch = time.time() - t0
    del first  # a pass begun, left (as the other arm)
    written = sum(hvd.allgather_object(os.path.getsize(data._file.path)))

    def together(name: str) -> None:
        hvd.allreduce(torch.zeros(1), name=name)

    out = bench.measure(lambda w: data.torch_loader(batch, **options, **bench.loader_options(w)),
                        passes, together, hvd.allgather_object)
    return {"first_batch_s": first_batch, "bytes": written, **out}


def ours(spark: Any, kind: str, rows: int, passes: int) -> dict[str, Any]:
    from mlflow_hvd import HorovodRunner, TrackingConfig

    df = build_frame(spark, kind, rows)
    if kind == "images":  # as the other arm: the PNGs are made before the clock starts
        df = df.cache()
        df.count()
    t0 = time.time()
    try:
        return HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)).run(
            ours_rank, data=df, kind=kind, batch=SETS[kind]["batch"], passes=passes, t0=t0,
            here=HERE)
    finally:
        df.unpersist()


def ensure_streaming_venv() -> str:
    """Mosaic Streaming's venv, made (or completed) with ``STREAMING_PACKAGES``, from the
    package index alone: its torchvision needs PyPI's torch (a CUDA build; it runs on a
    CPU), not a +cpu wheel a pip configuration may point at."""
    from dataframe_feed import ensure_venv

    return ensure_venv(STREAMING_VENV, STREAMING_PACKAGES, PIP_FIND_LINKS=None,
                       PIP_CONFIG_FILE=os.devnull)


def mosaic(python: str, kind: str, rows: int, passes: int) -> dict[str, Any]:
    from dataframe_feed import run_arm

    return run_arm(python, "streaming_arm.py", [kind, rows, passes], timeout=3600)


def line(name: str, values: list[float], unit: str) -> str:
    return (f"  {name:<34} min {min(values):>11,.1f}  median "
            f"{statistics.median(values):>11,.1f}  max {max(values):>11,.1f} {unit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=sorted(SETS), default="table")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--passes", type=int, default=None,
                        help="timed passes over each rank's rows per worker setting")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = args.rows or SETS[args.data]["rows"]
    passes = args.passes or 1

    from pyspark.sql import SparkSession

    python = ensure_streaming_venv()
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "4g")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.local.dir", tempfile.mkdtemp()).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    arms: dict[str, Callable[[], dict[str, Any]]] = {
        "mlflow_hvd": lambda: ours(spark, args.data, rows, passes),
        "Mosaic Streaming": lambda: mosaic(python, args.data, rows, passes),
    }
    seen: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            seen[name].append(arms[name]())
            print(f"round {r + 1} {name}: {seen[name][-1]}", flush=True)
    spark.stop()

    print(f"\n{args.data}: {rows:,} rows, np=2, batch {SETS[args.data]['batch']}, "
          f"{passes} timed pass(es) per worker setting, {args.rounds} alternated rounds")
    keys = [("first_batch_s", "s"), ("bytes", "bytes")]
    for w in WORKERS:
        keys += [(f"rows_s_{w}", f"rows/s, {w} workers"), (f"peak_mib_{w}", f"MiB, {w} workers")]
    med: dict[tuple[str, str], float] = {}
    for key, unit in keys:
        print(f"{key}:")
        for name, rounds in seen.items():
            values = [float(r[key]) for r in rounds]
            med[name, key] = statistics.median(values)
            print(line(name, values, unit))
    print("rows per rank (per pass):", {n: s[0]["rows_0"] for n, s in seen.items()})
    print("\nratios of medians, mlflow_hvd / Mosaic Streaming:")
    for key, _ in keys:
        other = med["Mosaic Streaming", key]
        print(f"  {key}: {med['mlflow_hvd', key] / other:.2f}" if other else f"  {key}: -")


if __name__ == "__main__":
    main()

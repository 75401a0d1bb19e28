"""A Spark DataFrame into two ranks' training loops: mlflow_hvd's feed vs Petastorm, and
the floor (a plain pyarrow loop over the very file mlflow_hvd wrote).

The same DataFrame in every arm: ``spark.range(rows)`` with ``x`` = 64 floats of
``rand(seed)`` and an int ``label``, built in memory on a ``local[2]`` session (pyspark
4.3 in both environments: the same seeds give the same rows). Two ranks each read their
half, batch 256, ``PASSES`` passes into ``tf.data`` and as many into a torch loop; rank 0's
figures are reported. Both ranks begin each measured phase together (an allreduce before
it), so each phase competes only with the same phase of the other rank:

* mlflow_hvd: ``HorovodRunner(np=2).run(fn, data=df)``; each rank iterates
  ``shard.tf_dataset(256)`` and ``shard.torch_dataset(256)`` (shuffled; RSS measured over
  these), ``shard.torch_loader(256)`` (the same through a ``DataLoader``), then both in
  file order (``shuffle=False``: the floor's work).
* floor: in the same rank, right after, the same file read record batch by record batch
  into pre-batched numpy (no shuffle), through ``tf.data.Dataset.from_generator`` (a
  record batch's full batches per element, then ``unbatch``, as ours) and
  ``torch.from_numpy`` - what any Arrow-file reader must at least do.

A tf.data pass is consumed in graph mode (``Dataset.reduce``), as ``model.fit`` consumes
it; a torch pass by a Python loop over the loader, as a training loop does.
* Petastorm (``PETASTORM``, 0.12.1) ``make_spark_converter(df)``, the path Databricks'
  HorovodRunner docs name, in its own venv (``~/.cache/mlflow_hvd/petastorm-venv``: pyarrow
  14 and numpy < 2, which it needs and the project's environment cannot have; 0.13.1 does
  not install beside torch 2.13, see ``PETASTORM``); the converter's cache is on local disk
  because this is one machine (a cluster needs DBFS/NFS every node sees).
  ``make_tf_dataset`` / ``make_torch_dataloader`` with ``cur_shard=rank, shard_count=2``,
  two processes at once.

* mlflow_hvd.petastorm: the Petastorm arm's code (the same calls, ``num_epochs=PASSES``
  streams) on ``make_spark_converter`` from ``mlflow_hvd.petastorm``, in
  ``HorovodRunner(np=2)``: the same feed as ``run(fn, data=df)``, Petastorm's face.

Also: time from ``run()`` (or ``make_spark_converter``) to rank 0's first batch, rank 0's
peak RSS during its passes (above its RSS before them; sampled every 10 ms), bytes written,
and mlflow_hvd at ``--scale`` times the rows (peak RSS must not grow with the shard).
Rounds alternate the arms; prints min/median/max per arm and the ratios of medians.

    .venv/bin/python benchmarks/dataframe_feed.py [--rows 1000000] [--rounds 3] [--scale 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PETASTORM_VENV = os.path.expanduser("~/.cache/mlflow_hvd/petastorm-venv")
# Not 0.13.1 (2026-01): it needs setuptools < 70 and torch 2.13 needs setuptools >= 77.0.3,
# so no environment holds both (pip: ResolutionImpossible, checked 2026-12-05)
PETASTORM = "0.12.1"
PETASTORM_PACKAGES = [f"petastorm=={PETASTORM}", "pyarrow==14.0.2", "numpy<2", "pandas<2.2",
                      "tensorflow-cpu==2.18.1", "pyspark==4.3.0", "psutil", "torch==2.13.0",
                      "pillow", "scikit-learn"]  # the last two: image_loader.py's frame
BATCH = 256
PASSES = 3  # passes per measurement (a pass over 500k rows takes well under a second)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def frame(spark: Any, rows: int) -> Any:
    """The benchmark's DataFrame (also built by the Petastorm arm, in its own venv)."""
    from pyspark.sql import functions as F

    return spark.range(0, rows, 1, 8).select(
        F.array(*[F.rand(seed=i).cast("float") for i in range(64)]).alias("x"),
        (F.col("id") % 10).cast("int").alias("label"))


class PeakRss:
    """Peak RSS of this process above its RSS at start, sampled every 10 ms."""

    def __enter__(self) -> PeakRss:
        import threading

        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    EVERY = 0.01  # seconds between samples

    def _now(self) -> int:
        return int(self._proc.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.wait(self.EVERY):
            self.peak = max(self.peak, self._now())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2**20


def count_rows(dataset: Any) -> int:
    """One pass through a tf.data pipeline in graph mode (as ``model.fit`` runs it), counting
    the rows of its batches' first component."""
    import tensorflow as tf

    def add(total: Any, batch: Any) -> Any:
        return total + tf.cast(tf.shape(tf.nest.flatten(batch)[0])[0], tf.int64)

    return int(dataset.reduce(tf.constant(0, tf.int64), add))


def rank_passes(data: Any, t0: float) -> dict[str, Any]:
    """On every rank: first batch, a tf.data pass and a torch pass through the shard, then
    the floor over the same file. Rank 0's figures are returned."""
    import horovod.tensorflow as hvd
    import numpy as np
    import pyarrow as pa
    import tensorflow as tf
    import torch

    hvd.init()
    ds = data.tf_dataset(BATCH, label="label", features=["x"])
    next(iter(ds))
    first_batch = time.time() - t0
    out: dict[str, Any] = {"first_batch_s": first_batch, "rows": data.rows,
                           "bytes": os.path.getsize(data._file.path)}

    def together(name: str) -> None:  # both ranks start each measured phase at once
        hvd.allreduce(tf.constant(0.0), name=name)

    def torch_passes(batches: Any) -> float:
        start, rows = time.perf_counter(), 0
        for _ in range(PASSES):
            for x, y in batches:
                rows += int(x.shape[0])
                float(y.sum())
        return rows / (time.perf_counter() - start)

    together("passes")
    with PeakRss() as rss:
        start, rows = time.perf_counter(), 0
        for _ in range(PASSES):
            rows += count_rows(ds)
        out["tf_rows_s"] = rows / (time.perf_counter() - start)
        together("torch")
        out["torch_rows_s"] = torch_passes(data.torch_dataset(BATCH, features=["x"]))
        together("torch loader")
        out["loader_rows_s"] = torch_passes(data.torch_loader(BATCH, features=["x"]))
    out["peak_rss_mib"] = rss.mib
    # the same work as the floor: file order, no shuffle
    together("in order")
    in_order = data.tf_dataset(BATCH, label="label", features=["x"], shuffle=False)
    start, rows = time.perf_counter(), 0
    for _ in range(PASSES):
        rows += count_rows(in_order)
    out["in_order_tf_rows_s"] = rows / (time.perf_counter() - start)
    together("torch in order")
    out["in_order_torch_rows_s"] = torch_passes(
        data.torch_dataset(BATCH, features=["x"], shuffle=False))

    def floor_groups() -> Any:  # a record batch's full batches at a time, as ours
        return floor_batches(grouped=True)

    def floor_batches(grouped: bool = False) -> Any:
        reader = pa.ipc.open_file(pa.memory_map(data._file.path))
        carry_x = carry_y = None
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            x = batch.column("x").flatten().to_numpy().reshape(-1, 64)
            y = batch.column("label").to_numpy()
            if carry_x is not None:
                x, y = np.concatenate([carry_x, x]), np.concatenate([carry_y, y])
            full = len(x) - len(x) % BATCH
            if grouped and full:
                yield (x[:full].reshape(-1, BATCH, 64), y[:full].reshape(-1, BATCH))
            for s in range(0, full if not grouped else 0, BATCH):
                yield x[s:s + BATCH], y[s:s + BATCH]
            carry_x, carry_y = x[full:], y[full:]

    spec = (tf.TensorSpec((None, BATCH, 64), tf.float32), tf.TensorSpec((None, BATCH), tf.int32))
    floor = tf.data.Dataset.from_generator(floor_groups, output_signature=spec).unbatch()
    floor = floor.prefetch(2)
    together("floor")
    start, rows = time.perf_counter(), 0
    for _ in range(PASSES):
        rows += count_rows(floor)
    out["floor_tf_rows_s"] = rows / (time.perf_counter() - start)
    together("floor torch")
    start, rows = time.perf_counter(), 0
    for _ in range(PASSES):
        for x, y in floor_batches():
            rows += int(torch.from_numpy(x).shape[0])
            float(torch.from_numpy(y).sum())
    out["floor_torch_rows_s"] = rows / (time.perf_counter() - start)
    hvd.allreduce(tf.constant(0.0), name="done")  # rank 1 finishes its passes too
    return out


def converter_passes(converter: Any, t0: float) -> dict[str, Any]:
    """On every rank: the Petastorm arm's work (``petastorm_arm.rank``) through
    ``mlflow_hvd.petastorm``'s converter: the first batch, ``PASSES`` passes into tf.data
    and as many into torch, each a stream of ``num_epochs=PASSES``."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    import torch  # noqa: F401 - imported before the timed passes, as in every arm

    from mlflow_hvd.rank.shard import job_shard

    hvd.init()
    shard = {"cur_shard": hvd.rank(), "shard_count": hvd.size()}
    out: dict[str, Any] = {}
    with converter.make_tf_dataset(batch_size=BATCH, num_epochs=1, **shard) as ds:
        next(iter(ds))
        out["first_batch_s"] = time.time() - t0
    with converter.make_tf_dataset(batch_size=BATCH, num_epochs=PASSES, **shard) as ds:
        hvd.allreduce(tf.constant(0.0), name="tf")  # both ranks begin each phase at once
        with PeakRss() as rss:
            start = time.perf_counter()
            rows = count_rows(ds)
            out["tf_rows_s"] = rows / (time.perf_counter() - start)
            with converter.make_torch_dataloader(batch_size=BATCH, num_epochs=PASSES,
                                                 **shard) as loader:
                hvd.allreduce(tf.constant(0.0), name="torch")
                start, rows = time.perf_counter(), 0
                for b in loader:
                    rows += int(b["x"].shape[0])
                    float(b["label"].sum())
                out["torch_rows_s"] = rows / (time.perf_counter() - start)
        out["peak_rss_mib"] = rss.mib
    out["rows"] = rows // PASSES
    out["bytes"] = os.path.getsize(job_shard(converter.argument)._file.path)
    hvd.allreduce(tf.constant(0.0), name="done")
    return out


def converter_round(spark: Any, rows: int) -> dict[str, Any]:
    from mlflow_hvd import HorovodRunner, TrackingConfig
    from mlflow_hvd.petastorm import make_spark_converter

    df = frame(spark, rows)
    t0 = time.time()
    converter = make_spark_converter(df)  # Petastorm's arm times its converter too
    try:
        return HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)).run(
            lambda: converter_passes(converter, t0))
    finally:
        converter.delete()


def mlflow_hvd_round(spark: Any, rows: int) -> dict[str, Any]:
    from mlflow_hvd import HorovodRunner, TrackingConfig

    df = frame(spark, rows)
    t0 = time.time()
    return HorovodRunner(np=2, spark=spark, tracking=TrackingConfig(track=False)).run(rank_passes,
        data=df, t0=t0)


def ensure_venv(venv: str, packages: list[str], **pip_env: str | None) -> str:
    """A peer's venv at ``venv``, made (or completed) with ``packages``; ``pip_env``: the
    variables pip gets (None: unset). Returns its python."""
    python = os.path.join(venv, "bin", "python")
    marker = os.path.join(venv, ".complete")
    wanted = "\n".join(packages)
    done = None
    if os.path.exists(marker):
        with open(marker) as f:
            done = f.read()
    if done != wanted:
        if not os.path.exists(python):
            base = os.path.expanduser("~/.pyenv/versions/3.11.7/bin/python")
            subprocess.run([base if os.path.exists(base) else sys.executable, "-m", "venv",
                            venv], check=True)
        env = {k: v for k, v in os.environ.items() if k not in pip_env}
        env.update({k: v for k, v in pip_env.items() if v is not None})
        subprocess.run([python, "-m", "pip", "install", "-q", *packages], check=True, env=env)
        with open(marker, "w") as f:
            f.write(wanted)
    return python


def ensure_petastorm_venv() -> str:
    """Petastorm's venv (``PETASTORM_PACKAGES``; torch's CPU wheel from /opt/wheels)."""
    return ensure_venv(PETASTORM_VENV, PETASTORM_PACKAGES, PIP_FIND_LINKS="/opt/wheels")


def run_arm(python: str, script: str, args: list[Any], timeout: float) -> dict[str, Any]:
    """A peer's arm: ``script`` (in benchmarks/) run by its venv's ``python``, its Spark
    workers in that venv too; the figures are the last line it prints, as JSON."""
    env = {**os.environ, "PYSPARK_PYTHON": python, "PYTHONPATH": ""}
    proc = subprocess.run([python, os.path.join(REPO, "benchmarks", script), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{proc.stderr[-4000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def petastorm_round(python: str, rows: int) -> dict[str, Any]:
    return run_arm(python, "petastorm_arm.py", [rows, BATCH], timeout=1800)


def _line(name: str, values: list[float], unit: str) -> str:
    return (f"  {name:<34} min {min(values):>10,.1f}  median {statistics.median(values):>10,.1f}"
            f"  max {max(values):>10,.1f} {unit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--no-petastorm", action="store_true")
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    python = None if args.no_petastorm else ensure_petastorm_venv()
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.local.dir", tempfile.mkdtemp()).getOrCreate())
    ours: list[dict[str, Any]] = []
    big: list[dict[str, Any]] = []
    peta: list[dict[str, Any]] = []
    conv: list[dict[str, Any]] = []
    for r in range(args.rounds):
        ours.append(mlflow_hvd_round(spark, args.rows))
        if python:
            peta.append(petastorm_round(python, args.rows))
        conv.append(converter_round(spark, args.rows))
        big.append(mlflow_hvd_round(spark, args.rows * args.scale))
        print(f"round {r + 1}: mlflow_hvd {ours[-1]}\n  x{args.scale} {big[-1]}"
              f"\n  mlflow_hvd.petastorm {conv[-1]}"
              + (f"\n  petastorm {peta[-1]}" if peta else ""), flush=True)

    def med(rounds: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    print(f"\n{args.rows:,} rows x float[64] + label, np=2, batch {BATCH}, rank 0, "
          f"{args.rounds} alternated rounds")
    for key, unit in [("tf_rows_s", "rows/s"), ("torch_rows_s", "rows/s"),
                      ("first_batch_s", "s"), ("peak_rss_mib", "MiB"), ("bytes", "bytes")]:
        print(f"{key}:")
        print(_line("mlflow_hvd", [r[key] for r in ours], unit))
        print(_line(f"mlflow_hvd x{args.scale} rows", [r[key] for r in big], unit))
        print(_line("mlflow_hvd.petastorm converter", [r[key] for r in conv], unit))
        if peta:
            print(_line(f"petastorm {PETASTORM}", [r[key] for r in peta], unit))
        if key in ("tf_rows_s", "torch_rows_s"):
            print(_line("mlflow_hvd in file order", [r[f"in_order_{key}"] for r in ours], unit))
            print(_line("floor (pyarrow loop, in order)", [r[f"floor_{key}"] for r in ours],
                        unit))
        if key == "torch_rows_s":
            print(_line("mlflow_hvd torch_loader", [r["loader_rows_s"] for r in ours], unit))
    print("\nratios of medians:")
    for key in ("tf_rows_s", "torch_rows_s"):
        floor = med(ours, "floor_" + key)
        print(f"  {key}: in file order / floor = {med(ours, 'in_order_' + key) / floor:.2f} "
              f"(the same work), shuffled / floor = {med(ours, key) / floor:.2f}"
              + (f", shuffled / petastorm = {med(ours, key) / med(peta, key):.1f}x"
                 if peta else ""))
    print(f"  peak RSS x{args.scale} rows / x1 = "
          f"{med(big, 'peak_rss_mib') / med(ours, 'peak_rss_mib'):.2f}")
    for key in ("tf_rows_s", "torch_rows_s", "first_batch_s", "peak_rss_mib"):
        print(f"  {key}: mlflow_hvd.petastorm converter / run(data=df) = "
              f"{med(conv, key) / med(ours, key):.2f}"
              + (f", converter / petastorm = {med(conv, key) / med(peta, key):.2f}"
                 if peta else ""))
    if peta:
        print(f"  first batch: mlflow_hvd / petastorm = "
              f"{med(ours, 'first_batch_s') / med(peta, 'first_batch_s'):.2f}")
    spark.stop()


if __name__ == "__main__":
    main()

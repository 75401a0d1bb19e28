"""How a job's start, rendezvous, output and tracking scale with the number of ranks.

Lightweight ranks (no TensorFlow: 256 TensorFlow processes do not fit one machine) run
through the real driver, channel, agents and horovod's rendezvous server, with the runner's
default deadlines, on two backends:

* ``local``: ``HorovodRunner(np=-N)``, local processes;
* ``spark``: ``HorovodRunner(np=N)``, a barrier stage on a warm ``local[N]`` session (one
  driver process per N and round, which first runs a warm-up job).

Every rank, in order:

1. sends the HTTP requests ``hvd.init()`` sends to the driver's rendezvous server (horovod's
   Gloo store protocol, :mod:`tests.gloo_rendezvous`), as if the job's ranks were on hosts
   of ``--ranks-per-host`` ranks, reaching it over ``--spread`` seconds as real ranks do;
2. logs ``--metrics`` metrics through rank 0's tracking path (into a SQLite MLflow store;
   the other ranks' calls do nothing, as in training);
3. prints ``--lines`` lines (every line is printed on the driver).

For each backend and N, in alternated rounds, it measures the time until every rank has
started, until ``run`` returned, the driver process's CPU seconds and peak memory, the
messages the channel handled, how long the rendezvous server was busy and its requests per
second, and output lines per second while they arrived; it checks that every line arrived
and every metric was logged. Prints min/median/max per N and the growth of the medians from
N to 2N (2.0 is linear, 4.0 quadratic).

    .venv/bin/python benchmarks/scale.py [--backends local spark] [--sizes 64 128 256]
        [--rounds 3] [--lines 100] [--metrics 100] [--ranks-per-host 8] [--spread 2]
        [--start-timeout 60] [--gloo-timeout 300]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import workers  # noqa: E402  the tests' lightweight rank functions

LOAD = re.compile(r"and (\d+) messages; the rendezvous server (\d+) requests in ([\d.]+)s")


@dataclass(frozen=True)
class Sample:
    started: float  # seconds until every rank started
    done: float  # seconds until run() returned
    cpu: float  # driver (Python) process CPU seconds
    peak_mb: float  # driver peak RSS, MiB
    messages: int  # channel messages handled by the driver (output and metrics are batched)
    rendezvous_per_s: float  # rendezvous HTTP requests served per second while it served
    rendezvous_s: float  # from the first rendezvous request to the last
    lines_per_s: float  # from the first output line on the driver to the last


class _Output(io.StringIO):
    """The driver's stdout, noting when the first and the last rank output line arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.first = self.last = 0.0

    def write(self, text: str) -> int:
        if "<stdout>: line " in text:
            self.last = time.monotonic()
            self.first = self.first or self.last
        return super().write(text)


class _DriverLog(logging.Handler):
    """The lifecycle log's last 'rank ... started' time and the job's load line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last_start = 0.0
        self.load: re.Match[str] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if " started on " in message:
            self.last_start = time.monotonic()
        elif m := LOAD.search(message):
            self.load = m


def one_job(np: int, args: argparse.Namespace, spark: object = None) -> Sample:
    """One job, measured in this (the driver's) process. ``np < 0``: local processes."""
    import mlflow

    from mlflow_hvd import HorovodRunner, JobConfig

    n = abs(np)
    me = psutil.Process()
    peak = me.memory_info().rss
    stop = threading.Event()

    def sample_memory() -> None:
        nonlocal peak
        while not stop.wait(0.05):
            peak = max(peak, me.memory_info().rss)

    seen = _DriverLog()
    loggers = [logging.getLogger(f"mlflow_hvd.driver.{m}") for m in ("supervisor", "job")]
    for logger in loggers:
        logger.addHandler(seen)
        logger.setLevel(logging.INFO)
    sampler = threading.Thread(target=sample_memory, daemon=True)
    with tempfile.TemporaryDirectory() as connected:
        cpu0 = sum(me.cpu_times()[:2])
        sampler.start()
        t0 = time.monotonic()
        try:
            with redirect_stdout(_Output()) as out, mlflow.start_run() as run:
                result = HorovodRunner(np=np, spark=spark, driver_log_verbosity="all",
                    job=JobConfig(start_timeout=args.start_timeout)).run(
                    workers.scale_rank, lines=args.lines, metrics=args.metrics,
                    ranks_per_host=args.ranks_per_host, spread=args.spread,
                    rendezvous_timeout=args.gloo_timeout,
                    rendezvous_dir=None if args.no_rendezvous else connected)
            done = time.monotonic() - t0
            cpu = sum(me.cpu_times()[:2]) - cpu0
        finally:
            stop.set()
            sampler.join(timeout=5)
            for logger in loggers:
                logger.removeHandler(seen)
    printed = sum(1 for line in out.getvalue().splitlines() if "<stdout>: line " in line)
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "loss")
    if result["rank"] != 0 or printed != n * args.lines or len(history) != args.metrics:
        raise SystemExit(f"np={np}: rank 0 returned {result!r}, {printed} of "
                         f"{n * args.lines} lines, {len(history)} of {args.metrics} metrics")
    if seen.load is None:
        raise SystemExit(f"np={np}: the driver logged no load line")
    messages, requests, rendezvous_s = int(seen.load[1]), int(seen.load[2]), float(seen.load[3])
    return Sample(seen.last_start - t0, done, cpu, peak / 2**20, messages,
                  requests / rendezvous_s if requests else 0.0, rendezvous_s,
                  printed / max(out.last - out.first, 1e-3))


def spark_job(n: int, args: argparse.Namespace, folder: Path) -> Sample:
    """A fresh driver process with a ``local[n]`` session runs a warm-up job, then the job
    that is measured (its Sample comes back as JSON)."""
    cmd = [sys.executable, __file__, "--spark-child", str(n), *_job_flags(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=folder,
                          env={**os.environ, "PYSPARK_PYTHON": sys.executable})
    if proc.returncode != 0:
        raise SystemExit(f"Spark job of {n} ranks failed:\n{proc.stderr[-4000:]}")
    return Sample(**json.loads(proc.stdout.strip().splitlines()[-1]))


def _job_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--lines", str(args.lines), "--metrics", str(args.metrics),
             "--ranks-per-host", str(args.ranks_per_host), "--spread", str(args.spread),
             "--gloo-timeout", str(args.gloo_timeout), "--start-timeout", str(args.start_timeout)]
    return flags + (["--no-rendezvous"] if args.no_rendezvous else [])


def spark_child(n: int, args: argparse.Namespace) -> None:
    from pyspark.sql import SparkSession

    from mlflow_hvd import HorovodRunner, JobConfig, TrackingConfig

    spark = (SparkSession.builder.master(f"local[{n}]")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    HorovodRunner(np=n, spark=spark, job=JobConfig(start_timeout=args.start_timeout),
        tracking=TrackingConfig(track=False)).run(
        workers.count_lines, n=0)  # warm-up
    print(json.dumps(asdict(one_job(n, args, spark))), flush=True)


FIELDS = [("started", "all started, s"), ("done", "run returned, s"),
          ("cpu", "driver CPU, s"), ("peak_mb", "driver peak RSS, MiB"),
          ("messages", "channel messages"), ("rendezvous_s", "rendezvous, s"),
          ("rendezvous_per_s", "rendezvous req/s"), ("lines_per_s", "lines/s")]


def report(backend: str, samples: dict[int, list[Sample]]) -> None:
    medians: dict[int, dict[str, float]] = {}
    for n, runs in samples.items():
        medians[n] = {}
        cells = []
        for key, label in FIELDS:
            values = [getattr(s, key) for s in runs]
            medians[n][key] = statistics.median(values)
            cells.append(f"{label} {medians[n][key]:.2f} "
                         f"(min {min(values):.2f}, max {max(values):.2f})")
        print(f"{backend} N={n}: " + "; ".join(cells))
    sizes = list(samples)
    for a, b in itertools.pairwise(sizes):
        growth = "; ".join(f"{label} x{medians[b][key] / medians[a][key]:.2f}"
                           for key, label in FIELDS if medians[a][key])
        print(f"{backend} growth {a} -> {b} ranks: {growth}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["local", "spark"],
                   choices=["local", "spark"])
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lines", type=int, default=100)
    p.add_argument("--metrics", type=int, default=100)
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--spread", type=float, default=2.0)
    p.add_argument("--no-rendezvous", action="store_true")
    p.add_argument("--gloo-timeout", type=float, default=300.0,
                   help="seconds a rank waits for each key (HOROVOD_GLOO_TIMEOUT_SECONDS; "
                        "hundreds of Python ranks on one machine are slower than real ones)")
    p.add_argument("--start-timeout", type=float, default=60.0,
                   help="HorovodRunner(job=JobConfig(start_timeout=...)): a barrier stage of 256 "
                       "tasks on "
                        "one 2-core machine starts 768 Python processes (Spark's worker, our "
                        "agent and the rank per task) and needs more than the default 60 s")
    p.add_argument("--spark-child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        if args.spark_child is None:
            uri = f"sqlite:///{folder}/mlflow.db"
            SqlAlchemyStore(uri, str(folder / "artifacts"))
            os.environ["MLFLOW_TRACKING_URI"] = uri
        if args.spark_child is not None:
            spark_child(args.spark_child, args)
            return
        os.chdir(folder)  # nothing lands in the checkout
        samples = {b: {n: [] for n in args.sizes} for b in args.backends}
        warm_up()
        for r in range(args.rounds):
            for n in args.sizes if r % 2 == 0 else list(reversed(args.sizes)):
                for backend in args.backends:
                    sample = (one_job(-n, args) if backend == "local"
                              else spark_job(n, args, folder))
                    samples[backend][n].append(sample)
                    print(f"round {r + 1} {backend} N={n}: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in asdict(sample).items()), flush=True)
        print(f"{args.rounds} rounds, {args.lines} lines and {args.metrics} metrics per rank, "
              f"start timeout {args.start_timeout:g}s, "
              f"rendezvous {'off' if args.no_rendezvous else 'on'} "
              f"({args.ranks_per_host} ranks per host, spread {args.spread:g}s), "
              f"{psutil.cpu_count()} cores")
        for backend in args.backends:
            report(backend, samples[backend])


def warm_up() -> None:
    """Imports and caches, before anything is measured."""
    from mlflow_hvd import HorovodRunner, TrackingConfig

    HorovodRunner(np=-8, tracking=TrackingConfig(track=False)).run(workers.count_lines, n=1)


if __name__ == "__main__":
    main()

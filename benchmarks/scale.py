"""How a job's start and its output scale with the number of ranks, on this machine.

Lightweight ranks (no TensorFlow, no ``hvd.init()``: a rank prints ``--lines`` lines and
returns its rank) run as local processes (``HorovodRunner(np=-N)``) through the real
driver, channel and agents, with the runner's default deadlines. For each N, in alternated
rounds, it measures:

* time until every rank has started (the lifecycle log's last ``rank ... started``),
* time until ``run`` returned,
* the driver process's CPU seconds and its peak resident memory during the job,
* output lines per second through the driver (every line printed on the driver).

Prints min/median/max per N and the growth of the medians from N to 2N (2.0 is linear).

    .venv/bin/python benchmarks/scale.py [--sizes 64 128 256] [--lines 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import sys
import threading
import time
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import workers  # the tests' lightweight rank functions

from mlflow_hvd import HorovodRunner


@dataclass(frozen=True)
class Sample:
    started: float  # seconds until every rank started
    done: float  # seconds until run() returned
    cpu: float  # driver CPU seconds
    peak_mb: float  # driver peak RSS, MiB
    lines_per_s: float


class _StartTimes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        if " started on " in record.getMessage():
            self.last = time.monotonic()


def one_job(n: int, lines: int) -> Sample:
    me = psutil.Process()
    peak = me.memory_info().rss
    stop = threading.Event()

    def sample_memory() -> None:
        nonlocal peak
        while not stop.wait(0.05):
            peak = max(peak, me.memory_info().rss)

    starts = _StartTimes()
    logger = logging.getLogger("mlflow_hvd.driver.supervisor")
    logger.addHandler(starts)
    logger.setLevel(logging.INFO)
    sampler = threading.Thread(target=sample_memory, daemon=True)
    cpu0 = sum(me.cpu_times()[:2])
    sampler.start()
    t0 = time.monotonic()
    try:
        with redirect_stdout(io.StringIO()) as out:
            result = HorovodRunner(np=-n, track=False, driver_log_verbosity="all").run(
                workers.count_lines, n=lines)
        done = time.monotonic() - t0
    finally:
        stop.set()
        sampler.join(timeout=5)
        logger.removeHandler(starts)
    printed = out.getvalue().count("\n")
    if result != 0 or printed != n * lines:
        raise SystemExit(f"np=-{n}: rank 0 returned {result!r}, {printed} of {n * lines} lines")
    return Sample(starts.last - t0, done, sum(me.cpu_times()[:2]) - cpu0,
                  peak / 2**20, printed / done)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--lines", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    samples: dict[int, list[Sample]] = {n: [] for n in args.sizes}
    one_job(8, args.lines)  # warm-up: imports and caches
    for r in range(args.rounds):
        for n in args.sizes if r % 2 == 0 else reversed(args.sizes):
            samples[n].append(one_job(n, args.lines))
    fields = [("started", "all started, s"), ("done", "run returned, s"),
              ("cpu", "driver CPU, s"), ("peak_mb", "driver peak RSS, MiB"),
              ("lines_per_s", "lines/s")]
    medians: dict[int, dict[str, float]] = {}
    print(f"{args.rounds} rounds, {args.lines} lines per rank, {psutil.cpu_count()} cores")
    for n in args.sizes:
        medians[n] = {}
        cells = []
        for key, label in fields:
            values = [getattr(s, key) for s in samples[n]]
            medians[n][key] = statistics.median(values)
            cells.append(f"{label} {statistics.median(values):.2f} "
                         f"(min {min(values):.2f}, max {max(values):.2f})")
        print(f"np=-{n}: " + "; ".join(cells))
    for a, b in zip(args.sizes, args.sizes[1:], strict=False):
        growth = "; ".join(f"{label} x{medians[b][key] / medians[a][key]:.2f}"
                           for key, label in fields)
        print(f"growth {a} -> {b} ranks: {growth}")


if __name__ == "__main__":
    main()

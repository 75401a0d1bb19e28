"""The first barrier stage of a new SparkSession: an RDD barrier stage (what a job without
data runs on a classic session) against the DataFrame API's ``mapInArrow(...,
barrier=True)`` over ``spark.range`` (what a job with data, and a Spark Connect session,
runs), each in a new process with a new ``local[2]`` session started as mlflow_hvd starts
it (``backends/spark/session.new_session``: the class-data archive, when built, and the
C1-only JIT).

Both arms run two tasks that return at once, after the session is up; the time is from
submitting the stage to its result, then a second stage on the same session. Arms alternate
per round. Prints min/median/max per arm and the ratio of medians.

    .venv/bin/python benchmarks/first_stage.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

ARM = """
import sys, time
from mlflow_hvd.backends.spark.session import new_session
spark = new_session("local[2]")
def rows(it):
    yield 0
def batches(it):
    yield from it
times = []
for _ in range(2):
    t0 = time.monotonic()
    if sys.argv[1] == "rdd":
        spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(rows).collect()
    else:
        frame = spark.range(0, 2, 1, 2)
        frame.mapInArrow(batches, frame.schema, barrier=True).collect()
    times.append(time.monotonic() - t0)
print("STAGES", *times)
"""


def _arm(kind: str) -> tuple[float, float]:
    proc = subprocess.run([sys.executable, "-c", ARM, kind], capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STAGES ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the {kind} arm failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    first, second = (float(v) for v in lines[-1].split()[1:])
    return first, second


def _stats(name: str, values: list[float]) -> str:
    return (f"{name:<40} min {min(values):6.3f}  median {statistics.median(values):6.3f}  "
            f"max {max(values):6.3f} s   (n={len(values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    _arm("rdd")  # warm-up: the OS caches
    _arm("arrow")
    results: dict[str, list[tuple[float, float]]] = {"rdd": [], "arrow": []}
    for i in range(args.rounds):
        for kind in (("rdd", "arrow") if i % 2 == 0 else ("arrow", "rdd")):
            results[kind].append(_arm(kind))
    names = {"rdd": "RDD barrier stage", "arrow": "barrier mapInArrow"}
    for kind, values in results.items():
        print(_stats(f"{names[kind]}: first stage", [v[0] for v in values]))
        print(_stats(f"{names[kind]}: second stage", [v[1] for v in values]))
    rdd = statistics.median(v[0] for v in results["rdd"])
    arrow = statistics.median(v[0] for v in results["arrow"])
    print(f"first stage: mapInArrow / RDD = {arrow / rdd:.2f} (medians; "
          f"{arrow - rdd:.2f} s more)")


if __name__ == "__main__":
    main()

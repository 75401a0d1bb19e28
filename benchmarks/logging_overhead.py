"""Cost of logging metrics every training step, against the same training without it.

Inside one HorovodRunner(np=-1) job tracked to a SQLite MLflow store, trains one digits CNN
(built and compiled once, so that no fit pays for tracing) with ``model.fit`` alternately
(a) with ``MlflowCallback(log_every_n_steps=1)`` (five metrics queued per step, sent in
background batches) and (b) with ``MlflowCallback(log_every_n_steps=None)`` (per-epoch
metrics only). Metric, param and tag records are written by the driver (the benchmark's
own process here), not by the rank.

Each round runs both arms back to back, in alternating order (AB, BA, ...), so slow drifts
of this shared machine hit both. The per-round ratio per_step / per_epoch is the
measurement, in wall time of ``fit`` (training: what per-step logging must not slow down)
and in CPU time of the rank's whole process from the fit's start until its values are
stored (the delivery thread's work included; less disturbed by other processes). After
each fit both arms wait until the values are in the store (``tracking.flush``); that wait,
which a training run pays once at its end, is printed apart. Prints min/median/max per arm
and of the ratios, and a bootstrap 95% interval of the median ratio, whose width is the
spread the claim must beat. Goal: overhead <= 3%. TensorFlow runs on one thread in both
arms by default (``--tf-threads``), which makes a fit's time steadier on this shared 2-core
machine.

    .venv/bin/python benchmarks/logging_overhead.py [--repeats 60] [--epochs 3] \
        [--store sqlite|http]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import digits_keras


def measure(repeats: int, epochs: int, batch_size: int) -> dict[str, Any]:
    import time

    import horovod.tensorflow as hvd
    import keras

    from mlflow_hvd import keras as hvd_keras
    from mlflow_hvd import tracking

    hvd.init()
    x, y, _, _ = digits_keras.load_data()
    times: dict[str, list[float]] = {"per_step": [], "per_epoch": []}
    cpu: dict[str, list[float]] = {"per_step": [], "per_epoch": []}
    flushes: dict[str, list[float]] = {"per_step": [], "per_epoch": []}
    # One model, compiled once, shared by both arms: each fit goes on training it, so no fit
    # pays for building the model or tracing its train step (a second of variance each).
    keras.utils.set_random_seed(0)
    model = digits_keras.build_model()
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False)
    steps = 0
    for i in range(repeats + 1):  # round 0 warms up: traces the train step, fills caches
        for mode in ("per_step", "per_epoch")[:: 1 if i % 2 else -1]:
            cb = hvd_keras.MlflowCallback(
                checkpoint=False, log_every_n_steps=1 if mode == "per_step" else None
            )
            t0, c0 = time.perf_counter(), time.process_time()
            history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
                                callbacks=[cb])
            t1 = time.perf_counter()
            tracking.flush()  # the fit's values are in the store before the next fit
            if i:
                times[mode].append(t1 - t0)
                flushes[mode].append(time.perf_counter() - t1)
                cpu[mode].append(time.process_time() - c0)  # every thread: delivery too
            steps = len(history.history["loss"]) * -(-len(x) // batch_size)
    return {"times": times, "cpu": cpu, "flushes": flushes, "steps_per_fit": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--store", choices=("sqlite", "http"), default="sqlite",
                        help="sqlite: rank 0 writes a SQLite store itself (MLflow's "
                        "SQLAlchemy store, in rank 0's process); http: an `mlflow server` "
                        "on loopback (SQLite behind it), as on a cluster")
    parser.add_argument("--tf-threads", type=int, default=1,
                        help="TensorFlow's intra- and inter-op threads in the rank, both arms "
                        "alike (0: TensorFlow's default)")
    args = parser.parse_args()
    if args.tf_threads:  # read by TensorFlow in the rank at start-up, for both arms alike
        os.environ["TF_NUM_INTRAOP_THREADS"] = os.environ["TF_NUM_INTEROP_THREADS"] = str(
            args.tf_threads
        )

    import mlflow

    from mlflow_hvd import HorovodRunner

    with tempfile.TemporaryDirectory() as tmp, _store(args.store, tmp) as uri:
        mlflow.set_tracking_uri(uri)
        runner = HorovodRunner(np=-1)
        out = runner.run(measure, repeats=args.repeats, epochs=args.epochs,
                         batch_size=args.batch_size)
        client = mlflow.MlflowClient()
        logged = len(client.get_metric_history(runner.last_run_id, "step_loss"))
    steps = out["steps_per_fit"]
    print(f"store: {args.store} ({uri}); step_loss values in the run: {logged} "
          f"(expected {steps * (args.repeats + 1)})")
    for mode, values in out["flushes"].items():
        print(f"flush after the fit, {mode:9s}: min {min(values):.3f}  median "
              f"{statistics.median(values):.3f}  max {max(values):.3f} s (once per training, "
              "not per step; not in the wall times below)")
    for what, label in (("times", "wall"), ("cpu", "CPU (all threads)")):
        data = out[what]
        for mode, values in data.items():
            print(f"{label} {mode:9s} min {min(values):.3f}  median "
                  f"{statistics.median(values):.3f}  max {max(values):.3f} s per fit "
                  f"({1000 * statistics.median(values) / steps:.2f} ms/step, n={len(values)})")
        ratios = [a / b for a, b in zip(data["per_step"], data["per_epoch"], strict=True)]
        low, high = _bootstrap_median(ratios)
        print(f"{label}: per-round ratio per_step / per_epoch min {min(ratios):.3f}  median "
              f"{statistics.median(ratios):.3f}  max {max(ratios):.3f}; 95% interval of the "
              f"median {low:.3f}-{high:.3f} (overhead "
              f"{100 * (statistics.median(ratios) - 1):+.1f}%, goal <= +3%)")


@contextlib.contextmanager
def _store(kind: str, tmp: str) -> Iterator[str]:
    """The tracking URI of the store ``kind``; an ``http`` server is stopped on exit."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp}/bench.db"
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp}/server.db", "--artifacts-destination",
         f"{tmp}/artifacts", "--serve-artifacts", "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"mlflow server at {url} did not come up") from None
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def _bootstrap_median(values: list[float], rounds: int = 5000) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the median (seeded: the same data prints the
    same interval)."""
    import random

    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds)
    )
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


if __name__ == "__main__":
    main()

"""What a resize of an elastic job costs, beside one restart of today's retry, on the
two-node namespace cluster (root).

The same PyTorch job in both arms (np=4, 2 ranks per host, a small MLP on generated data,
a checkpoint in the run after every epoch, resumed from it): each attempt's rank 0 notes the
time of its first training step in a marks file. Per round:

* **retry** (``max_failures=1``): a rank on node-b is SIGKILLed mid-epoch; the time from
  the kill to the restarted attempt's first step on 4 ranks.
* **shrink** (``min_np=2, max_failures=2``): node-b dies for good mid-epoch (every process
  of its namespace SIGKILLed); the time from the loss to the first step on node-a's 2 ranks
  (``slot_timeout`` of it is the wait for the 4 slots that will not come).
* **grow**: node-b's worker started again while the job on 2 ranks waits before epoch 4 (a
  gate file the benchmark holds); once its new executor registered with the driver, the
  gate opens: the time from then to the first step on 4 ranks, and the part of it after
  the checkpoint the job grew at (the rest is epoch 4 on 2 ranks).

Work lost in each case: the training time between the last checkpoint and the loss (what
is done again). Arms alternate per round; prints min/median/max and the ratios of medians.

    sudo .venv/bin/python benchmarks/elastic_resize.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

EPOCHS = 10
STEPS = 240  # per epoch: about 2 s on these ranks


def train(marks: str, gate: str, epochs: int = EPOCHS, steps: int = STEPS) -> int:
    """The eight steps in PyTorch; rank 0 notes each attempt's first step and checkpoints,
    and starts an epoch only once the gate file allows it (holds a number >= it)."""
    import horovod.torch as hvd
    import torch

    import mlflow_hvd
    from mlflow_hvd import torch as hvd_torch

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=hvd_torch.scale_learning_rate(0.01)),
        named_parameters=model.named_parameters())
    start = hvd_torch.restore_from_checkpoint(model, optimizer)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def note(text: str) -> None:
        if hvd.rank() == 0:
            with open(marks, "a") as f:
                f.write(f"{text} {time.time():.3f}\n")

    first = True
    for epoch in range(start, epochs):
        while hvd.rank() == 0 and int(Path(gate).read_text().strip() or 0) < epoch:
            time.sleep(0.05)
        hvd.allreduce(torch.zeros(1), name=f"gate_{epoch}")
        for _ in range(steps):
            x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if first:
                note(f"first {mlflow_hvd.attempt()} {hvd.size()} {epoch}")
                first = False
        hvd_torch.save_checkpoint(model, optimizer, epoch, 0, {"epoch_done": float(epoch)})
        note(f"checkpoint {epoch} {hvd.size()}")
    return hvd.size()


class Marks:
    """The marks file, read as rank 0 appends to it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def lines(self) -> list[list[str]]:
        return [ln.split() for ln in self.path.read_text().splitlines() if ln.strip()]

    def wait(self, match: Any, timeout: float, what: str) -> list[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for parts in self.lines():
                if match(parts):
                    return parts
            time.sleep(0.05)
        raise SystemExit(f"timed out waiting for {what}; marks: {self.lines()[-5:]}")


def run_in_thread(runner: Any, marks: Path,
                  gate: Path) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = runner.run(train, marks=str(marks), gate=str(gate))
        except BaseException as exc:  # reported by the round
            box["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, box


def last_checkpoint_before(marks: Marks, t: float) -> float:
    return max(float(p[-1]) for p in marks.lines() if p[0] == "checkpoint" and float(p[-1]) < t)


def retry_round(cluster: Any, spark: Any, marks: Marks, gate: Path) -> dict[str, float]:
    from mlflow_hvd import HorovodRunner, JobConfig

    gate.write_text(str(EPOCHS))  # free running
    runner = HorovodRunner(np=4, spark=spark, job=JobConfig(max_failures=1, stop_grace=2))
    thread, box = run_in_thread(runner, marks.path, gate)
    marks.wait(lambda p: p[0] == "checkpoint" and p[1] == "1", 300, "epoch 1's checkpoint")
    time.sleep(1.0)  # mid-epoch 2
    victim = cluster.rank_pids("node-b")[0]
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    first = marks.wait(lambda p: p[0] == "first" and p[1] == "1", 300, "attempt 2's first step")
    thread.join(600)
    if "error" in box or box.get("value") != 4:
        raise SystemExit(f"retry arm: {box}")
    return {"restart": float(first[-1]) - t_kill,
            "lost": t_kill - last_checkpoint_before(marks, t_kill)}


def elastic_round(cluster: Any, spark: Any, marks: Marks, gate: Path) -> dict[str, float]:
    from mlflow_hvd import HorovodRunner, JobConfig

    gate.write_text("3")  # on 2 ranks the job waits before epoch 4 until node-b is back
    runner = HorovodRunner(np=4, spark=spark, job=JobConfig(
        min_np=2, max_failures=2, slot_timeout=10, grow_interval=1, stop_grace=2))
    thread, box = run_in_thread(runner, marks.path, gate)
    marks.wait(lambda p: p[0] == "checkpoint" and p[1] == "1", 300, "epoch 1's checkpoint")
    time.sleep(1.0)
    t_kill = time.time()
    cluster.kill_node("node-b")
    shrunk = marks.wait(lambda p: p[0] == "first" and p[2] == "2", 300, "the first step on 2")
    before = cluster.executor_logs("node-b")
    cluster.restart_node("node-b")
    cluster.wait_for_new_executor("node-b", before, 120)
    t_back = time.time()
    gate.write_text(str(EPOCHS))
    grown = marks.wait(lambda p: p[0] == "first" and p[2] == "4" and p[1] != "0", 300,
                       "the first step on 4 again")
    thread.join(600)
    if "error" in box or box.get("value") != 4:
        raise SystemExit(f"elastic arm: {box}")
    t_grown = float(grown[-1])
    grew_at = max(float(p[-1]) for p in marks.lines()
                  if p[0] == "checkpoint" and p[2] == "2" and float(p[-1]) < t_grown)
    return {"shrink": float(shrunk[-1]) - t_kill,
            "lost": t_kill - last_checkpoint_before(marks, t_kill),
            "grow": t_grown - t_back, "grow_after_checkpoint": t_grown - grew_at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from cluster import STATE, two_node_cluster

    results: dict[str, list[float]] = {}
    with two_node_cluster() as c:
        os.environ.update(c.driver_env())
        from pyspark.sql import SparkSession

        spark = SparkSession.builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        marks = Marks(STATE / "elastic-marks")
        gate = STATE / "elastic-gate"
        for i in range(args.rounds):
            order = (retry_round, elastic_round) if i % 2 == 0 else (elastic_round, retry_round)
            for arm in order:
                marks.path.write_text("")
                for key, value in arm(c, spark, marks, gate).items():
                    name = ("retry " if arm is retry_round else "elastic ") + key
                    results.setdefault(name, []).append(value)
        spark.stop()
    print(f"np=4 on 2 hosts x 2 slots, {EPOCHS} epochs of {STEPS} steps, checkpoint per "
          f"epoch; {args.rounds} alternated rounds")
    for name, values in results.items():
        print(f"{name:30s} min {min(values):6.2f}  median {statistics.median(values):6.2f}  "
              f"max {max(values):6.2f} s   runs: " + " ".join(f"{v:.2f}" for v in values))
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"shrink / retry restart (medians) = {med['elastic shrink'] / med['retry restart']:.2f}")
    print(f"grow / retry restart (medians) = {med['elastic grow'] / med['retry restart']:.2f}")


if __name__ == "__main__":
    main()

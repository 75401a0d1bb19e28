"""HorovodRunner against pyspark's TorchDistributor (what Databricks advises today for
distributed PyTorch on Spark), on the same ``local-cluster[2,2,1024]`` session (4 slots:
the warm arm's ranks keep 2 while the other arms run on the other 2).

1. **Launch**: the same trivial job, new processes every round: join the process group
   (``torch.distributed`` Gloo under TorchDistributor, ``hvd.init()`` under HorovodRunner),
   allreduce one tensor, return. ``TorchDistributor(num_processes=2, local_mode=False,
   use_gpu=False).run(fn)`` vs ``HorovodRunner(np=2).run(fn)``, and warm ranks (``with
   HorovodRunner(...)``) beside them. Rank 0 notes when the function starts and ends, so
   each arm's time splits into launch (``run()`` to the function), the function, and the
   way back.
   The same ``torch.distributed`` function (``init_process_group("gloo")``, torchrun's
   variables) also runs unchanged under HorovodRunner, new and warm ranks: the launch of a
   DDP job moved from TorchDistributor by one import.
2. **Training throughput**: an MLP 256-512-512-10, batch 64, one thread per rank,
   ``--steps`` timed steps after 20: DistributedDataParallel under TorchDistributor, the same
   DDP function under HorovodRunner, and ``hvd.DistributedOptimizer`` under HorovodRunner;
   rank 0's steps/s.
3. **Memory per rank**: the same model (``--layers`` Linear(2048, 2048) layers, 16.8 MB of
   float32 parameters each) and optimizer (Adam), 10 steps of batch 64, under
   HorovodRunner(np=2): DDP (every rank holds the whole model, its gradients and Adam's two
   states) vs FSDP2 (``fully_shard`` per layer on a CPU mesh, Gloo; built on the meta device
   and materialised shard by shard, as a model too big for one rank is). Each rank's peak
   resident memory from just before the model is built (the kernel's high-water mark reset
   there: ``/proc/self/clear_refs``) to the end of the steps; the larger rank's figure.

4. **Checkpoints of that FSDP2 model**: ``mlflow_hvd.torch.save_checkpoint`` gathered (the
   full state to rank 0, one ``checkpoint.pt``) vs ``sharded=True`` (each rank's part,
   ``torch.distributed.checkpoint``, its files sent to rank 0 8 MiB at a time), into a job's
   run; then a second job in the same run restores it. Each rank's peak resident memory
   during the call (high-water mark reset just before; both arms' ranks with
   ``MALLOC_MMAP_THRESHOLD_=1048576``, so that freed buffers go back and a peak is what the
   call allocated), and the call's seconds.

5. **PyTorch Lightning**: ``Trainer(devices=1, num_nodes=2, strategy="ddp")`` as
   Databricks' TorchDistributor page writes it, training the MLP above, under pyspark's
   ``TorchDistributor`` and this package's (tracking off, as pyspark has none): launch
   (``run()`` to the first training step) and rank 0's steps/s over ``--steps`` steps
   after 20.

Arms alternate every round; prints min/median/max per arm and the ratios of medians.

    .venv/bin/python benchmarks/torch_distributor.py [--rounds 4] [--steps 150] [--part all]
                                                     [--layers 8] (parts: launch, throughput,
                                                     memory, checkpoints, lightning)
                                                     [--arm cycle=2 --arm groups=1 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def td_trivial() -> tuple[float, float, float]:
    import time

    started = time.time()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return float(value), started, time.time()


def hvd_trivial() -> tuple[float, float, float]:
    import time

    started = time.time()
    import horovod.torch as hvd
    import torch

    hvd.init()
    value = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    return float(value), started, time.time()


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10))


def _timed_steps(model: Any, optimizer: Any, steps: int) -> float:
    import time

    import torch

    torch.manual_seed(1)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(20):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - t0)


def td_train(steps: int) -> float:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(_mlp())
    rate = _timed_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), steps)
    # both ranks done before the group goes (without it, a worker sometimes aborted in
    # Gloo's teardown: "terminate called without an active exception", and torchrun on the
    # other task then waited for ever)
    dist.barrier()
    dist.destroy_process_group()
    return rate


def hvd_train(steps: int, groups: int = 0) -> float:
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    model = _mlp()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters(),
                                         groups=groups or None)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return _timed_steps(model, optimizer, steps)


def lightning_train(steps: int) -> tuple[float, float, float]:
    """PyTorch Lightning's DDP as Databricks' TorchDistributor page writes it
    (``devices=1, num_nodes=2``): the MLP on one fixed batch, ``steps`` timed steps after
    20. Returns when the function started and when its first training step did (epoch
    seconds), and rank 0's steps/s."""
    import time

    started = time.time()
    import pytorch_lightning as pl
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(1)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    marks: dict[str, float] = {}

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any,
                                 index: int) -> None:
            if index == 0:
                marks["first"] = time.time()
            elif index == 20:
                marks["t0"] = time.perf_counter()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            marks["t1"] = time.perf_counter()

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x.repeat(20 + steps, 1), y.repeat(20 + steps)),
        batch_size=64)
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp",
                         max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[Clock()])
    trainer.fit(Module(), data)
    return started, marks["first"], steps / (marks["t1"] - marks["t0"])


def _resident_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_peak(kind: str, layers: int, steps: int = 10) -> float:
    """Rank body of part 3: this rank's peak resident MB above what it held before the
    model was built; every rank's figure gathered, the largest returned."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    x = torch.randn(64, 2048)
    y = torch.randint(0, 10, (64,))
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the high-water mark (VmHWM) starts again from here
    base = _resident_mb("VmRSS")

    if kind == "fsdp":
        model = _fsdp_model(layers)
    else:
        model = torch.nn.parallel.DistributedDataParallel(_model(layers))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    peak = torch.tensor([_resident_mb("VmHWM") - base])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.barrier()
    dist.destroy_process_group()
    return float(peak)


def _model(layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)],
                               torch.nn.Linear(2048, 10))


def _fsdp_model(layers: int) -> Any:
    """Part 3's model sharded with ``fully_shard`` per layer, built on the meta device and
    materialised shard by shard, as a model too big for one rank is."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = _model(layers)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")  # each rank allocates its shards only
    with torch.no_grad():
        for layer in model:
            layer.reset_parameters()
    return model


def checkpoint_peak(action: str, layers: int, sharded: bool) -> dict[str, Any]:
    """Rank body of part 4: part 3's FSDP2 model and Adam after one step; then
    ``mlflow_hvd.torch.save_checkpoint`` (gathered, or ``sharded``) into the job's run, or
    ``restore_from_checkpoint`` of the run's latest. Each rank's peak resident MB above
    what it held just before (the high-water mark reset there), and the call's seconds."""
    import torch
    import torch.distributed as dist

    from mlflow_hvd import torch as hvd_torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = _fsdp_model(layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    torch.nn.functional.cross_entropy(model(torch.randn(64, 2048)),
                                      torch.randint(0, 10, (64,))).backward()
    optimizer.step()
    optimizer.zero_grad()
    # what either arm imports or starts once per process, before the measure: rank 0's
    # upload queue and MLflow's artifact code, DCP's modules
    import mlflow.store.artifact.artifact_repository_registry  # noqa: F401
    import torch.distributed.checkpoint

    from mlflow_hvd import tracking

    tracking.log_dict({"warm": True}, "warm.json")
    tracking.flush()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    base = _resident_mb("VmRSS")
    t0 = time.perf_counter()
    if action == "save":
        hvd_torch.save_checkpoint(model, optimizer, 0, 1, {"loss": 0.0}, sharded=sharded)
    elif hvd_torch.restore_from_checkpoint(model, optimizer) != 1:
        raise RuntimeError("the checkpoint of epoch 0 was not restored")
    dist.barrier()
    seconds = time.perf_counter() - t0
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, _resident_mb("VmHWM") - base)
    dist.destroy_process_group()
    return {"peaks": peaks, "seconds": seconds}


def summary(name: str, values: list[float], unit: str) -> str:
    return (f"{name:34s} min {min(values):8.2f}  median {statistics.median(values):8.2f}  "
            f"max {max(values):8.2f} {unit}   runs: " + " ".join(f"{v:.2f}" for v in values))


def alternate(arms: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[Any]]:
    """One warm-up call per arm, then ``rounds`` rounds, the arms' order rotated."""
    for fn in arms.values():
        fn()
    results: dict[str, list[Any]] = {name: [] for name in arms}
    names = list(arms)
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            results[name].append(arms[name]())
    return results


def launch(spark: Any, rounds: int) -> None:
    from pyspark.ml.torch.distributor import TorchDistributor

    from mlflow_hvd import HorovodRunner, TrackingConfig

    off = TrackingConfig(track=False)

    def timed(call: Callable[[], tuple[float, float, float]]) -> tuple[float, float, float]:
        t0 = time.time()
        value, started, ended = call()
        t1 = time.time()
        if value != 3.0:
            raise SystemExit(f"a wrong allreduce: {value}")
        return started - t0, ended - started, t1 - ended

    with HorovodRunner(np=2, spark=spark, tracking=off) as warm:
        arms = {
            "TorchDistributor": lambda: timed(lambda: TorchDistributor(
                num_processes=2, local_mode=False, use_gpu=False).run(td_trivial)),
            "HorovodRunner": lambda: timed(lambda: HorovodRunner(
                np=2, spark=spark, tracking=off).run(hvd_trivial)),
            "HorovodRunner warm": lambda: timed(lambda: warm.run(hvd_trivial)),
            # the TorchDistributor function itself, unchanged: torch.distributed from the
            # torchrun variables HorovodRunner gives each rank
            "DDP code under HorovodRunner": lambda: timed(lambda: HorovodRunner(
                np=2, spark=spark, tracking=off).run(td_trivial)),
            "DDP code under HorovodRunner warm": lambda: timed(lambda: warm.run(td_trivial)),
        }
        results = alternate(arms, rounds)
    print(f"launch: np=2 on local-cluster[2,2,1024], a trivial allreduce, {rounds} rounds "
          "after a warm-up, arms rotated")
    totals = {name: [sum(parts) for parts in values] for name, values in results.items()}
    for name, values in results.items():
        print(summary(name + " total", totals[name], "s"))
        for index, part in enumerate(("run() to the function", "the function",
                                      "the function to run()'s return")):
            print(summary(f"  {part}", [v[index] for v in values], "s"))
    med = {name: statistics.median(v) for name, v in totals.items()}
    print(f"HorovodRunner / TorchDistributor (medians) = "
          f"{med['HorovodRunner'] / med['TorchDistributor']:.2f}; warm: "
          f"{med['HorovodRunner warm'] / med['TorchDistributor']:.3f}")
    print(f"DDP code: HorovodRunner / TorchDistributor (medians) = "
          f"{med['DDP code under HorovodRunner'] / med['TorchDistributor']:.2f}; warm: "
          f"{med['DDP code under HorovodRunner warm'] / med['TorchDistributor']:.3f}")


def parse_arm(spec: str) -> tuple[dict[str, Any], int]:
    """``--arm`` "cycle=2,fusion=0,groups=1" -> (HorovodOptions' keywords, groups)."""
    options: dict[str, Any] = {}
    groups = 0
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key == "cycle":
            options["cycle_time_ms"] = float(value)
        elif key == "fusion":
            options["fusion_threshold_mb"] = int(value)
        elif key == "groups":
            groups = int(value)
        else:
            raise SystemExit(f"--arm {spec!r}: unknown {key!r} (cycle=, fusion=, groups=)")
    return options, groups


def throughput(spark: Any, rounds: int, steps: int, specs: list[str]) -> None:
    from pyspark.ml.torch.distributor import TorchDistributor

    from mlflow_hvd import HorovodOptions, HorovodRunner, TrackingConfig

    off = TrackingConfig(track=False)
    arms: dict[str, Callable[[], Any]] = {
        "DDP under TorchDistributor": lambda: TorchDistributor(
            num_processes=2, local_mode=False, use_gpu=False).run(td_train, steps),
        "DDP under HorovodRunner": lambda: HorovodRunner(
            np=2, spark=spark, tracking=off).run(td_train, steps=steps),
        "Horovod under HorovodRunner": lambda: HorovodRunner(
            np=2, spark=spark, tracking=off).run(hvd_train, steps=steps),
    }
    for spec in specs:  # Horovod's knobs, as horovodrun's flags set them, and the optimizer's
        if spec == "horovod.spark.run":  # the same function launched by Horovod's own runner
            import horovod.spark

            arms["Horovod under horovod.spark.run"] = lambda: horovod.spark.run(
                hvd_train, args=(steps,), num_proc=2, use_gloo=True, verbose=0)[0]
            continue
        options, groups = parse_arm(spec)  # groups= (one allreduce group per N tensors)
        arms[f"Horovod {spec}"] = lambda o=options, g=groups: HorovodRunner(
            np=2, spark=spark, tracking=off, horovod=HorovodOptions(**o)).run(
            hvd_train, steps=steps, groups=g)
    results = alternate(arms, rounds)
    print(f"throughput: MLP 256-512-512-10, batch 64, 1 thread per rank, {steps} steps after "
          f"20, np=2, {rounds} rounds after a warm-up, arms rotated (rank 0's steps/s)")
    for name, values in results.items():
        print(summary(name, values, "steps/s"))
    med = {name: statistics.median(v) for name, v in results.items()}
    for name in med:
        if name != "DDP under TorchDistributor":
            print(f"{name} / DDP under TorchDistributor (medians) = "
                  f"{med[name] / med['DDP under TorchDistributor']:.2f}")


def lightning(spark: Any, rounds: int, steps: int) -> None:
    """The same Lightning function under pyspark's TorchDistributor and this package's:
    launch (``run()`` to the first training step) and steps/s."""
    from pyspark.ml.torch.distributor import TorchDistributor as PysparkDistributor

    from mlflow_hvd import TorchDistributor, TrackingConfig

    def timed(distributor: Any) -> tuple[float, float, float]:
        t0 = time.time()
        started, first, rate = distributor.run(lightning_train, steps)
        # the launcher's part (run() to the function) and the whole launch (to the first
        # training step: the function's imports and Trainer's set-up, the same in both)
        return started - t0, first - t0, rate

    arms = {
        "pyspark TorchDistributor": lambda: timed(PysparkDistributor(
            num_processes=2, local_mode=False, use_gpu=False)),
        "mlflow_hvd TorchDistributor": lambda: timed(TorchDistributor(
            num_processes=2, local_mode=False, use_gpu=False,
            tracking=TrackingConfig(track=False))),
    }
    results = alternate(arms, rounds)
    print(f"lightning: Trainer(devices=1, num_nodes=2, strategy='ddp'), MLP 256-512-512-10, "
          f"batch 64, 1 thread per rank, {steps} steps after 20, {rounds} rounds after a "
          "warm-up, arms rotated")
    for name, values in results.items():
        print(summary(f"{name} run() to the function", [v[0] for v in values], "s"))
        print(summary(f"{name} run() to step 1", [v[1] for v in values], "s"))
        print(summary(f"{name} steps/s", [v[2] for v in values], "steps/s"))
    ours = results["mlflow_hvd TorchDistributor"]
    theirs = results["pyspark TorchDistributor"]
    ratios = [statistics.median(v[i] for v in ours) / statistics.median(v[i] for v in theirs)
              for i in range(3)]
    print(f"mlflow_hvd / pyspark (medians): run() to the function {ratios[0]:.2f}, run() to "
          f"the first step {ratios[1]:.2f} (goal <= 0.25), steps/s {ratios[2]:.2f} "
          "(goal >= 0.98)")


THRESHOLD = "MALLOC_MMAP_THRESHOLD_"


def memory(rounds: int, layers: int) -> None:
    from mlflow_hvd import HorovodRunner, TrackingConfig

    off = TrackingConfig(track=False)

    def arm(kind: str, threshold: str | None) -> Callable[[], float]:
        def call() -> float:
            # local ranks start with the driver's environment: glibc's allocator settings
            # are read as a process starts
            if threshold is None:
                os.environ.pop(THRESHOLD, None)
            else:
                os.environ[THRESHOLD] = threshold
            try:
                return float(HorovodRunner(np=-2, tracking=off).run(
                    memory_peak, kind=kind, layers=layers))
            finally:
                os.environ.pop(THRESHOLD, None)
        return call

    names = {"ddp": "DDP", "fsdp": "FSDP2 (fully_shard)"}
    arms = {f"{names[kind]}{label}": arm(kind, threshold)
            for threshold, label in ((None, ""), ("1048576", f", {THRESHOLD}=1048576"))
            for kind in ("ddp", "fsdp")}
    results = alternate(arms, rounds)
    params_mb = (layers * (2048 * 2048 + 2048) + 2048 * 10 + 10) * 4 / 1e6
    print(f"memory: {layers} x Linear(2048, 2048) + Linear(2048, 10) ({params_mb:.0f} MB of "
          f"float32 parameters), Adam, 10 steps of batch 64, 2 local ranks, {rounds} rounds "
          "after a warm-up, arms rotated (the larger rank's peak resident MB above its start)")
    for name, values in results.items():
        print(summary(name, values, "MB"))
    med = {name: statistics.median(v) for name, v in results.items()}
    for label in ("", f", {THRESHOLD}=1048576"):
        print(f"FSDP2 / DDP peak per rank{label or ', glibc defaults'} (medians) = "
              f"{med[names['fsdp'] + label] / med[names['ddp'] + label]:.2f}")


def checkpoints(rounds: int, layers: int) -> None:
    import tempfile

    import mlflow

    from mlflow_hvd import HorovodRunner

    folder = tempfile.mkdtemp(prefix="bench-checkpoints-")
    mlflow.set_tracking_uri(f"sqlite:///{folder}/mlflow.db")
    mlflow.set_experiment(mlflow.create_experiment(
        "checkpoints", artifact_location=f"{folder}/artifacts"))

    # both arms: large buffers from mmap, handed back when freed (as the PyTorch page
    # advises for FSDP on CPUs), so that a peak is what the call allocated, not what glibc
    # kept from the training step
    os.environ[THRESHOLD] = "1048576"

    def arm(sharded: bool) -> Callable[[], dict[str, Any]]:
        def call() -> dict[str, Any]:
            runner = HorovodRunner(np=-2)
            saved = runner.run(checkpoint_peak, action="save", layers=layers, sharded=sharded)
            os.environ["MLFLOW_RUN_ID"] = str(runner.last_run_id)  # the same run, resumed
            try:
                restored = HorovodRunner(np=-2).run(checkpoint_peak, action="restore",
                                                    layers=layers, sharded=sharded)
            finally:
                os.environ.pop("MLFLOW_RUN_ID", None)  # MLflow may have taken it
            return {"save": saved, "restore": restored}
        return call

    arms = {"gathered (checkpoint.pt)": arm(False), "sharded (checkpoint.dcp)": arm(True)}
    try:
        results = alternate(arms, rounds)
    finally:
        os.environ.pop(THRESHOLD, None)
    state_mb = 3 * (layers * (2048 * 2048 + 2048) + 2048 * 10 + 10) * 4 / 1e6
    print(f"checkpoints: part 3's FSDP2 model and Adam ({state_mb:.0f} MB of parameters and "
          f"optimizer state), 2 local ranks ({THRESHOLD}=1048576), a SQLite store with local "
          f"artifacts, {rounds} "
          "rounds after a warm-up, arms rotated (each rank's peak resident MB above its "
          "start; seconds of the call)")
    med: dict[tuple[str, str, str], float] = {}
    for action in ("save", "restore"):
        for name, values in results.items():
            for rank in (0, 1):
                series = [v[action]["peaks"][rank] for v in values]
                med[(action, name, f"rank {rank}")] = statistics.median(series)
                print(summary(f"{action} {name} rank {rank}", series, "MB"))
            series = [v[action]["seconds"] for v in values]
            med[(action, name, "s")] = statistics.median(series)
            print(summary(f"{action} {name}", series, "s"))
    gathered, shard = arms
    for action in ("save", "restore"):
        for what in ("rank 0", "rank 1", "s"):
            print(f"{action}, {what}: sharded / gathered (medians) = "
                  f"{med[(action, shard, what)] / max(med[(action, gathered, what)], 1e-9):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--part", choices=("all", "launch", "throughput", "memory",
                                           "checkpoints", "lightning"),
                        default="all")
    parser.add_argument("--layers", type=int, default=8,
                        help="Linear(2048, 2048) layers of part 3's model (16.8 MB each)")
    parser.add_argument("--arm", action="append", default=[],
                        help="also a Horovod arm with these settings, e.g. cycle=2 (ms), "
                             "fusion=0 (MB), groups=1 (DistributedOptimizer's), or "
                             "horovod.spark.run (Horovod's own launcher); repeatable")
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    from mlflow_hvd.backends.spark import jvm

    spark = (SparkSession.builder.master("local-cluster[2,2,1024]")
             .appName("torch-distributor-bench")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.defaultJavaOptions", jvm.driver_java_options())
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        if args.part in ("all", "launch"):
            launch(spark, args.rounds)
        if args.part in ("all", "throughput"):
            throughput(spark, args.rounds, args.steps, args.arm)
        if args.part in ("all", "memory"):
            memory(args.rounds, args.layers)
        if args.part in ("all", "checkpoints"):
            checkpoints(args.rounds, args.layers)
        if args.part in ("all", "lightning"):
            lightning(spark, args.rounds, args.steps)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()

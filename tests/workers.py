"""Tiny training functions the integration tests run on every rank.

This module is pickled by value by HorovodRunner, so workers don't need ``tests`` on their
path.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import gloo_rendezvous  # by value, like this module: ranks cannot import tests/
from mlflow import log_metric, log_param  # MLflow's quickstart style (see quickstart)


def _rank() -> int:
    """This rank, as HorovodRunner gives it to every worker (``HOROVOD_RANK``): the failure
    workers need nothing else, so they import neither TensorFlow nor Horovod."""
    return int(os.environ["HOROVOD_RANK"])


def collectives(scale: float = 1.0) -> dict[str, Any]:
    """Real allreduce / allgather / broadcast; returns what this rank saw."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import mlflow_hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(tf.constant([float(rank + 1) * scale]), op=hvd.Sum)
    mean = hvd.allreduce(tf.constant([float(rank)]), op=hvd.Average)
    gathered = hvd.allgather(tf.constant([rank * 10, rank * 10 + 1]))
    bcast = hvd.broadcast(tf.constant([float(rank + 100)]), root_rank=0)
    print(f"hello from rank {rank} on stdout")
    mlflow_hvd.log_to_driver(f"rank {rank} of {size} says hi")
    return {
        "rank": rank,
        "size": size,
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "sum": total.numpy().tolist(),
        "mean": mean.numpy().tolist(),
        "gathered": gathered.numpy().tolist(),
        "broadcast": bcast.numpy().tolist(),
        "pid": os.getpid(),
    }


def torch_collectives(steps: int = 3) -> dict[str, Any]:
    """horovod.torch's allreduce, allgather and broadcast; then ``hvd.DistributedOptimizer``
    on ranks that each see their own data: returns what rank 0 saw, every rank's loss and
    every rank's weights after ``steps`` steps (gathered)."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum)
    mean = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Average)
    gathered = hvd.allgather(torch.tensor([rank * 10, rank * 10 + 1]))
    bcast = hvd.broadcast(torch.tensor([float(rank + 100)]), root_rank=0)
    torch.manual_seed(rank)  # each rank its own initial weights and data
    model = torch.nn.Linear(4, 1)
    initial = torch.cat([p.detach().flatten() for p in model.parameters()])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast_initial = torch.cat([p.detach().flatten() for p in model.parameters()])
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 4) + rank
        loss = ((model(x) - float(rank)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "size": size, "sum": total.tolist(), "mean": mean.tolist(),
        "gathered": gathered.tolist(), "broadcast": bcast.tolist(),
        "initial": hvd.allgather(initial.unsqueeze(0)).tolist(),
        "broadcast_initial": hvd.allgather(broadcast_initial.unsqueeze(0)).tolist(),
        "losses": hvd.allgather(torch.tensor([losses])).tolist(),
        "weights": hvd.allgather(weights.unsqueeze(0)).tolist(),
    }


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "GLOO_SOCKET_IFNAME")


def ddp_as_pytorch_writes_it(steps: int = 3, with_horovod: bool = False,
                             fail_attempt_on_rank_1: int = -1) -> dict[str, Any]:
    """A training function as PyTorch's DDP tutorial and TorchDistributor's docs write it:
    ``init_process_group("gloo")`` from the environment, ``LOCAL_RANK``, a
    ``DistributedSampler`` and ``DistributedDataParallel``; optionally ``horovod.torch`` in the
    same function. ``steps`` epochs, each checkpointed by ``mlflow_hvd.torch`` (no Horovod
    needed) and resumed from after a failure: rank 1 raises at the start of epoch 1 on
    attempt ``fail_attempt_on_rank_1``. Returns rank 0's view: every rank's torchrun
    variables, ranks, shard and weights (gathered by torch.distributed), and the epoch it
    started from."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from mlflow_hvd import torch as hvd_torch

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    horovod = None
    if with_horovod:
        import horovod.torch as hvd

        hvd.init()
        horovod = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
                   "sum": hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum).tolist()}
    data = TensorDataset(torch.arange(16.0)[:, None].repeat(1, 4), torch.arange(16.0)[:, None])
    sampler = DistributedSampler(data, shuffle=False)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    torch.manual_seed(rank)  # each rank its own initial weights: DDP broadcasts rank 0's
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=hvd_torch.scale_learning_rate(0.001))
    start = hvd_torch.restore_from_checkpoint(model, optimizer)  # every rank gets it
    seen = []
    for epoch in range(start, steps):
        if epoch == 1 and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == \
                fail_attempt_on_rank_1:
            dist.barrier()  # rank 0 committed epoch 0's checkpoint
            if rank == 1:
                raise RuntimeError("rank 1 fails this attempt")
        for x, y in loader:
            seen.extend(int(v) for v in y.flatten())
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        hvd_torch.save_checkpoint(model, optimizer, epoch, epoch, {"loss": float(loss)})
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    mine = {"env": {k: os.environ.get(k) for k in TORCHRUN_VARS}, "rank": rank,
            "world": world, "local_rank": local_rank, "horovod": horovod,
            "host": socket.gethostname(),
            "seen": sorted(set(seen)), "weights": weights.tolist(),
            "lr": optimizer.param_groups[0]["lr"]}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    return {"ranks": everyone, "start": start}


def ddp_killed_mid_allreduce(pid_dir: str) -> None:
    """Rank 1 is killed (SIGKILL) between two of the job's allreduces; rank 0 goes on into
    the next, whose peer is gone. Each rank first writes its pid to ``pid_dir``."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    Path(pid_dir, f"rank{rank}").write_text(str(os.getpid()))
    tensor = torch.ones(1 << 20)
    for _ in range(3):
        dist.all_reduce(tensor)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(3):
        dist.all_reduce(tensor)


def nccl_on_cpu() -> None:
    """``init_process_group("nccl")`` as GPU code writes it, on a rank without a GPU."""
    import torch.distributed as dist

    dist.init_process_group("nccl")


def model_after_mlflows_metrics() -> None:
    """Epoch metrics through MLflow's own API, then a model through mlflow_hvd's log_model:
    the model links to the latest step either API logged."""
    import mlflow
    import torch

    from mlflow_hvd import torch as hvd_torch

    mlflow.log_metric("loss", 0.5, step=5)
    mlflow.log_metrics({"accuracy": 0.9}, step=3)
    hvd_torch.log_model(torch.nn.Linear(2, 1), name="model")


def sharded_files_moved(chunk: int = 1000) -> dict[str, Any]:
    """mlflow_hvd.torch.sharded's file transfers on a Gloo group, ``chunk`` bytes a message:
    every rank's files to rank 0 (an empty file, files ending on a chunk boundary and past
    one), then rank 0's files to every rank. Returns what each rank wrote, what rank 0's
    ``upload`` saw, what rank 0 kept, and what each rank received (sha256 by name)."""
    import hashlib
    import tempfile

    import torch.distributed as dist

    from mlflow_hvd.torch import sharded

    def digest(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    saved, sharded.CHUNK = sharded.CHUNK, chunk
    try:
        with tempfile.TemporaryDirectory() as mine, tempfile.TemporaryDirectory() as other:
            written = {}
            for i, size in enumerate([[0, 2 * chunk + 500, chunk], [chunk - 1, 1, 3 * chunk + 1]]
                                     [rank % 2]):
                path = os.path.join(mine, f"r{rank}_{i}")
                with open(path, "wb") as f:
                    f.write(os.urandom(size))
                written[os.path.basename(path)] = digest(path)
            uploaded: dict[str, str] = {}
            names = sharded.to_rank0(mine, lambda p: uploaded.update(
                {os.path.basename(p): digest(p)}) if rank == 0 else None)
            kept = sorted(os.listdir(mine))
            target = mine if rank == 0 else other
            sharded.from_rank0(target)
            received = {n: digest(os.path.join(target, n)) for n in os.listdir(target)}
    finally:
        sharded.CHUNK = saved
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"written": written, "received": received})
    dist.destroy_process_group()
    return {"names": names, "uploaded": uploaded, "kept": kept, "ranks": everyone}


def fsdp_gradients(steps: int = 1) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` on a CPU mesh, Gloo) next to a plain copy of the same model on
    every rank, each rank its own batch: returns rank 0's view of the largest difference
    between FSDP's sharded gradient (made whole) and the mean of the ranks' plain gradients
    (pytorch#162338: Gloo asked for an average summing instead would double it), and what
    each rank holds of the parameters."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    plain = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(100 + rank)
    x = torch.randn(4, 8)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    worst, ratios = 0.0, []
    for sharded, own in zip(model.parameters(), plain.parameters(), strict=True):
        mean = own.grad.clone()
        dist.all_reduce(mean)
        mean /= world
        full = sharded.grad.full_tensor()
        worst = max(worst, float((full - mean).abs().max()))
        ratios.append(float(full.norm() / mean.norm()))
    held = sum(p.to_local().numel() for p in model.parameters())
    whole = sum(p.numel() for p in plain.parameters())
    dist.destroy_process_group()
    return {"worst": worst, "ratios": ratios, "held": held, "whole": whole,
            "torch": torch.__version__}


def raise_on_rank_1() -> None:
    if _rank() == 1:
        raise ValueError("boom from rank 1")
    time.sleep(120)  # rank 0 idles until the driver stops it


def exit_3_on_rank_1() -> None:
    if _rank() == 1:
        print("rank 1 about to exit with status 3", flush=True)
        os._exit(3)
    time.sleep(120)


def sigkill_on_rank_1() -> None:
    if _rank() == 1:
        print("rank 1 about to SIGKILL itself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def log_level_seen() -> str:
    """The lifecycle log level this rank's process was given ("" if none)."""
    import logging

    return logging.getLevelName(logging.getLogger("mlflow_hvd").level)


def echo(**kwargs: Any) -> dict[str, Any]:
    """No Horovod at all: returns its kwargs, rank (from the environment) and pid."""
    return {"kwargs": kwargs, "rank": int(os.environ["HOROVOD_RANK"]), "pid": os.getpid()}


def echo_at(gate: str, **kwargs: Any) -> dict[str, Any]:
    """echo() once the file ``gate`` exists (waits up to 240 s): holds the ranks until the
    test did what it does while they run."""
    _wait_for_file(gate, 240)
    return echo(**kwargs)


def long_line(nbytes: int) -> int:
    print("x" * nbytes, flush=True)
    print("after the long line", flush=True)
    return nbytes


def keras_numerics(steps: int = 5, rows: int = 64, learning_rate: float = 0.05) -> dict[str, Any]:
    """Train a small dense model with plain SGD on a fixed data set.

    Rank r starts from weights seeded with r (so only the broadcast makes them equal) and
    trains on its equal contiguous shard with batch = shard; with averaged gradients, np=2
    must match np=1 on the full batch. Returns rank 0's weights and, for every rank, a
    checksum of its final weights.
    """
    import horovod.tensorflow as hvd
    import keras
    import numpy as np

    from mlflow_hvd import keras as hvd_keras
    from mlflow_hvd.data import shard_arrays

    hvd.init()
    rng = np.random.default_rng(123)
    x = rng.normal(size=(rows, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32") + 0.1).astype("float32")
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    xs, ys = shard_arrays([x, y], hvd.rank(), hvd.size())
    model.fit(
        xs, ys, batch_size=len(xs), epochs=steps, shuffle=False, verbose=0,
        callbacks=[hvd_keras.BroadcastGlobalVariablesCallback(0)],
    )
    weights = [w.tolist() for w in model.get_weights()]
    checksum = float(sum(float(np.abs(w).sum()) for w in model.get_weights()))
    checksums = hvd.allgather_object(checksum)
    return {"weights": weights, "checksums": checksums, "type": type(model.optimizer).__name__}


def log_some(n_steps: int = 3) -> str | None:
    """Every rank calls the tracking API; only rank 0's calls may land."""
    from mlflow_hvd import tracking

    rank = _rank()
    tracking.log_params({"alpha": 0.5, "rank_that_logged": rank})
    tracking.log_params({"alpha": 0.5})  # same value again: a no-op
    for step in range(n_steps):
        tracking.log_metrics({"m": float(step * 10 + rank)}, step=step)
    tracking.set_tags({"who": f"rank{rank}"})
    tracking.log_dict({"rank": rank}, "info/rank.json")
    return tracking.run_id()


def log_without_mlflow(n: int = 300) -> dict[str, Any]:
    """Rank 0 logs a param, a metric per step, a tag and a checkpoint-style commit, all
    written by the driver; returns whether this process ever imported MLflow."""
    import sys

    from mlflow_hvd import tracking

    tracking.log_params({"lr": 0.1})
    for i in range(n):
        tracking.log_metrics({"loss": 1.0 / (i + 1)}, step=i)
    tracking.set_tags({"phase": "done"})
    tracking.commit({"epoch_loss": 0.5}, step=n, tags={"ckpt": "epoch_1"})
    tracking.flush()
    return {"mlflow_loaded": "mlflow" in sys.modules}


def artifact_after_metrics() -> tuple[bool, bool]:
    """Rank 0 logs a metric, then a file: returns whether MLflow was imported before the
    file was queued and right after (on this thread, before the delivery thread needs it)."""
    import sys

    from mlflow_hvd import tracking

    tracking.log_metrics({"a": 1.0}, step=0)
    before = "mlflow" in sys.modules
    tracking.log_dict({"x": 1}, "d/x.json")
    after = "mlflow" in sys.modules
    tracking.flush()
    return before, after


def metric_then_file() -> None:
    """Rank 0 logs a metric (stored before going on), then a file."""
    from mlflow_hvd import tracking

    tracking.log_metrics({"before_file": 1.0}, step=0)
    tracking.flush()
    tracking.log_dict({"x": 1}, "f/x.json")
    tracking.flush()


def sleep_forever() -> None:
    print("worker sleeping", flush=True)
    import mlflow_hvd

    mlflow_hvd.log_to_driver("ready")
    time.sleep(600)


def quadratic_trial(x: float, y: int, fail_marker: str = "") -> float:
    """A sweep trial: a real allreduce, then logs val_loss = (x - 0.3)^2 + y / 10.

    With ``fail_marker``, the first trial to run creates the file and raises.
    """
    import horovod.tensorflow as hvd
    import tensorflow as tf

    return _quadratic(hvd, tf.constant, x, y, fail_marker)


def quadratic_torch_trial(x: float, y: int, fail_marker: str = "") -> float:
    """:func:`quadratic_trial` on horovod.torch (a rank imports PyTorch in a third of
    TensorFlow's time): the sweep tests that need no TensorFlow use it."""
    import horovod.torch as hvd
    import torch

    return _quadratic(hvd, torch.tensor, x, y, fail_marker)


def _quadratic(hvd: Any, tensor: Any, x: float, y: int, fail_marker: str) -> float:
    from mlflow_hvd import tracking

    hvd.init()
    if fail_marker and _first_to_claim(hvd, tensor, fail_marker):
        if hvd.rank() == 0:
            raise RuntimeError("first trial fails on purpose")
        return 0.0
    mean_x = float(hvd.allreduce(tensor(float(x)), op=hvd.Average))
    loss = (mean_x - 0.3) ** 2 + y / 10.0
    tracking.log_metrics({"val_loss": loss + 1.0}, step=0)
    tracking.log_metrics({"val_loss": loss}, step=1)  # the last step's value counts
    return loss


def _first_to_claim(hvd: Any, tensor: Any, marker: str) -> bool:
    """Whether this job is the first to create ``marker``: rank 0 creates it atomically
    (trials running at once race for it: a check then a write let two of them fail) and
    the verdict reaches every rank in an allreduce."""
    claimed = 0.0
    if hvd.rank() == 0:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            claimed = 1.0
        except FileExistsError:
            pass
    return float(hvd.allreduce(tensor(claimed), op=hvd.Sum)) > 0


def model_trial(x: float, offset: float = 0.0) -> float:
    """A sweep trial that logs val_loss = x + offset and, on rank 0, a one-weight torch model
    holding x (so the model a registry serves can be traced to its trial)."""
    import horovod.torch as hvd
    import torch

    from mlflow_hvd import torch as hvd_torch
    from mlflow_hvd import tracking

    hvd.init()
    mean_x = float(hvd.allreduce(torch.tensor(float(x)), op=hvd.Average))
    tracking.log_metrics({"val_loss": mean_x + offset}, step=0)
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(mean_x)
    hvd_torch.log_model(model)
    return mean_x + offset


def paced_trial(x: float, epochs: int = 3, seconds: float = 0.5) -> float:
    """A sweep trial whose cost is time, not cores: each epoch sleeps ``seconds`` and logs
    val_loss = (x - 0.3)^2 + 1 / epoch (1-based); stops when told to prune."""
    import horovod.torch as hvd
    import torch

    import mlflow_hvd
    from mlflow_hvd import tracking

    hvd.init()
    mean_x = float(hvd.allreduce(torch.tensor(float(x)), op=hvd.Average))
    loss = 0.0
    for epoch in range(epochs):
        time.sleep(seconds)
        loss = (mean_x - 0.3) ** 2 + 1.0 / (epoch + 1)
        tracking.log_metrics({"val_loss": loss}, step=epoch)
        if hvd.rank() == 0:
            mlflow_hvd.log_to_driver(f"epoch {epoch} done")
        if tracking.should_prune():
            break
    return loss


def takes_anything(**kwargs: Any) -> int:
    return len(kwargs)


def keras_misuse() -> dict[str, str]:
    """Every misuse of the Keras layer that must be refused, on every rank: the messages."""
    import horovod.tensorflow as hvd
    import keras

    from mlflow_hvd import keras as hk
    from mlflow_hvd.errors import ConfigurationError

    hvd.init()
    found: dict[str, str] = {}

    def catch(key: str, action: Any) -> None:
        try:
            action()
        except ConfigurationError as exc:
            found[key] = str(exc)

    def model(layers: int, **compile_args: Any) -> Any:
        m = keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(2) for _ in range(layers)])
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **compile_args)
        return m

    def on_train_begin(m: Any) -> None:
        cb = hk.BroadcastGlobalVariablesCallback(0)
        cb.set_model(m)
        cb.on_train_begin()

    catch("scale", lambda: hk.scale_learning_rate(0))
    catch("optimizer", lambda: hk.DistributedOptimizer("adam"))
    catch("warmup", lambda: hk.LearningRateWarmupCallback(0.1, -1, steps_per_epoch=10))
    catch("every", lambda: hk.MlflowCallback(log_every_n_steps=0))

    def warmup_without_steps() -> None:  # fit of a dataset of unknown length
        cb = hk.LearningRateWarmupCallback(0.1, warmup_epochs=1)
        cb.set_params({"epochs": 1})
        cb.on_train_begin()

    catch("steps", warmup_without_steps)
    catch("restore", lambda: hk.restore_from_checkpoint(keras.Sequential([keras.Input((4,))])))
    catch("xla", lambda: on_train_begin(model(1, jit_compile=True)))
    # rank 0 builds one more layer than the others: broadcasting would hang or corrupt
    catch("counts", lambda: on_train_begin(model(2 if hvd.rank() == 0 else 1)))
    return found


def wait_for_metric_values(key: str, count: int, timeout: float = 60.0) -> int:
    """Every rank polls the job's run until ``key`` has ``count`` values (or the deadline)."""
    from mlflow import MlflowClient

    from mlflow_hvd import tracking

    target = tracking.tracking_target()
    assert target is not None, "run this with tracking on"
    client = MlflowClient(tracking_uri=target.tracking_uri)
    deadline = time.monotonic() + timeout
    while True:
        seen = len(client.get_metric_history(target.run_id, key))
        if seen >= count or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def layout_everywhere() -> list[dict[str, Any]]:
    """Every rank's place in the job (gathered to all) and a cross-host allreduce."""
    import socket

    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    total = float(hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum).numpy())
    mine = {
        "hostname": socket.gethostname(),
        "rank": hvd.rank(),
        "local_rank": hvd.local_rank(),
        "cross_rank": hvd.cross_rank(),
        "size": hvd.size(),
        "local_size": hvd.local_size(),
        "cross_size": hvd.cross_size(),
        "sum": total,
        "gloo_iface": os.environ.get("HOROVOD_GLOO_IFACE", ""),
    }
    return sorted(hvd.allgather_object(mine), key=lambda d: d["rank"])


def interpreter_everywhere() -> list[dict[str, Any]]:
    """Every rank's interpreter (its venv's prefix and executable), gathered to all."""
    import sys

    import horovod.tensorflow as hvd

    hvd.init()
    mine = {"rank": hvd.rank(), "prefix": sys.prefix, "executable": sys.executable}
    return sorted(hvd.allgather_object(mine), key=lambda d: d["rank"])


def sleep_after_init(seconds: float = 600.0, store: bool = False) -> None:
    """Join the job (with ``store``, torch.distributed's group too, through the job's store
    on the driver), then idle: a job that only ends when something fails."""
    import horovod.tensorflow as hvd

    hvd.init()
    print(f"rank {hvd.rank()} idling", flush=True)
    import mlflow_hvd

    where = (os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
             os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
    line = f"rank {hvd.rank()} up; rendezvous at {':'.join(where)}"
    if store:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        line += f"; store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    mlflow_hvd.log_to_driver(line)
    time.sleep(seconds)


def log_steadily(n: int, interval: float, until: str | None = None,
                 api: str = "mlflow_hvd") -> int:
    """Rank 0 logs metric ``x`` = i at step i, one every ``interval`` seconds, plus a tag, a
    param and an artifact half-way; then, if ``until`` is given, waits (at most 300 s) for
    that file to exist. Returns how many values it logged. ``api``: ``"mlflow_hvd"``
    (:mod:`mlflow_hvd.tracking`), ``"mlflow"`` (MLflow's own fluent functions) or
    ``"both"``: even steps and the tag through the first, odd steps, the param and the
    artifact through MLflow's."""
    import mlflow

    from mlflow_hvd import tracking as ours

    first = mlflow if api == "mlflow" else ours
    second = ours if api == "mlflow_hvd" else mlflow
    for i in range(n):
        (first if i % 2 == 0 else second).log_metric("x", float(i), step=i)
        if i == n // 2:
            first.set_tag("half", "yes")
            second.log_param("p", "at-half")
            second.log_dict({"i": i}, "mid/state.json")
        time.sleep(interval)
    deadline = time.monotonic() + 300
    while until is not None and not os.path.exists(until):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{until} did not appear within 300 s")
        time.sleep(0.1)
    return n


def kill_group_then_return(pgid: int, value: Any = "done", log_n: int = 0,
                           ended: str = "") -> Any:
    """Rank 0 SIGKILLs a process group (e.g. the MLflow server), then logs ``log_n``
    values of ``y``, a tag and an artifact (if ``log_n``), writes the time its function
    ends to ``ended`` (if given) and returns ``value``."""
    from mlflow_hvd import tracking

    if _rank() == 0:
        os.killpg(pgid, signal.SIGKILL)
    for i in range(log_n):
        tracking.log_metric("y", float(i), step=i)
    if log_n:
        tracking.set_tag("after", "kill")
        tracking.log_dict({"n": log_n}, "late/n.json")
    if ended:
        Path(ended).write_text(repr(time.time()))
    return value


def kill_group_then_raise(pgid: int, ended: str = "") -> None:
    """Rank 0 SIGKILLs a process group (e.g. the MLflow server), then raises."""
    kill_group_then_return(pgid, ended=ended)
    raise RuntimeError("the job's own error")


def keras_dropin_checks() -> dict[str, Any]:
    """The drop-in namespace on every rank: tape averaging, kwargs honoured or refused,
    Horovod's schedule callback."""
    import horovod.tensorflow as hvd_tf
    import keras
    import numpy as np
    import tensorflow as tf

    import mlflow_hvd.keras as hvd

    hvd.init()
    out: dict[str, Any] = {}

    def refused(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "accepted"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    sgd = keras.optimizers.SGD
    refused("bpps", lambda: hvd.DistributedOptimizer(sgd(), backward_passes_per_step=2))
    refused("groups", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), num_groups=2))
    refused("unknown", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), colour="red"))
    refused("global_vars", lambda: hvd.broadcast_global_variables(0))
    refused("adasum", lambda: hvd.DistributedOptimizer(sgd(), op=hvd_tf.Adasum))
    refused("predivide", lambda: hvd.DistributedOptimizer(
        sgd(), op=hvd.Sum, gradient_predivide_factor=2.0))
    refused("process_set", lambda: hvd.DistributedOptimizer(sgd(), process_set=object()))
    refused("not_a_tape", lambda: hvd.DistributedGradientTape(object()))

    # the tape: each rank's gradient differs; the distributed one is their mean everywhere
    w = keras.Variable(np.ones(3, dtype="float32"))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(hvd.rank() + 1))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)
    (grad,) = tape.gradient(loss, [w])
    out["tape"] = hvd.allgather_object(grad.numpy().tolist())

    # Horovod's schedule: lr = initial_lr * multiplier(epoch), per epoch (staircase)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name="sgd",
                                           sparse_as_dense=True), "mse", jit_compile=False)
    history = model.fit(
        np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32"), epochs=3, batch_size=4,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                   hvd.callbacks.LearningRateScheduleCallback(0.1, lambda e: 0.5**e)],
    )
    out["schedule"] = [round(v, 6) for v in history.history["effective_learning_rate"]]

    # Horovod's warmup signature, steps_per_epoch inferred from fit: initial_lr / size at
    # the first batch, initial_lr once warmed up
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse", jit_compile=False)
    history = model.fit(
        np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32"), epochs=2, batch_size=4,
        verbose=0, callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=1)],
    )
    out["warmup"] = [round(v, 6) for v in history.history["effective_learning_rate"]]

    # broadcast_global_variables(root, model): rank 1's different weights become rank 0's
    model.layers[0].kernel.assign(np.full((2, 1), float(hvd.rank()), "float32"))
    hvd.broadcast_global_variables(0, model)
    out["broadcast"] = hvd.allgather_object(float(model.layers[0].kernel.numpy().sum()))

    # load_model: a saved model comes back with its optimizer distributed again
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model.save(f"{tmp}/m.keras")
        loaded = hvd.load_model(f"{tmp}/m.keras")
    out["loaded"] = [type(loaded.optimizer).__name__,
                     bool(getattr(loaded.optimizer, "_mlflow_hvd_distributed", False))]
    return out


def register_atexit(path: str) -> str:
    """Registers an atexit hook that would write ``path``; prints a line and returns."""
    import atexit

    atexit.register(lambda: open(path, "w").close())
    print("printed just before returning", flush=False)
    return "returned"


def pool_probe(k: int, fail: bool = False) -> dict[str, Any]:
    """Every rank: Horovod from scratch, an allreduce of rank + k, a fresh Keras layer name,
    metric ``k`` from rank 0; returns rank 0's view (pids of every rank included), and
    whether the reference cycle the previous job in this process left behind was collected
    (not frozen with what survives a job)."""
    import gc
    import sys
    import weakref

    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    from mlflow_hvd import tracking

    previous = getattr(sys, "_pool_probe_cycle", None)
    gc.enable()
    hvd.init()
    total = hvd.allreduce(tf.constant([float(hvd.rank() + k)]), op=hvd.Sum).numpy().tolist()
    pids = hvd.allgather_object(os.getpid())
    tracking.log_metric("k", float(k), step=0)
    if fail and hvd.rank() == 1:
        raise RuntimeError(f"job {k} fails on rank 1")
    out = {"sum": total, "pids": pids, "layer": keras.layers.Dense(1).name, "size": hvd.size(),
           "previous_cycle_collected": None if previous is None else previous() is None}
    # garbage in a reference cycle, which only a collection frees: the automatic one is
    # off until the next job, so only the pool's own collection between jobs can free it
    gc.disable()
    holder = type("Cycle", (), {})()
    holder.me = holder
    sys._pool_probe_cycle = weakref.ref(holder)  # type: ignore[attr-defined]
    del holder
    return out


def _wait_for_file(path: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds:g} s")
        time.sleep(0.05)


def burst_during_outage(n: int, down: str, spilled: str, back: str) -> int:
    """Rank 0 logs metric ``before``, waits until the test took the server down (``down``),
    logs ``n`` values of ``x`` at once, waits until its delivery has taken them all (into
    memory, then the spill file), writes how many were spilled to ``spilled``, waits for the
    server (``back``), then flushes. Returns how many records went to the spill file."""
    from mlflow_hvd import tracking
    from mlflow_hvd.rank.tracking.session import SESSION

    tracking.log_metric("before", 1.0, step=0)
    tracking.flush()
    _wait_for_file(down, 120)
    for i in range(n):
        tracking.log_metric("x", float(i), step=i)
    logger = SESSION.logger()
    assert logger is not None, "rank 0 logs"
    deadline = time.monotonic() + 60
    while sum(logger.delivery.queued()) < n and time.monotonic() < deadline:
        time.sleep(0.05)  # until the delivery thread has taken every value from its inbox
    count = logger.delivery.queued()[1]
    with open(spilled, "w") as f:
        f.write(str(count))
    _wait_for_file(back, 180)
    tracking.flush(timeout=180)
    return count


def log_into_a_deleted_run() -> None:
    """Rank 0 deletes the job's run (the store now refuses writes to it), then logs."""
    from mlflow import MlflowClient

    from mlflow_hvd import tracking

    target = tracking.tracking_target()
    assert target is not None, "run this with tracking on"
    MlflowClient(tracking_uri=target.tracking_uri).delete_run(target.run_id)
    tracking.log_metric("m", 1.0, step=0)


def count_lines(n: int) -> int:
    """A lightweight rank (no TensorFlow, no hvd.init): prints ``line 0`` .. ``line n-1``
    and returns its rank."""
    for i in range(n):
        print(f"line {i}", flush=True)
    return _rank()


def scale_rank(lines: int, metrics: int = 0, ranks_per_host: int | None = None,
               rendezvous_dir: str | None = None, spread: float = 0.0,
               rendezvous_timeout: float = 30.0) -> dict[str, int]:
    """A lightweight rank for scale tests (no TensorFlow): performs ``hvd.init()``'s HTTP
    rendezvous with horovod's server (:mod:`gloo_rendezvous`; ``rendezvous_dir``: an empty
    directory for this job, None: no rendezvous), logs ``metrics`` metrics
    through rank 0's tracking path (other ranks' calls do nothing, as in training), prints
    ``line 0`` .. ``line lines-1``; returns its rank and how many rendezvous requests it sent.
    ``spread``: ranks reach the rendezvous over this many seconds, as real ranks do (their
    TensorFlow imports end at different times), in a fixed order."""
    import mlflow_hvd.tracking as tracking

    size = int(os.environ["HOROVOD_SIZE"])
    time.sleep(spread * ((_rank() * 7919) % size) / size)

    requests = (gloo_rendezvous.rendezvous(rendezvous_dir, ranks_per_host, rendezvous_timeout)
                if rendezvous_dir else 0)
    for step in range(metrics):
        tracking.log_metric("loss", 1.0 / (step + 1), step=step)
    print(f"rendezvous requests {requests}", flush=True)
    for i in range(lines):
        print(f"line {i}", flush=True)
    return {"rank": _rank(), "requests": requests}


def horovod_knobs() -> list[dict[str, str]]:
    """Every rank's HOROVOD_* tuning variables (gathered on rank 0) after a few allreduces
    that the timeline records."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    for step in range(3):
        hvd.allreduce(tf.constant([float(hvd.rank() + step)]), name=f"knob_{step}")
    owned = {"HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
             "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
             "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
             "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_IFACE"}
    mine = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_") and k not in owned}
    mine["rank"] = str(hvd.rank())
    return hvd.allgather_object(mine)


def gpu_view(out_dir: str) -> None:
    """Each rank writes what it was given: the GPUs it sees, its task's own, its local rank
    (no TensorFlow: only the environment is looked at)."""
    import json
    import socket

    rank = _rank()
    view = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "MLFLOW_HVD_TASK_DEVICES",
                                           "HOROVOD_LOCAL_RANK")}
    view["host"] = socket.gethostname()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(view, f)


def quickstart(steps: int = 3, key: str = "loss") -> None:
    """MLflow's quickstart style: names bound with ``from mlflow import ...`` when this module
    was imported, before the job (on a rank: when the payload is unpickled)."""
    log_param("who", f"rank{_rank()}")
    for s in range(steps):
        log_metric(key, 1.0 / (s + 1), step=s)


def mlflow_writes() -> dict[str, Any]:
    """MLflow's own API as its docs write it: every kind of write into one run, a model
    linked to a step, and what the calls return. Run the same way without HorovodRunner, it
    is what a job's run is compared with."""
    import mlflow
    import numpy as np
    import pandas as pd
    from matplotlib.figure import Figure
    from sklearn.linear_model import LinearRegression

    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    x = np.arange(8, dtype="float64").reshape(4, 2)
    y = x @ np.array([1.0, 2.0])
    dataset = mlflow.data.from_numpy(x, targets=y, name="toy")
    with mlflow.start_run() as run:
        mlflow.log_param("alpha", 0.5)
        mlflow.log_params({"beta": 2})
        for step in range(3):
            mlflow.log_metric("m", step * 10.0, step=step, timestamp=1_000_000 + step)
        mlflow.log_metrics({"a": 1.0, "b": 2.0}, step=0, timestamp=1_000_100)
        mlflow.set_tag("who", f"rank{rank}")
        mlflow.set_tags({"t": "1"})
        mlflow.log_input(dataset, context="training")
        mlflow.log_metric("rmse", 0.5, step=1, timestamp=1_000_200, dataset=dataset)
        mlflow.log_dict({"rank": rank}, "info/doc.json")
        mlflow.log_text(f"rank {rank}", "info/note.txt")
        mlflow.log_table(pd.DataFrame({"x": [1, 2]}), "tables/t.json")
        mlflow.log_table(pd.DataFrame({"x": [3]}), "tables/t.json")  # appends: reads it back
        mlflow.log_image(np.zeros((4, 4, 3), dtype="uint8"), "img/zeros.png")
        fig = Figure()
        fig.add_subplot().plot([0, 1], [1, 0])
        mlflow.log_figure(fig, "img/fig.png")
        info = mlflow.sklearn.log_model(LinearRegression().fit(x, y), name="linear", step=2,
                                        input_example=x[:2], pip_requirements=["scikit-learn"])
        mlflow.log_metric("fit", 0.9, step=2, timestamp=1_000_300, model_id=info.model_id)
        inside = mlflow.active_run().info.run_id
        seen = mlflow.MlflowClient().get_run(run.info.run_id)
    return {"run": run.info.run_id, "inside": inside, "model_id": info.model_id,
            "model_run": info.run_id, "seen_params": dict(seen.data.params),
            "seen_status": seen.info.status}


def mlflow_as_documented(other_run: str) -> dict[str, Any]:
    """:func:`mlflow_writes` on every rank of a job, then what only a job's ranks do: user
    code ending "its" run and logging on, ``MlflowClient`` with the run's id, and the
    refusals (another run, a nested run)."""
    import mlflow

    from mlflow_hvd import MlflowHvdError, tracking

    before = mlflow.active_run()
    out = mlflow_writes()
    mlflow.end_run()  # user code ending the run: the driver's run stays open
    mlflow.log_metric("after", 1.0)  # a new "run": the job's
    client = mlflow.MlflowClient()
    client.log_metric(out["run"], "client", 2.0, step=7)
    if _rank() == 0:  # the server's view: still RUNNING, the driver ends it
        tracking.flush()
        server = mlflow.MlflowClient(tracking_uri=tracking.server_uri())
        out["server_status"] = server.get_run(out["run"]).info.status
    refused = []
    for call in (lambda: mlflow.start_run(nested=True),
                 lambda: mlflow.log_metric("x", 1.0, run_id=other_run),
                 lambda: client.set_tag(other_run, "x", "1")):
        try:
            call()
        except MlflowHvdError as exc:  # rank 0 (returned): ConfigurationError
            refused.append(f"{type(exc).__name__}: {str(exc).split(':')[0]}")
    after = mlflow.active_run()
    mlflow.end_run()
    return {**out, "before": before, "after": after.info.run_id if after else None,
            "refused": refused}


def quickstart_then_documented(other_run: str) -> dict[str, Any]:
    """Both of the above in one job (Spark ranks: one stage for both)."""
    import mlflow

    quickstart(key="quickstart_loss")  # "loss" is Keras' (spark_everything)
    mlflow.end_run()  # the quickstart's bare calls started (resumed) the run
    return mlflow_as_documented(other_run)


def mlflow_reads(model_uri: str, out_dir: str) -> None:
    """Reads that need the tracking server: rank 0 makes them, the others are told to get
    the result from rank 0. Each rank writes what it got to ``out_dir``."""
    import json

    import mlflow
    import numpy as np
    from sklearn.linear_model import LinearRegression

    from mlflow_hvd import TrackingError

    out: dict[str, Any] = {"rank": _rank()}
    with mlflow.start_run():
        info = mlflow.sklearn.log_model(LinearRegression().fit(np.eye(2), [0.0, 1.0]),
                                        name="fresh", pip_requirements=["scikit-learn"])
    calls = {
        "register": lambda: str(mlflow.register_model(info.model_uri, "from_rank_0").version),
        "search_runs": lambda: len(mlflow.search_runs(experiment_ids=["0"],
                                                      output_format="list")),
        "registry": lambda: [m.name for m in mlflow.MlflowClient().search_registered_models()],
        "load": lambda: mlflow.pyfunc.load_model(model_uri).predict(
            np.ones((1, 2))).tolist(),
    }
    for name, call in calls.items():
        try:
            out[name] = call()
        except TrackingError as exc:
            out[name] = str(exc)
    with open(os.path.join(out_dir, f"rank{_rank()}.json"), "w") as f:
        json.dump(out, f)


def autolog_state(enable: bool, flavor: str = "sklearn") -> bool:
    """Turn on MLflow's autolog if asked; report whether autolog is on for ``flavor`` (its
    state lives in this process)."""
    import mlflow
    import sklearn  # noqa: F401 - mlflow.autolog() turns on the flavors already imported
    from mlflow.utils.autologging_utils import autologging_is_disabled

    if enable:
        mlflow.autolog(log_models=False, silent=True)
    return not autologging_is_disabled(flavor)


def keras_autolog_with_callback(epochs: int = 2) -> str | None:
    """MLflow's Keras autolog and mlflow_hvd's MlflowCallback in the same fit."""
    import keras
    import mlflow
    import numpy as np

    import mlflow_hvd.keras as hvd

    hvd.init()
    mlflow.tensorflow.autolog(log_models=False, log_datasets=False, silent=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse",
                  jit_compile=False)
    x = np.random.RandomState(hvd.rank()).rand(32, 4).astype("float32")
    seen: list[str] = []

    class Seen(keras.callbacks.Callback):  # autolog's run, while fit runs (it ends it after)
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            seen.append(mlflow.active_run().info.run_id)

    model.fit(x, x.sum(1, keepdims=True), epochs=epochs, batch_size=8, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback(), hvd.MlflowCallback(), Seen()])
    return seen[0] if len(set(seen)) == 1 else None


def allreduce_many(n: int = 300) -> int:
    """Enough small allreduces for Horovod's autotuner to record samples."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    for i in range(n):
        hvd.allreduce(tf.ones([1000]), name=f"many_{i % 10}")
    return n


def torch_with_mlflows_own_api() -> dict[str, Any]:
    """A horovod.torch function that logs with MLflow's own API, as MLflow's PyTorch docs
    write it, on every rank: only rank 0's calls reach the job's run."""
    import horovod.torch as hvd
    import mlflow
    import mlflow.pytorch
    import numpy as np
    import torch

    hvd.init()
    model = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    with mlflow.start_run() as run:
        mlflow.log_param("layers", 1)
        mlflow.log_metric("weight_sum", float(model.weight.sum()), step=0)
        info = mlflow.pytorch.log_model(model, name="linear",
                                        input_example=np.zeros((2, 4), dtype="float32"))
    # mlflow_hvd's own: without an example, the pickle format; the class travels by value
    from mlflow_hvd import torch as hvd_torch

    class Doubler(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return 2 * x

    pickled = hvd_torch.log_model(Doubler(), name="doubler")
    return {"rank": hvd.rank(), "run": run.info.run_id,
            "model_id": info.model_id if info is not None else None,
            "pickled_id": pickled.model_id if pickled is not None else None,
            "size": hvd.size()}


def log_and_hold(seconds: float, extra_var: str = "") -> dict[str, Any]:
    """Rank 0 logs a metric and an artifact (flushed: through the server, now); every rank
    says whether it has the tracking password (and ``extra_var``), then that it is holding,
    and sleeps, for a test to look at its processes."""
    import mlflow_hvd
    from mlflow_hvd import tracking

    rank = _rank()
    tracking.log_metric("held", 1.0, step=0)
    tracking.log_dict({"rank": rank}, "held/rank.json")
    tracking.flush()
    here = bool(os.environ.get("MLFLOW_TRACKING_PASSWORD"))
    mlflow_hvd.log_to_driver(f"password here: {here}")
    if extra_var:
        mlflow_hvd.log_to_driver(f"{extra_var} here: {bool(os.environ.get(extra_var))}")
    if rank == 0:
        mlflow_hvd.log_to_driver("holding")
    time.sleep(seconds)
    return {"rank": rank, "password_here": here}


def curve_of(lr: float, epoch: int) -> float:
    """The synthetic trial's val_loss after 0-based ``epoch``: a fixed curve per ``lr``."""
    return (lr - 0.3) ** 2 + 1.0 / (epoch + 1)


def curve_trial(lr: float, epochs: int = 6, report: bool = True, obey: bool = True,
                fail_at_epoch: int | None = None, fail_above: float = -1.0,
                world: str = "horovod") -> int:
    """A sweep trial on horovod.torch whose val_loss per epoch is :func:`curve_of`.

    Every epoch ends in an allreduce, so ranks that left at different epochs would hang.
    ``report=False`` logs val_loss only once, without a step; ``obey=False`` never asks
    :func:`should_prune`. ``fail_at_epoch`` makes the first attempt of a trial whose ``lr``
    is above ``fail_above`` fail at the start of that epoch; a restart resumes after the
    last checkpoint (``mlflow_hvd.torch``). Rank 0
    tags the epochs every rank trained (``epochs_by_rank``); returns its own count.
    ``world="ddp"``: the same on torch.distributed (Gloo) instead of Horovod.
    """
    import torch

    import mlflow_hvd
    from mlflow_hvd import torch as hvd_torch
    from mlflow_hvd import tracking

    if world == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")

        def allreduce(name: str) -> None:
            dist.all_reduce(torch.ones(1))

        def gather(value: int) -> list[int]:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, value)
            return out
    else:
        import horovod.torch as hvd

        hvd.init()

        def allreduce(name: str) -> None:
            hvd.allreduce(torch.ones(1), name=name)

        def gather(value: int) -> list[int]:
            return list(hvd.allgather_object(value))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = hvd_torch.restore_from_checkpoint(model, optimizer)
    trained = 0
    for epoch in range(start, epochs):
        if fail_at_epoch == epoch and lr > fail_above and mlflow_hvd.attempt() == 0:
            raise RuntimeError(f"injected failure at the start of epoch {epoch}")
        allreduce(f"epoch.{epoch}")
        trained += 1
        value = curve_of(lr, epoch)
        if report:
            hvd_torch.save_checkpoint(model, optimizer, epoch, epoch, {"val_loss": value})
        if obey and tracking.should_prune():
            break
    if not report:
        tracking.log_metric("val_loss", curve_of(lr, epochs - 1))
    counts = gather(start + trained)
    tracking.set_tag("epochs_by_rank", ",".join(map(str, counts)))
    return start + trained


def shard_census(data: Any, val: Any = None, batch_size: int = 100) -> list[dict[str, Any]]:
    """Every rank's view of its shard(s) of a DataFrame, gathered at rank 0."""
    import socket

    import horovod.tensorflow as hvd

    hvd.init()
    ids = [int(i) for b in data.batches(1, shuffle=False) for i in b["id"]]
    mine: dict[str, Any] = {
        "rank": hvd.rank(), "host": socket.gethostname(), "rows": data.rows,
        "steps": data.steps(batch_size), "ids": ids, "dropped": data.dropped,
        "total": data.total_rows, "columns": data.columns,
        "x_shape": next(data.batches(4))["x"].shape,
    }
    if val is not None:
        first = next(val.batches(2, shuffle=False))
        mine.update(val_rows=val.rows, val_columns=val.columns,
                    val_first=[first[c][0] for c in val.columns])
    return hvd.allgather_object(mine)


def keras_fit_on_shard(data: Any, epochs: int = 2, batch_size: int = 64) -> dict[str, Any]:
    """The eight steps on a DataFrame shard: Keras fit without steps_per_epoch."""
    import horovod.tensorflow as hvd
    import keras

    from mlflow_hvd import keras as hvd_keras

    hvd.init()
    ds = data.tf_dataset(batch_size, label="label", features=["x"], seed=1)
    optimizer = hvd_keras.DistributedOptimizer(
        keras.optimizers.SGD(hvd_keras.scale_learning_rate(0.01)))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    history = model.fit(ds, epochs=epochs, verbose=0,
                        callbacks=[hvd_keras.BroadcastGlobalVariablesCallback(0)])
    steps = hvd.allgather_object(data.steps(batch_size))
    return {"losses": history.history["loss"], "steps": steps,
            "epochs_read": data.next_epoch}


def torch_loop_on_shard(data: Any, epochs: int = 2, batch_size: int = 50) -> dict[str, Any]:
    """A horovod.torch loop over a DataFrame shard's DataLoader."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loader = data.torch_loader(batch_size, label="label", features=["x"])
    batches = 0
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y.float())
            loss.backward()
            optimizer.step()
            batches += 1
    return {"batches": hvd.allgather_object(batches), "len": len(loader)}


def shard_trial(data: Any, lr: float) -> float:
    """A sweep trial over a DataFrame shard: logs ``val_loss`` and the rank's pid (warm
    ranks serve every trial from the same processes, fed once)."""
    import horovod.tensorflow as hvd
    import numpy as np

    from mlflow_hvd import tracking

    hvd.init()
    mean = float(np.mean([b["x"].mean() for b in data.batches(50)]))
    loss = (lr - 0.3) ** 2 + mean * 0.0
    tracking.log_params({"rank0_pid": os.getpid()})
    tracking.log_metrics({"val_loss": loss}, step=0)
    return loss


def census_after_a_failed_attempt(data: Any) -> list[dict[str, Any]]:
    """Rank 1 fails the job's first attempt once it has read its shard; the next attempt
    (new ranks, fed again) takes the census."""
    import mlflow_hvd

    if mlflow_hvd.attempt() == 0 and int(os.environ["HOROVOD_RANK"]) == 1:
        sum(len(b["id"]) for b in data.batches(10))
        raise RuntimeError("injected failure on attempt 0")
    return shard_census(data, batch_size=10)


def first_rows(data: Any) -> dict[str, Any]:
    """Rank 0's first rows of every column (file order), with their numpy dtypes."""
    batch = next(data.batches(2, shuffle=False))
    return {name: (batch[name].tolist(), str(batch[name].dtype)) for name in data.columns}


def where_my_shard_is(data: Any) -> tuple[str, bool]:
    """The path of this rank's shard file, and whether it is there (it is, while the job runs)."""
    return data._file.path, os.path.exists(data._file.path)


def frameworks_log_models(epochs: int = 2, torch: bool = True) -> dict[str, Any]:
    """On every rank: Keras fit under MLflow's TensorFlow autolog (which logs the model),
    then each framework's ``log_model`` (TensorFlow/Keras, PyTorch) as MLflow's docs write
    it, with an input example. Returns what MLflow returned here."""
    import keras
    import mlflow
    import numpy as np

    import mlflow_hvd.keras as hvd

    hvd.init()
    mlflow.tensorflow.autolog(log_datasets=False, silent=True)  # log_models: MLflow's default
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse",
                  jit_compile=False)
    x = np.random.RandomState(hvd.rank()).rand(32, 4).astype("float32")
    seen: list[str] = []

    class Seen(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            seen.append(mlflow.active_run().info.run_id)

    model.fit(x, x.sum(1, keepdims=True), epochs=epochs, batch_size=8, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback(), Seen()])
    mlflow.tensorflow.autolog(disable=True)
    out: dict[str, Any] = {"seen": seen, "rank": hvd.rank()}
    with mlflow.start_run() as run:
        keras_info = mlflow.tensorflow.log_model(model, name="keras_model", input_example=x[:2])
        out.update(run=run.info.run_id, keras=[keras_info.model_id, keras_info.run_id])
        if torch:
            import torch as th

            net = th.nn.Linear(4, 1)
            torch_info = mlflow.pytorch.log_model(net, name="torch_model",
                                                  input_example=x[:2])
            out["torch"] = [torch_info.model_id, torch_info.run_id]
    return out


def spark_everything(other_run: str, torch: bool = True) -> dict[str, Any]:
    """One Spark job for every case: the quickstart, MLflow's documented calls, and the
    frameworks' autolog and log_model."""
    import mlflow

    out = quickstart_then_documented(other_run)
    mlflow.end_run()
    out["frameworks"] = frameworks_log_models(epochs=2, torch=torch)
    return out


def log_model_in_an_outage(folder: str) -> dict[str, Any]:
    """Rank 0 logs a metric and, once the test has stopped the tracking server, a model
    with MLflow's own API: the model needs an id from the server. Files in ``folder`` pace
    it: ``ready`` (written here), ``down`` and ``back`` (written by the test)."""
    import mlflow
    from sklearn.linear_model import LinearRegression

    from mlflow_hvd import TrackingError

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(folder, name)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {name} from the test")
            time.sleep(0.1)

    Path(folder, "ready").touch()
    wait_for("down")
    mlflow.log_metric("during", 1.0, step=3)  # queued: kept through the outage
    started = time.monotonic()
    try:
        mlflow.sklearn.log_model(LinearRegression().fit([[0.0], [1.0]], [0.0, 1.0]),
                                 name="m", pip_requirements=["scikit-learn"])
        said = "logged"
    except TrackingError as exc:
        said = str(exc)
    waited = time.monotonic() - started
    Path(folder, "tried").touch()
    wait_for("back")
    return {"said": said, "waited": waited}


def torch_loader_census(data: Any, counts: tuple[int, ...] = (0, 1, 2), epochs: int = 2,
                        batch_size: int = 50) -> list[dict[str, Any]]:
    """Each rank reads its shard through ``DataLoader`` worker processes (``forkserver``:
    Horovod is initialised, forking is not safe), for each number of workers: the ids of
    each epoch, in the order they came."""
    import horovod.torch as hvd

    hvd.init()
    seen: dict[str, Any] = {}
    for count in counts:
        options: dict[str, Any] = {"num_workers": count}
        if count:
            options["multiprocessing_context"] = "forkserver"
        data.next_epoch = 0  # each count reads the same epochs, from 0
        loader = data.torch_loader(batch_size, label="label", features=["id", "x"], seed=11,
                                   **options)
        seen[str(count)] = {"len": len(loader), "epochs": [
            [int(i) for x, _ in loader for i in x["id"]] for _ in range(epochs)]}
    return hvd.allgather_object(seen)


def set_own_tracking_uri(uri: str) -> str:
    """Training code that points MLflow elsewhere (as some notebooks do)."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.get_tracking_uri()


def horovod_elastic_loop(epochs: int = 2) -> int:
    """Code written for Horovod elastic, as its docs write it: a TorchState and a training
    function under ``@hvd.elastic.run`` that commits each epoch."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    model = torch.nn.Linear(2, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0)

    @hvd.elastic.run
    def train(state: Any) -> int:
        while state.epoch < epochs:
            optimizer.zero_grad()
            model(torch.ones(4, 2)).sum().backward()
            optimizer.step()
            state.epoch += 1
            state.commit()
        return int(state.epoch)

    return train(state)


def _wait_for_gate(gate: str, epoch: int, deadline_s: float = 300.0) -> None:
    """Rank 0 waits until the test's gate file allows ``epoch`` (holds a number >= it)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            allowed = int(Path(gate).read_text().strip() or -1)
        except (OSError, ValueError):
            allowed = -1
        if allowed >= epoch:
            return
        if time.monotonic() > end:
            raise TimeoutError(f"the gate {gate} did not allow epoch {epoch} in {deadline_s}s")
        time.sleep(0.2)


def gated_elastic_torch(data: Any, epochs: int, gate: str) -> dict[str, Any]:
    """An FSDP2 model (torch.distributed, Gloo) on a DataFrame shard, one epoch at a time
    as the test's gate file allows (rank 0 reads it; the others wait in a barrier), with
    sharded checkpoints (each rank's part, torch.distributed.checkpoint): a resize reshards
    them on restore. Each epoch's checkpoint commits with its metrics what the attempt ran
    on: ``world`` (dist.get_world_size()), ``lr`` (the optimizer's, after any resume) and
    ``rows`` (this rank's shard)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import mlflow_hvd
    from mlflow_hvd import torch as hvd_torch

    dist.init_process_group("gloo")
    size = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 8)  # 8 rows: every rank of 2 or 4 holds a part
    fully_shard(model, mesh=init_device_mesh("cpu", (size,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=hvd_torch.scale_learning_rate(0.01))
    start = hvd_torch.restore_from_checkpoint(model, optimizer)
    step = 0
    for epoch in range(start, epochs):
        if dist.get_rank() == 0:
            _wait_for_gate(gate, epoch)
        dist.barrier()
        total = 0.0
        for features, labels in data.torch_loader(16, label="label", features=["x"],
                                                  seed=epoch):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(features).mean(1), labels.float())
            loss.backward()
            optimizer.step()
            total, step = total + loss.item(), step + 1
        hvd_torch.save_checkpoint(model, optimizer, epoch, step, {
            "loss": total, "world": float(size), "rows": float(data.rows),
            "lr": float(optimizer.param_groups[0]["lr"])}, sharded=True, epochs=epochs)
        if dist.get_rank() == 0:
            mlflow_hvd.log_to_driver(f"epoch {epoch} done on {size} ranks")
    rows: list[Any] = [None] * size
    dist.all_gather_object(rows, data.rows)
    dist.destroy_process_group()
    return {"size": size, "rows": rows}


def keras_lr_resumed(epochs: int) -> dict[str, Any]:
    """Keras fit with checkpoints in the run, resuming from its latest: the epoch it starts
    at and the learning rate it starts with (after any rescale), on rank 0."""
    import horovod.tensorflow as hvd
    import keras
    import numpy as np

    from mlflow_hvd import keras as hvd_keras

    hvd.init()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(
        keras.optimizers.SGD(hvd_keras.scale_learning_rate(0.01))), loss="mse",
        jit_compile=False)
    initial = hvd_keras.restore_from_checkpoint(model)
    lr = float(model.optimizer.learning_rate.numpy())
    model.fit(np.ones((8, 2)), np.ones(8), batch_size=4, epochs=epochs, initial_epoch=initial,
              verbose=0, callbacks=[hvd_keras.BroadcastGlobalVariablesCallback(0),
                                    hvd_keras.MlflowCallback(checkpoint=True)])
    return {"initial": initial, "lr": lr, "size": hvd.size()}


# --- mlflow_hvd.petastorm: notebook code written for Petastorm's converter ----------------
def petastorm_torch_loop(train: Any, val: Any, batch_size: int = 32,
                         epochs: int = 2) -> dict[str, Any]:
    """The torch side of a Petastorm notebook (examples/petastorm_notebook.py's digits):
    ``make_torch_dataloader`` (infinite), one iterator kept across epochs of
    ``len(converter) // (batch_size * hvd.size())`` steps, a ``TransformSpec`` that makes a
    column from a pandas DataFrame; then one finite pass of the validation converter, its
    loss averaged over the ranks."""
    import horovod.torch as hvd
    import numpy as np
    import torch

    from mlflow_hvd.petastorm import TransformSpec

    def scaled(frame: Any) -> Any:  # on a pandas DataFrame of rows
        frame["scaled"] = frame["features"].map(lambda v: np.asarray(v) * 2.0 - 1.0)
        return frame.drop(columns=["features"])

    spec = TransformSpec(scaled, edit_fields=[("scaled", np.float32, (64,), False)],
                         selected_fields=["scaled", "label_index"])
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(),
                                                         lr=0.01 * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    steps = len(train) // (batch_size * hvd.size())
    losses = []
    with train.make_torch_dataloader(batch_size=batch_size, cur_shard=hvd.rank(),
                                     shard_count=hvd.size(), transform_spec=spec) as loader:
        batches = iter(loader)
        first = None
        for _ in range(epochs):
            for _ in range(steps):
                batch = next(batches)
                first = first or batch
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(batch["scaled"]),
                                                         batch["label_index"].long())
                loss.backward()
                optimizer.step()
            losses.append(float(loss))
    assert first is not None
    total, count = 0.0, 0
    with torch.no_grad(), val.make_torch_dataloader(batch_size=batch_size, num_epochs=1,
                                                    cur_shard=hvd.rank(),
                                                    shard_count=hvd.size()) as loader:
        for batch in loader:
            logits = model(batch["features"] * 2.0 - 1.0)
            total += float(torch.nn.functional.cross_entropy(
                logits, batch["label_index"].long(), reduction="sum"))
            count += len(batch["label_index"])
    # every validation row once over the ranks (their shards may differ by a few rows)
    sums = hvd.allreduce(torch.tensor([total, float(count)], dtype=torch.float64), op=hvd.Sum)
    val_loss = float(sums[0] / sums[1])
    return {"losses": losses, "keys": list(first), "val_loss": val_loss,
            "val_rows": int(sums[1]),
            "scaled": (tuple(first["scaled"].shape), str(first["scaled"].dtype))}


def petastorm_census(train: Any, batch_size: int = 48,
                     with_tf: bool = True) -> list[dict[str, Any]]:
    """Every row each rank reads (allgathered): one finite pass through each face
    (``num_epochs=1``: the last batch may be short), and infinite streams read for more
    than two passes; ``with_tf=False``: the torch face only."""
    import horovod.torch as hvd

    hvd.init()
    shard = {"cur_shard": hvd.rank(), "shard_count": hvd.size()}
    with train.make_torch_dataloader(batch_size=batch_size, num_epochs=1, **shard) as loader:
        torch_batches, dtypes = [], {}
        for b in loader:
            torch_batches.append(b["id"].tolist())
            dtypes = dtypes or {k: str(getattr(v, "dtype", type(v).__name__))
                                for k, v in b.items()}
    tf_batches, endless_tf = [], []
    tf_fields: list[str] = []
    if with_tf:
        with train.make_tf_dataset(batch_size=batch_size, num_epochs=1, **shard) as ds:
            tf_batches = [b.id.numpy().tolist() for b in ds]
            tf_fields = list(next(iter(ds))._fields)
    with train.make_torch_dataloader(batch_size=batch_size, num_epochs=2,
                                     shuffle_row_groups=False, **shard) as loader:
        in_order = [i for b in loader for i in b["id"].tolist()]
    rows = sum(len(b) for b in torch_batches)
    with train.make_torch_dataloader(batch_size=batch_size, **shard) as loader:
        endless = []
        for batch in loader:
            endless.extend(batch["id"].tolist())
            if len(endless) >= 2 * rows + batch_size:
                break
    if with_tf:
        with train.make_tf_dataset(batch_size=batch_size, **shard) as ds:
            endless_tf = [int(i) for b in ds.take(2 * rows // batch_size + 2)
                          for i in b.id.numpy()]
    return hvd.allgather_object({"tf": tf_batches, "torch": torch_batches,
                                 "in_order": in_order, "endless": endless,
                                 "endless_tf": endless_tf, "rows": rows,
                                 "dtypes": dtypes, "tf_fields": tf_fields,
                                 "host": socket.gethostname()})


def petastorm_refusals(train: Any) -> list[str]:
    """What this feed cannot honour, each refused by name on the rank."""
    import horovod.torch as hvd

    hvd.init()
    shard = {"cur_shard": hvd.rank(), "shard_count": hvd.size()}
    said = []
    for call in (
        lambda: train.make_tf_dataset(batch_size=8),
        lambda: train.make_tf_dataset(batch_size=8, cur_shard=0, shard_count=1),
        lambda: train.make_torch_dataloader(predicate=object(), **shard),
        lambda: train.make_torch_dataloader(reader_pool_type="process", **shard),
        lambda: train.make_torch_dataloader(data_loader_fn=list, **shard),
        lambda: train.make_tf_dataset(schema_fields=["nope"], **shard),
        lambda: train.make_tf_dataset(no_such_argument=1, **shard),
    ):
        try:
            call()
        except Exception as exc:
            said.append(f"{type(exc).__name__}: {exc}")
        else:
            said.append("accepted")
    return said


def gpu_collectives() -> list[dict[str, Any]]:
    """NCCL through horovod.torch on CUDA tensors, each rank pinned to one GPU by its local
    rank (step 2 of the migration); every rank's view, gathered."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    rank, size = hvd.rank(), hvd.size()
    device = torch.device("cuda", torch.cuda.current_device())
    total = hvd.allreduce(torch.tensor([float(rank + 1)], device=device), op=hvd.Sum)
    mean = hvd.allreduce(torch.tensor([float(rank)], device=device), op=hvd.Average)
    gathered = hvd.allgather(torch.tensor([rank * 10, rank * 10 + 1], device=device))
    bcast = hvd.broadcast(torch.tensor([float(rank + 100)], device=device), root_rank=0)
    big = hvd.allreduce(torch.full((1 << 22,), float(rank + 1), device=device), op=hvd.Sum)
    outputs = (total, mean, gathered, bcast, big)
    return hvd.allgather_object({
        "rank": rank, "size": size, "local_rank": hvd.local_rank(),
        "nccl": int(hvd.nccl_built()),
        "devices": sorted({str(t.device) for t in outputs}),
        "uuid": str(torch.cuda.get_device_properties(device).uuid),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "own": os.environ.get("MLFLOW_HVD_TASK_DEVICES"),
        "sum": total.cpu().tolist(), "mean": mean.cpu().tolist(),
        "gathered": gathered.cpu().tolist(), "broadcast": bcast.cpu().tolist(),
        "big_exact": bool((big == size * (size + 1) / 2).all()),
    })


def gpu_torch_steps(steps: int = 60, batch: int = 512) -> list[dict[str, Any]]:
    """A horovod.torch training loop on one GPU per rank (init, pin, a shard of its own, a
    scaled learning rate, the distributed optimizer, rank 0's initial state): each rank's
    GPU, peak GPU memory and steps/s, and its weights' checksum, gathered."""
    import time

    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(1000 + hvd.rank())  # this rank's own shard
    x = torch.randn(batch * 8, 1024, generator=generator).to(device)
    y = torch.randint(0, 10, (batch * 8,), generator=generator).to(device)
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 10)).to(device)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
        named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def step(i: int) -> None:
        rows = slice((i % 8) * batch, (i % 8 + 1) * batch)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()

    step(0)  # NCCL's communicators and the kernels' first launch, outside the timing
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    checksum = float(sum(p.detach().double().sum().item() for p in model.parameters()))
    return hvd.allgather_object({
        "rank": hvd.rank(), "device": str(next(model.parameters()).device),
        "uuid": str(torch.cuda.get_device_properties(device).uuid),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "steps_per_s": steps / elapsed, "checksum": checksum})


def ddp_on_nccl(steps: int = 3) -> list[dict[str, Any]]:
    """``torch.distributed`` as GPU code writes it: ``init_process_group("nccl")``, the device
    from ``LOCAL_RANK``, DistributedDataParallel; an exact all_reduce and equal weights."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    total = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(total)
    torch.manual_seed(rank)
    model = DistributedDataParallel(torch.nn.Linear(8, 1).to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(16, 8, device=device, generator=None)
        model(x).pow(2).mean().backward()
        optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu().tolist()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "world": world, "backend":
                                      dist.get_backend(), "sum": total.cpu().tolist(),
                                      "weights": weights})
    dist.destroy_process_group()
    return everyone


def ddp_held_at_its_last_epoch(epochs: int, gate: str) -> dict[str, Any]:
    """torch.distributed (Gloo) DDP with ``mlflow_hvd.torch`` checkpoints, ``epochs`` epochs,
    the loop not saying which is its last (``save_checkpoint`` without ``epochs``). Rank 0
    writes ``<gate>.last`` (the world size) when the last epoch begins and trains it once
    the test writes ``<gate>.go``. Returns the attempt, the world size and the epochs this
    attempt trained."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import mlflow_hvd
    from mlflow_hvd import torch as hvd_torch

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = hvd_torch.restore_from_checkpoint(model, optimizer)
    trained = []
    for epoch in range(start, epochs):
        if epoch == epochs - 1 and dist.get_rank() == 0:
            Path(gate + ".last").write_text(str(dist.get_world_size()))
            end = time.monotonic() + 240
            while not Path(gate + ".go").exists():
                if time.monotonic() > end:
                    raise TimeoutError(f"{gate}.go did not appear within 240 s")
                time.sleep(0.1)
        dist.barrier()
        optimizer.zero_grad()
        loss = model(torch.ones(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        hvd_torch.save_checkpoint(model, optimizer, epoch, epoch, {"loss": float(loss)})
        trained.append(epoch)
    size = dist.get_world_size()
    dist.destroy_process_group()
    return {"attempt": mlflow_hvd.attempt(), "size": size, "trained": trained}


def speaks_another_version() -> None:
    """Rank 1 sends the driver a message of a kind it does not handle (as a rank of another
    mlflow_hvd version would), then waits to be stopped; rank 0 waits too."""
    from mlflow_hvd.protocol.messages import NoCredentials  # an answer, never a message
    from mlflow_hvd.rank import context

    if int(os.environ["HOROVOD_RANK"]) == 1:
        assert context._client is not None
        context._client.send(NoCredentials())
    time.sleep(60)  # stopped by the driver long before


def side_groups_leave_nothing(transfers: int = 100) -> list[dict[str, int]]:
    """``transfers`` sharded-checkpoint transfers to rank 0, each through the Gloo side
    group an NCCL job's transfers use (mlflow_hvd.torch.sharded._side_group), on a Gloo
    job here: each rank's open descriptors and threads (the kernel's count: Gloo's are
    native) after 3 warm-up transfers and after all of them."""
    import tempfile

    import torch.distributed as dist

    from mlflow_hvd.torch import sharded

    def held() -> tuple[int, int]:
        with open("/proc/self/status") as status:
            threads = next(int(line.split()[1]) for line in status
                           if line.startswith("Threads:"))
        return len(os.listdir("/proc/self/fd")), threads

    dist.init_process_group("gloo")
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, f"part_{dist.get_rank()}").write_bytes(os.urandom(1000))
        for n in range(transfers):
            if n == 3:
                counts["fds_before"], counts["threads_before"] = held()
            with sharded._side_group() as group:
                sharded._to_rank0(directory, None, group)
    counts["fds_after"], counts["threads_after"] = held()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, counts)
    dist.destroy_process_group()
    return everyone


class SeesAtUnpickling:
    """A kwarg that records, when a rank unpickles it, the variables ``names`` have then."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names, self.seen = names, {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.seen = {name: os.environ.get(name) for name in self.names}


def job_variables(probe: SeesAtUnpickling) -> dict[str, Any]:
    """What this rank's variables ``probe.names`` were when the job's code was unpickled and
    are while it runs."""
    return {"unpickled": probe.seen,
            "running": {name: os.environ.get(name) for name in probe.names}}


# what torchrun (and pyspark's TorchDistributor around it) may set in a worker's environment
TORCHRUN_VIEW = (*TORCHRUN_VARS[:-1], "NODE_RANK", "CUDA_VISIBLE_DEVICES",
                 "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "OMP_NUM_THREADS")


def torchrun_views() -> list[dict[str, str | None]]:
    """Every process's torchrun variables (:data:`TORCHRUN_VIEW`), gathered over Gloo, by
    rank: what a TorchDistributor's processes see."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mine = {name: os.environ.get(name) for name in TORCHRUN_VIEW}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    return everyone


def snapshot_round_trip(folder: str) -> dict[str, Any]:
    """``horovod.torch``: snapshots every 2 steps of a replicated model (one file per host:
    the local ranks share it), then the model and Adam's state perturbed and restored by a
    second ``Snapshots``' ``resume()``, on every rank from the lowest rank holding it."""
    import horovod.torch as hvd
    import torch

    from mlflow_hvd.torch import Snapshots

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    with Snapshots(model, optimizer, every=2, directory=folder) as snapshots:
        for batch in range(5):
            optimizer.zero_grad()
            model(torch.ones(3, 4) * (hvd.rank() + 1)).sum().backward()
            optimizer.step()
            snapshots.step(0, batch)
            if batch == 3:
                snapshots.flush()
                kept = [p.detach().clone() for p in model.parameters()]
                draw = torch.rand(1)  # what the RNG gives after the snapshot of step 4
        written = sorted(os.listdir(snapshots.directory or ""))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        position = Snapshots(model, optimizer, every=2, directory=folder).resume()
        restored = all(torch.equal(p, k) for p, k in zip(model.parameters(), kept, strict=True))
        again = torch.rand(1)
        steps = int(optimizer.state_dict()["state"][0]["step"])
    return {"position": [position.epoch, position.batch, position.source], "written": written,
            "restored": hvd.allgather_object(restored), "rng": bool(torch.equal(draw, again)),
            "adam_steps": steps, "left": sorted(os.listdir(folder))}


def snapshot_faults(folder: str) -> dict[str, Any]:
    """``horovod.torch``, snapshots every step: a write cut short by a kill (its
    ``.partial`` file beside two complete snapshots) is removed and the newest complete one
    restored; then rank 0's files limited below a snapshot's size (a full disk's
    ``OSError``, EFBIG here) skip the snapshot, say so, and training goes on."""
    import resource

    import horovod.torch as hvd
    import torch

    from mlflow_hvd.torch import Snapshots

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())

    def train_step(snapshots: Snapshots, batch: int) -> None:
        optimizer.zero_grad()
        model(torch.ones(2, 64)).sum().backward()
        optimizer.step()
        snapshots.step(0, batch)
        snapshots.flush()

    with Snapshots(model, optimizer, every=1, directory=folder) as first:
        for batch in range(2):
            train_step(first, batch)
        kept = [p.detach().clone() for p in model.parameters()]
        directory = first.directory or ""
        partial = os.path.join(directory, "step-0000000003-epoch-0-batch-2.pt.partial")
        if hvd.rank() == 0:
            with open(partial, "wb") as f:
                f.write(b"cut short")
        hvd.allreduce(torch.zeros(1), name="partial_written")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        second = Snapshots(model, optimizer, every=1, directory=folder)
        position = second.resume()
        restored = all(torch.equal(p, k) for p, k in zip(model.parameters(), kept, strict=True))
        partial_left = os.path.exists(partial)
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if hvd.rank() == 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
        try:
            train_step(second, 2)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, old_handler)
        train_step(second, 3)  # the disk has room again
        files = sorted(os.listdir(directory))
    return {"position": [position.epoch, position.batch, position.source],
            "restored": hvd.allgather_object(restored), "partial_left": partial_left,
            "skipped": second.skipped, "files": files}

"""A long DDP job's failure costs steps, not an epoch: snapshots every N steps on the job's
own hosts, checkpoints per epoch in the MLflow run, and a retried attempt that continues
from the newest of them, mid-epoch.

torch.distributed as torchrun runs it (``init_process_group()`` reads the variables every
rank is given), DistributedDataParallel on the CPU (gloo), the digits data sharded by a
``DistributedSampler``. ``mlflow_hvd.torch.Snapshots`` copies the model's and optimizer's
state every ``snapshot_every`` steps and writes it to the host's disk beside training;
``resume()`` restores the newest state any host holds, and ``Position.batches`` skips what
was trained before the failure.

    HorovodRunner(np=2, job=JobConfig(max_failures=2)).run(train, epochs=3)
    mlflow run . -P np=2 -P train=examples/digits_snapshots.py:train
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import digits_keras  # the data: scikit-learn's bundled digits, offline


def train(
    epochs: int = 3,
    batch_size: int = 16,
    learning_rate: float = 0.001,
    seed: int = 0,
    snapshot_every: int = 10,
    kill_at_step: int | None = None,
    log_every_n_steps: int = 0,
    data: str = "digits",
    run_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train; returns the held-out loss and accuracy and every rank's parameter checksum.

    ``kill_at_step``: on the job's first attempt, rank 1 (rank 0 when alone) is killed
    (SIGKILL) after that many steps, once the snapshots due by then are on disk.
    ``log_every_n_steps`` > 0 logs ``step_loss`` every that many steps (step = the global
    step): after a resume, the steps run again do not log their values twice.
    """
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import mlflow_hvd
    from mlflow_hvd import torch as hvd_torch
    from mlflow_hvd import tracking

    if data != "digits":
        raise ValueError(f"data={data!r}: this example trains on the bundled digits only "
                         "(examples/digits_torch.py takes a DataFrame)")
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))

    x_train, y_train, x_test, y_test = digits_keras.load_data(seed)
    features = torch.from_numpy(np.ascontiguousarray(x_train.reshape(len(x_train), 64)))
    train_set = TensorDataset(features, torch.from_numpy(y_train).long())
    sampler = DistributedSampler(train_set, num_replicas=size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)

    model = DistributedDataParallel(nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10)))
    optimizer = torch.optim.Adam(model.parameters(),
                                 lr=hvd_torch.scale_learning_rate(learning_rate))

    if run_params:  # the MLproject entry point's parameters (it logged them)
        tracking.log_params(run_params, keep_existing=True)
    with hvd_torch.Snapshots(model, optimizer, every=snapshot_every) as snapshots:
        # the newest of the run's checkpoint and the hosts' snapshots (the start at first)
        position = snapshots.resume()
        steps = 0
        for epoch in range(position.epoch, epochs):
            sampler.set_epoch(epoch)  # the epoch's order: the same on every attempt
            model.train()
            total = torch.zeros(2)
            for batch, (x, y) in position.batches(epoch, loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                total += torch.tensor([float(loss), 1.0])
                snapshots.step(epoch, batch)
                global_step = epoch * len(loader) + batch + 1
                if log_every_n_steps and global_step % log_every_n_steps == 0:
                    tracking.log_metric("step_loss", float(loss), step=global_step)
                steps += 1
                if (kill_at_step is not None and steps == kill_at_step
                        and mlflow_hvd.attempt() == 0 and rank == min(1, size - 1)):
                    snapshots.flush()  # the demonstration's snapshot, on disk
                    os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(total)
            metrics = {"loss": float(total[0] / total[1])}  # this attempt's batches
            hvd_torch.save_checkpoint(model, optimizer, epoch, (epoch + 1) * len(loader),
                                      metrics, epochs=epochs)

    model.eval()
    with torch.no_grad():
        logits = model.module(torch.from_numpy(x_test.reshape(len(x_test), 64)))
        labels = torch.from_numpy(y_test).long()
        test_loss = float(F.cross_entropy(logits, labels))
        accuracy = float((logits.argmax(dim=1) == labels).float().mean())
    tracking.log_metrics({"test_loss": test_loss, "test_accuracy": accuracy}, step=epochs - 1)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    every: list[Any] = [None] * size
    dist.all_gather_object(every, checksum)
    dist.destroy_process_group()
    return {"test_loss": test_loss, "test_accuracy": accuracy, "checksums": every,
            "resumed_from": position.source, "resumed_at": [position.epoch, position.batch],
            "steps": steps}

"""The training functions of docs/migration.md, after moving them to ``HorovodRunner``; CI
runs each (tests/test_migration.py). Data: scikit-learn's bundled digits (no download),
each rank taking its own equal shard.
"""

from __future__ import annotations

from typing import Any


def digits_shard(rank: int, size: int) -> tuple[Any, Any]:
    """This rank's equal share of the digits, flattened to 64 features in [0, 1]."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    n = len(x) // size  # equal shards: every rank runs the same number of steps
    return np.ascontiguousarray(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]


# --8<-- [start:horovod_spark]
def train_torch(lr: float = 0.01, epochs: int = 3) -> list[float]:
    """The function you gave ``horovod.spark.run``, unchanged: Horovod's own PyTorch API."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    x, y = digits_shard(hvd.rank(), hvd.size())
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    losses = []
    for _ in range(epochs):
        for start in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[start:start + 32]),
                                                     y[start:start + 32])
            loss.backward()
            optimizer.step()
        losses.append(float(hvd.allreduce(loss.detach(), name="epoch_loss")))
    return losses
# --8<-- [end:horovod_spark]


# --8<-- [start:ddp]
def train_ddp(lr: float = 0.01, epochs: int = 3) -> float:
    """Before: a function for pyspark's TorchDistributor (DistributedDataParallel)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x, y = digits_shard(dist.get_rank(), dist.get_world_size())
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * dist.get_world_size())
    for _epoch in range(epochs):
        for start in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[start:start + 32]),
                                                     y[start:start + 32])
            loss.backward()
            optimizer.step()
    last = loss.detach().clone()
    dist.all_reduce(last)                           # summed over the ranks
    world = dist.get_world_size()
    dist.destroy_process_group()
    return float(last) / world                      # the same on every rank
# --8<-- [end:ddp]


# --8<-- [start:torch_distributor]
def train_ddp_as_horovod(lr: float = 0.01, epochs: int = 3) -> float:
    """A TorchDistributor function (DistributedDataParallel) moved to Horovod: the four
    marked lines changed, the loop did not."""
    import horovod.torch as hvd
    import torch

    from mlflow_hvd import tracking

    hvd.init()                                      # was: dist.init_process_group("gloo")
    torch.manual_seed(0)
    x, y = digits_shard(hvd.rank(), hvd.size())     # was: dist.get_rank(), dist.get_world_size()
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # was: DDP(model)
    optimizer = hvd.DistributedOptimizer(                       # was: SGD on DDP's params
        torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
        named_parameters=model.named_parameters())
    for epoch in range(epochs):
        for start in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[start:start + 32]),
                                                     y[start:start + 32])
            loss.backward()
            optimizer.step()
        tracking.log_metrics({"loss": float(loss)}, step=epoch)  # rank 0 only
    return float(hvd.allreduce(loss.detach(), name="last_loss"))  # averaged over the ranks
# --8<-- [end:torch_distributor]


# --8<-- [start:tf_distributor]
def train_keras(lr: float = 0.01, epochs: int = 3) -> float:
    """A spark-tensorflow-distributor function (MultiWorkerMirroredStrategy) moved to
    Horovod: no strategy scope; the optimizer and two callbacks come from the Keras 3
    drop-in."""
    import keras

    import mlflow_hvd.keras as hvd

    hvd.init()
    x, y = digits_shard(hvd.rank(), hvd.size())     # was: the strategy's auto-sharding
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr * hvd.size())),
                  loss="sparse_categorical_crossentropy", jit_compile=False)
    history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=[
        hvd.BroadcastGlobalVariablesCallback(0), hvd.MetricAverageCallback(),
        hvd.MlflowCallback()])
    return float(history.history["loss"][-1])
# --8<-- [end:tf_distributor]

"""The digits classifier in PyTorch with ``horovod.torch``, tracked in MLflow: the eight steps.

The same task as examples/digits_keras.py, written the way Horovod documents PyTorch
training (https://horovod.readthedocs.io/en/stable/pytorch.html); the numbered comments are
the migration steps. Under HorovodRunner nothing about Horovod changes; rank 0 logs through
:mod:`mlflow_hvd.tracking` and checkpoints with :mod:`mlflow_hvd.torch`.

    HorovodRunner(np=2).run(train, epochs=3)
    mlflow run . -P np=2 -P train=examples/digits_torch.py:train
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import digits_keras  # the data: scikit-learn's bundled digits, offline


def build_model() -> Any:
    import torch.nn as nn

    class DigitsNet(nn.Module):
        """The Keras example's network: two convolutions, then two dense layers."""

        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
            )
            self.classify = nn.Sequential(nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                                          nn.Linear(64, 10))

        def forward(self, x: Any) -> Any:
            return self.classify(self.features(x))

    return DigitsNet()


def train(
    epochs: int = 5,
    batch_size: int = 32,
    learning_rate: float = 0.001,
    seed: int = 0,
    data: Any = "digits",
    val: Any = None,
    fail_at_epoch: int | None = None,
    log_model: bool = True,
    log_every_n_steps: int = 0,
    run_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train on this rank's shard; returns held-out metrics (rank 0's reach the driver).

    Logs ``loss``, ``val_loss`` and ``val_accuracy`` per epoch (step = epoch) with a
    checkpoint of model and optimizer, ``test_*`` at the end, and the model.
    ``log_every_n_steps`` > 0 also logs ``step_loss`` every that many batches (step = global
    batch). ``fail_at_epoch`` makes rank 1 (rank 0 when alone) raise at the start of that
    epoch on the job's first attempt: with ``HorovodRunner(job=JobConfig(max_failures=1))`` the
    second
    attempt resumes after the last checkpoint.
    """
    import horovod.torch as hvd
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import mlflow_hvd
    from mlflow_hvd import torch as hvd_torch
    from mlflow_hvd import tracking
    from mlflow_hvd.data import Shard

    # 1. Initialise Horovod.
    hvd.init()

    # 2. Pin one GPU per process (local rank); skipped on CPU-only machines. On the CPU,
    # share the host's cores between its ranks instead of each taking them all.
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)

    x_all, y_all, x_test, y_test = digits_keras.load_data(seed)
    from sklearn.model_selection import train_test_split

    x_train, x_val, y_train, y_val = train_test_split(
        x_all, y_all, test_size=0.15, random_state=seed, stratify=y_all
    )

    def tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:  # NHWC -> NCHW
        return TensorDataset(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))),
                             torch.from_numpy(y))

    # 3. Shard the data: every rank a distinct, equal-size shard (remainder dropped).
    if data == "digits":
        train_set = tensors(x_train, y_train)
        sampler: Any = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                          shuffle=True, seed=seed, drop_last=True)
        loader: Any = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
        shard_size = len(sampler)
    else:  # a DataFrame passed to run(): this rank's own rows, fed by its Spark task
        if not isinstance(data, Shard):
            raise TypeError(f"data must be 'digits' or a DataFrame, got {data!r}")
        sampler = None  # the shard shuffles each pass itself, from seed + epoch
        loader = data.torch_loader(batch_size, label="label", features=["pixels"], seed=seed)
        shard_size = data.rows
    if isinstance(val, Shard):  # a validation DataFrame: this rank's rows of it
        rows = list(val.batches(min(256, val.rows), shuffle=False))
        x_val = np.concatenate([b["pixels"] for b in rows]).reshape(-1, 8, 8, 1)
        y_val = np.concatenate([b["label"] for b in rows]).astype("int64")

    model = build_model().to(device)

    # 4. Scale the learning rate by the number of workers.
    optimizer = torch.optim.Adam(model.parameters(),
                                 lr=hvd_torch.scale_learning_rate(learning_rate))

    # 5. Wrap the optimizer: gradients are averaged across ranks every step.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    # Resume: rank 0 loads the run's latest checkpoint, if it has one (before step 6).
    start_epoch = hvd_torch.restore_from_checkpoint(model, optimizer)
    if start_epoch:
        mlflow_hvd.log_to_driver(f"resuming at epoch {start_epoch}")

    # 6. Broadcast the initial state (parameters, optimizer state) from rank 0.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if run_params:
        tracking.log_params(run_params, keep_existing=True)
    tracking.log_params({"framework": "pytorch", "shard_size": shard_size,
                         "hvd_size": hvd.size()}, keep_existing=True)

    def evaluate(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            features, labels = tensors(x, y).tensors
            logits = model(features.to(device))
            loss = float(F.cross_entropy(logits, labels.to(device)))
            accuracy = float((logits.argmax(dim=1).cpu() == labels).float().mean())
        return loss, accuracy

    global_step = start_epoch * len(loader)
    for epoch in range(start_epoch, epochs):
        if fail_at_epoch == epoch and mlflow_hvd.attempt() == 0:
            # every rank gets here only after rank 0 committed the previous checkpoint
            hvd.allreduce(torch.zeros(1), name="fail_at_barrier")
            if hvd.rank() == min(1, hvd.size() - 1):
                raise RuntimeError(f"injected failure at the start of epoch {epoch}")
        model.train()
        if sampler is not None:
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total, batches = 0.0, 0
        for features, labels in loader:
            if features.dim() == 2:  # a shard's pixels: 64 floats per row -> NCHW
                features = features.view(-1, 1, 8, 8)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(features.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            total, batches, global_step = total + float(loss), batches + 1, global_step + 1
            if log_every_n_steps and global_step % log_every_n_steps == 0:
                tracking.log_metric("step_loss", float(loss), step=global_step)
        # the epoch's training loss, averaged over every rank's batches
        mean_loss = float(hvd.allreduce(torch.tensor(total / max(batches, 1)),
                                        name="epoch_loss"))
        val_loss, val_accuracy = evaluate(x_val, y_val)
        if isinstance(val, Shard):  # each rank scored its own rows: the average of all
            val_loss, val_accuracy = (float(v) for v in hvd.allreduce(
                torch.tensor([val_loss, val_accuracy]), name="val_metrics"))
        metrics = {"loss": mean_loss, "val_loss": val_loss, "val_accuracy": val_accuracy}
        # 7. Checkpoints (and the epoch's metrics) only on rank 0, as MLflow artifacts.
        hvd_torch.save_checkpoint(model, optimizer, epoch, global_step, metrics, epochs=epochs)
        # 8. Only rank 0 talks.
        if hvd.rank() == 0:
            mlflow_hvd.log_to_driver(f"epoch {epoch + 1}/{epochs} loss={mean_loss:.4f} "
                                     f"val_loss={val_loss:.4f} val_accuracy={val_accuracy:.4f}")
        # In a sweep that prunes, every rank learns whether to stop here (a collective).
        if tracking.should_prune():
            break
    test_loss, test_accuracy = evaluate(x_test, y_test)
    tracking.log_metrics({"test_loss": test_loss, "test_accuracy": test_accuracy},
                         step=epochs - 1)
    if log_model and not tracking.was_pruned():  # rank 0 logs it; mlflow.pytorch loads it
        model.eval()  # with an input example: MLflow's pt2 format (torch.export), no pickle
        example = np.ascontiguousarray(x_test[:4].transpose(0, 3, 1, 2))
        hvd_torch.log_model(model, name="model", input_example=example)
    # the parameters every rank ended with (a test compares them across ranks)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"test_loss": test_loss, "test_accuracy": test_accuracy, "epochs": epochs,
            "checksums": hvd.allgather_object(checksum)}

"""The digits classifier with FSDP2 (``fully_shard``) on ``torch.distributed``: a model
sharded over the ranks, so each holds about 1/np of its parameters, gradients and Adam
state - the answer when a model no longer fits one node. The eight steps of Horovod's
migration, in torch.distributed's terms; rank 0 logs and checkpoints with
:mod:`mlflow_hvd.torch`: the full state gathered to rank 0 where it fits, or with
``sharded_checkpoints=True`` each rank's part as it is (``torch.distributed.checkpoint``),
for a model whose whole state does not fit one host. The trained model is logged from its
gathered state (only rank 0 needs to hold it whole, once, at the end).

    HorovodRunner(np=2).run(train, epochs=3)
    mlflow run . -P np=2 -P train=examples/digits_fsdp.py:train
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import digits_keras  # the data: scikit-learn's bundled digits, offline


def build_model(width: int = 512) -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor: its own shard)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def train(
    epochs: int = 5,
    batch_size: int = 32,
    learning_rate: float = 0.001,
    seed: int = 0,
    width: int = 512,
    data: Any = "digits",
    val: Any = None,
    fail_at_epoch: int | None = None,
    sharded_checkpoints: bool = False,
    log_model: bool = True,
    run_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train the sharded model on this rank's shard of the data; returns rank 0's held-out
    metrics and what each rank held (bytes of parameters, gradients and optimizer state,
    against the whole model's parameters).

    Logs ``loss``, ``val_loss`` and ``val_accuracy`` per epoch (step = epoch) with a
    checkpoint of the model and optimizer (gathered, or sharded with
    ``sharded_checkpoints``), the test metrics and the model at the end. ``data`` is
    ``"digits"`` or a DataFrame of ``pixels`` (64 floats) and ``label`` passed to ``run()``
    (``val``: one to validate on, each rank its own part). ``fail_at_epoch`` makes rank 1
    raise at the start of that epoch on the job's first attempt: with
    ``HorovodRunner(job=JobConfig(max_failures=1))`` the next attempt resumes after the last
    checkpoint, each rank loading its shard of it.
    """
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from sklearn.model_selection import train_test_split
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import mlflow_hvd
    from mlflow_hvd import torch as hvd_torch
    from mlflow_hvd import tracking
    from mlflow_hvd.data import Shard

    # 1. Initialise: torch.distributed from the environment HorovodRunner gives each rank.
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    local_rank, local_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])

    # 2. Pin one GPU per process (local rank); on the CPU, share the host's cores instead.
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
        device = torch.device("cpu")

    x_all, y_all, x_test, y_test = digits_keras.load_data(seed)
    x_train, x_val, y_train, y_val = train_test_split(
        x_all, y_all, test_size=0.15, random_state=seed, stratify=y_all)

    def tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(x.reshape(len(x), 64)), torch.from_numpy(y))

    # 3. Shard the data: every rank a distinct, equal-size shard (remainder dropped).
    if data == "digits":
        train_set = tensors(x_train, y_train)
        sampler: Any = DistributedSampler(train_set, shuffle=True, seed=seed, drop_last=True)
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

    # 6. The same initial state everywhere: every rank builds the model from one seed (a
    # restored checkpoint below then comes from rank 0), and each keeps only its shard.
    torch.manual_seed(seed)
    model = build_model(width).to(device)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mesh = init_device_mesh(device.type, (size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    # 4. Scale the learning rate by the number of workers. 5. The distributed optimizer:
    # FSDP reduce-scatters the gradients (averaged), and Adam updates this rank's shard.
    optimizer = torch.optim.Adam(model.parameters(),
                                 lr=hvd_torch.scale_learning_rate(learning_rate))

    # Resume: the run's latest checkpoint, each rank loading its shard of it.
    start_epoch = hvd_torch.restore_from_checkpoint(model, optimizer)
    if start_epoch and rank == 0:
        mlflow_hvd.log_to_driver(f"resuming at epoch {start_epoch}")
    if run_params:
        tracking.log_params(run_params, keep_existing=True)
    tracking.log_params({"framework": "pytorch-fsdp2", "world_size": size,
                         "shard_size": shard_size}, keep_existing=True)

    def evaluate(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        model.eval()
        with torch.no_grad():  # every rank: the forward pass gathers each layer (collective)
            features, labels = tensors(x, y).tensors
            logits = model(features.to(device))
            loss = float(F.cross_entropy(logits, labels.to(device)))
            accuracy = float((logits.argmax(dim=1).cpu() == labels).float().mean())
        return loss, accuracy

    global_step = start_epoch * len(loader)
    for epoch in range(start_epoch, epochs):
        if fail_at_epoch == epoch and mlflow_hvd.attempt() == 0:
            dist.barrier()  # every rank is here: rank 0 committed the last checkpoint
            if rank == min(1, size - 1):
                raise RuntimeError(f"injected failure at the start of epoch {epoch}")
        model.train()
        if sampler is not None:
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total, batches = 0.0, 0
        for features, labels in loader:
            optimizer.zero_grad()
            logits = model(features.reshape(-1, 64).to(device))
            loss = F.cross_entropy(logits, labels.long().to(device))
            loss.backward()
            optimizer.step()
            total, batches, global_step = total + loss.item(), batches + 1, global_step + 1
        mean = torch.tensor([total / max(batches, 1)])
        dist.all_reduce(mean)  # the epoch's loss over every rank's batches
        val_loss, val_accuracy = evaluate(x_val, y_val)
        metrics = {"loss": float(mean) / size, "val_loss": val_loss,
                   "val_accuracy": val_accuracy}
        # 7. Checkpoints on rank 0: the full state gathered there, or each rank's part sent
        # there one chunk at a time (sharded_checkpoints); every rank takes part.
        hvd_torch.save_checkpoint(model, optimizer, epoch, global_step, metrics,
                                  sharded=sharded_checkpoints, epochs=epochs)
        if rank == 0:  # 8. Only rank 0 talks.
            mlflow_hvd.log_to_driver(
                f"epoch {epoch + 1}/{epochs} loss={metrics['loss']:.4f} "
                f"val_loss={val_loss:.4f} val_accuracy={val_accuracy:.4f}")
    test_loss, test_accuracy = evaluate(x_test, y_test)
    tracking.log_metrics({"test_loss": test_loss, "test_accuracy": test_accuracy},
                         step=epochs - 1)
    held = {"params": local_bytes(model.parameters()),
            "grads": local_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": local_bytes(v for s in optimizer.state.values() for v in s.values()
                                     if torch.is_tensor(v) and v.dim() > 0)}
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, held)
    if log_model and not tracking.was_pruned():
        # the whole model, gathered once to rank 0's CPU (every rank takes part), logged
        # as an unsharded module that mlflow.pytorch.load_model gives back anywhere
        whole = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            plain = build_model(width)
            plain.load_state_dict(whole)
            plain.eval()
            hvd_torch.log_model(plain, name="model",
                                input_example=x_test[:4].reshape(4, 64).astype("float32"))
        del whole
    dist.destroy_process_group()
    return {"test_loss": test_loss, "test_accuracy": test_accuracy, "full_bytes": full_bytes,
            "held": everyone, "start_epoch": start_epoch}

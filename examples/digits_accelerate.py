"""The digits classifier in a training loop written with Hugging Face Accelerate, as its
docs write it: ``Accelerator()`` finds the process group from the torchrun variables every
rank gets; ``prepare`` wraps the model (DistributedDataParallel), the optimizer and the
DataLoader (each process its part of the batches); ``accelerator.backward(loss)``; MLflow
through Accelerate's own tracker (``log_with="mlflow"``, ``init_trackers``,
``accelerator.log``), which writes into the job's run from the main process.

    HorovodRunner(np=2).run(train, epochs=3)
    mlflow run . -P np=2 -P train=examples/digits_accelerate.py:train
    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 3)

``data``: a DataFrame passed to ``run()`` reaches each process as its own rows
(``mlflow_hvd.data.Shard``); its loader is already this process's part, so it is not
prepared (``prepare`` would split it again), its batches moved to ``accelerator.device``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import digits_keras  # the data: scikit-learn's bundled digits, offline


def train(
    epochs: int = 5,
    batch_size: int = 32,
    learning_rate: float = 0.001,
    seed: int = 0,
    data: Any = "digits",
    experiment: str = "digits",
    run_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fit an MLP on this process's part of the data; returns the main process's test
    metrics and every process's weight sum (equal: DDP keeps them so).

    ``experiment``: the name Accelerate's tracker is given (``init_trackers``); its run is
    the job's (``MLFLOW_RUN_ID``). ``run_params`` (what ``mlflow run``'s entry point
    passes) join the config the tracker logs."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    from mlflow_hvd.data import Shard

    accelerator = Accelerator(log_with="mlflow", cpu=not torch.cuda.is_available())
    set_seed(seed)  # the same initial weights on every process
    config = {"epochs": epochs, "batch_size": batch_size, "learning_rate": learning_rate,
              "processes": accelerator.num_processes, **(run_params or {})}
    accelerator.init_trackers(experiment, config=config)  # params: the main process's

    x_train, y_train, x_test, y_test = digits_keras.load_data(seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    # the learning rate scaled by the number of processes, as Horovod's step 4 says
    optimizer = torch.optim.Adam(model.parameters(),
                                 lr=learning_rate * accelerator.num_processes)
    if isinstance(data, Shard):  # this process's rows, fed by its Spark task
        loader: Any = data.torch_loader(batch_size, label="label", features=["pixels"],
                                        seed=seed)
        model, optimizer = accelerator.prepare(model, optimizer)
    elif data == "digits":
        tensors = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
        loader = DataLoader(tensors, batch_size=batch_size, shuffle=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        raise TypeError(f"data must be 'digits' or a DataFrame, got {data!r}")

    x_test_t = torch.from_numpy(x_test).to(accelerator.device)
    y_test_t = torch.from_numpy(y_test).to(accelerator.device)
    step = 0
    for epoch in range(epochs):
        model.train()
        total, count = torch.zeros(2, device=accelerator.device).unbind()
        for x, y in loader:
            x, y = x.to(accelerator.device), y.to(accelerator.device).long()
            loss = F.cross_entropy(model(x.reshape(len(x), 64).float()), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            total, count, step = total + loss.detach() * len(y), count + len(y), step + 1
        # the epoch's mean loss over every process's rows
        sums = accelerator.reduce(torch.stack([total, count]), reduction="sum")
        model.eval()
        with torch.no_grad():
            logits = model(x_test_t.reshape(len(x_test_t), 64))
        test = {"loss": float(sums[0] / sums[1]),
                "test_loss": float(F.cross_entropy(logits, y_test_t)),
                "test_accuracy": float((logits.argmax(dim=1) == y_test_t).float().mean())}
        accelerator.log(test, step=epoch)  # the main process's tracker writes
        if accelerator.is_main_process:
            print(f"epoch {epoch}: loss {test['loss']:.4f}, test accuracy "
                  f"{test['test_accuracy']:.3f}", flush=True)
    weights = float(sum(p.detach().double().sum() for p in model.parameters()))
    every_rank = accelerator.gather_for_metrics([weights], use_gather_object=True)
    accelerator.end_training()
    return {**test, "weights": list(every_rank), "steps": step,
            "processes": accelerator.num_processes,
            "main": accelerator.is_main_process}

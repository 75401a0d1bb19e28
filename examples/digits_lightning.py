"""The digits classifier as a PyTorch Lightning ``LightningModule``, trained with
``Trainer(strategy="ddp")`` as Lightning's own docs write it: Lightning finds the process
group from the torchrun variables every rank gets (``TorchElasticEnvironment``), and
``mlflow.pytorch.autolog()`` logs its params, metrics, best checkpoints and model into the
job's run from rank 0 (MLflow's API in a rank writes into that run; other ranks log
nothing). ``logger="mlflow"`` uses Lightning's ``MLFlowLogger()`` instead, as Lightning
documents it.

    HorovodRunner(np=2).run(train, epochs=3)
    mlflow run . -P np=2 -P train=examples/digits_lightning.py:train
    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 3)

``devices`` and ``num_nodes`` come from the ranks' torchrun variables: under HorovodRunner
each host is a node (``devices`` = its ranks); under ``TorchDistributor(local_mode=False)``
each Spark task is one, as pyspark's numbers them (``devices=1, num_nodes=num_processes``,
the form Databricks' TorchDistributor page gives).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import digits_keras  # the data: scikit-learn's bundled digits, offline


def build_module(learning_rate: float, width: int = 64) -> Any:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    class DigitsModule(pl.LightningModule):
        def __init__(self, learning_rate: float, width: int) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(),
                                           torch.nn.Linear(width, 10))

        def forward(self, x: Any) -> Any:
            return self.net(x.reshape(-1, 64).float())

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.cross_entropy(self(x), y.long())
            self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self(x)
            self.log("val_loss", F.cross_entropy(logits, y.long()), sync_dist=True)
            self.log("val_accuracy", (logits.argmax(dim=1) == y).float().mean(),
                     sync_dist=True)

        def configure_optimizers(self) -> Any:
            # the learning rate scaled by the number of processes, as Horovod's step 4 says
            return torch.optim.Adam(self.parameters(),
                                    lr=self.hparams.learning_rate * self.trainer.world_size)

    return DigitsModule(learning_rate, width)


def train(
    epochs: int = 5,
    batch_size: int = 32,
    learning_rate: float = 0.001,
    seed: int = 0,
    data: Any = "digits",
    logger: str = "autolog",
    run_params: dict[str, Any] | None = None,
    log_model: bool = True,
    fail_first_attempt: bool = False,
) -> dict[str, Any]:
    """Fit the module on this process's part of the data; returns rank 0's test and last
    validation metrics, and every rank's weight digest (equal: DDP keeps them so).

    ``data``: ``"digits"`` (Lightning shards the loader with a ``DistributedSampler``), or a
    DataFrame passed to ``run()`` (columns ``pixels``, 64 floats, and ``label``): each rank
    gets its own rows. ``logger``: ``"autolog"`` (``mlflow.pytorch.autolog()``, its
    checkpoints logged as models of the run) or ``"mlflow"`` (Lightning's ``MLFlowLogger()``).

    With ``"mlflow"``, each epoch ends with Lightning's own checkpoint
    (``trainer.save_checkpoint``) put into the run (``save_checkpoint_files``); a retried
    attempt resumes from the latest (``fit(..., ckpt_path=...)``). With ``"autolog"`` the
    run's checkpoints are autolog's (``checkpoint=True``: the best one, by
    ``val_loss``). ``fail_first_attempt``: rank 1 fails in the first attempt
    after the first epoch's checkpoint (with ``JobConfig(max_failures=1)`` the retry resumes
    from it).
    """
    import mlflow
    import pytorch_lightning as pl
    import torch
    from sklearn.model_selection import train_test_split
    from torch.utils.data import DataLoader, TensorDataset

    import mlflow_hvd
    from mlflow_hvd.data import Shard
    from mlflow_hvd.torch import restore_checkpoint_files, save_checkpoint_files

    # the process group first, from the torchrun variables (Lightning's DDP takes a group
    # that exists): the checkpoint to resume from reaches every rank over it
    torch.distributed.init_process_group("gloo")
    ckpt_path, start_epoch = restore_checkpoint_files()  # None on a first attempt
    pl.seed_everything(seed, workers=True)  # the same initial weights on every rank
    x_all, y_all, x_test, y_test = digits_keras.load_data(seed)
    x_train, x_val, y_train, y_val = train_test_split(
        x_all, y_all, test_size=0.15, random_state=seed, stratify=y_all)

    def loader(x: Any, y: Any, shuffle: bool) -> DataLoader:
        tensors = TensorDataset(torch.from_numpy(x.reshape(len(x), 64)), torch.from_numpy(y))
        return DataLoader(tensors, batch_size=batch_size, shuffle=shuffle)

    if data == "digits":
        train_loader: Any = loader(x_train, y_train, shuffle=True)
    elif isinstance(data, Shard):  # this rank's rows, fed by its Spark task
        train_loader = data.torch_loader(batch_size, label="label", features=["pixels"],
                                         seed=seed)
    else:
        raise TypeError(f"data must be 'digits' or a DataFrame, got {data!r}")

    if logger == "autolog":
        mlflow.pytorch.autolog(log_models=log_model, checkpoint=True,
                               checkpoint_monitor="val_loss")
        lightning_logger: Any = False  # autolog logs; Lightning's own logger stays off
        if run_params:
            mlflow.log_params(run_params)
    elif logger == "mlflow":
        from pytorch_lightning.loggers import MLFlowLogger

        lightning_logger = MLFlowLogger()  # its run is the job's (MLFLOW_RUN_ID)
        if run_params:
            lightning_logger.log_hyperparams(run_params)
    else:
        raise ValueError(f"logger must be 'autolog' or 'mlflow', got {logger!r}")

    # Lightning's files on this host's own disk, removed when the function returns
    with tempfile.TemporaryDirectory(prefix="lightning-") as scratch:
        checkpoints = os.path.join(scratch, "checkpoints")

        class ToTheRun(pl.Callback):
            """Lightning's checkpoint of each epoch, into the job's run."""

            def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
                path = os.path.join(checkpoints, f"epoch={trainer.current_epoch}.ckpt")
                trainer.save_checkpoint(path)  # every rank calls it; rank 0 writes
                save_checkpoint_files(path, trainer.current_epoch, trainer.global_step)
                if (fail_first_attempt and mlflow_hvd.attempt() == 0
                        and trainer.global_rank == 1):
                    raise RuntimeError("rank 1 fails after the first epoch's checkpoint")

        trainer = pl.Trainer(
            accelerator="cpu",
            devices=int(os.environ["LOCAL_WORLD_SIZE"]),  # this node's processes
            num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
            strategy="ddp",
            max_epochs=epochs,
            logger=lightning_logger,
            default_root_dir=scratch,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=True,
            callbacks=[ToTheRun()] if logger == "mlflow" else [],
        )
        module = build_module(learning_rate)
        trainer.fit(module, train_loader, loader(x_val, y_val, shuffle=False),
                    ckpt_path=ckpt_path)
        weights = float(torch.cat([p.detach().flatten() for p in module.parameters()]).sum())
        every_rank: list[Any] = [None] * trainer.world_size  # Lightning keeps the group up
        torch.distributed.all_gather_object(every_rank, weights)
        module.eval()
        with torch.no_grad():  # the held-out test set, on each rank's (equal) copy of the model
            logits = module(torch.from_numpy(x_test.reshape(len(x_test), 64)))
            labels = torch.from_numpy(y_test).long()
            test = {"test_loss": float(torch.nn.functional.cross_entropy(logits, labels)),
                    "test_accuracy": float((logits.argmax(dim=1) == labels).float().mean())}
        if lightning_logger:  # rank 0 logs (MLFlowLogger's methods run on rank 0 only)
            lightning_logger.log_metrics(test, step=trainer.global_step)
        else:
            mlflow.log_metrics(test, step=epochs - 1)  # other ranks' writes go nowhere
        return {
            **test,
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "val_accuracy": float(trainer.callback_metrics["val_accuracy"]),
            "weights": every_rank,
            "devices": trainer.num_devices,
            "num_nodes": trainer.num_nodes,
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
            "start_epoch": start_epoch,
            "attempt": mlflow_hvd.attempt(),
        }

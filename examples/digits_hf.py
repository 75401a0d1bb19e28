"""The digits as sequences of 8 tokens (one per row of pixels), classified by a small BERT
built from a config (no download), trained with Hugging Face's ``Trainer`` as its docs
write it: ``Trainer`` finds the process group from the torchrun variables every rank gets,
``report_to=["mlflow"]`` logs its arguments, the model's config and its metrics into the
job's run from rank 0 (MLflow's API in a rank writes into that run; other ranks log
nothing), and
``save_strategy="epoch"`` writes a checkpoint each epoch.

    HorovodRunner(np=2).run(train, epochs=3)
    mlflow run . -P np=2 -P train=examples/digits_hf.py:train
    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 3)

Each epoch's checkpoint directory (``checkpoint-<step>``) also goes into the run
(``mlflow_hvd.torch.save_checkpoint_files``), so that a retried attempt, on whichever hosts,
resumes from it: ``trainer.train(resume_from_checkpoint=...)`` with the directory every rank
got back (``restore_checkpoint_files``), the optimizer, scheduler, step and RNG states
included.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import digits_keras  # the data: scikit-learn's bundled digits, offline

CLS = 256  # the token before the image's 8 rows (each row's 8 pixels, on or off: 0-255)


def build_model(width: int = 64, layers: int = 2, seed: int = 0) -> Any:
    """A BERT of ``layers`` layers, ``width`` wide, initialised from ``seed`` (equal on
    every rank)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=CLS + 1, hidden_size=width, num_hidden_layers=layers,
                        num_attention_heads=2, intermediate_size=2 * width,
                        max_position_embeddings=9, num_labels=10)
    return BertForSequenceClassification(config)


def to_sequences(x: Any, y: Any) -> Any:
    """``(n, 8, 8, 1)`` pixels in [0, 1] to a dataset of ``input_ids`` (``[CLS]`` and one
    token per row: its pixels above 0.3 as the bits of a byte) and ``labels``."""
    import numpy as np
    import torch

    bits = (np.asarray(x).reshape(len(x), 8, 8) > 0.3).astype("int64")
    rows = (bits << np.arange(8)).sum(axis=-1)
    ids = torch.from_numpy(np.concatenate([np.full((len(x), 1), CLS), rows], axis=1))
    labels = torch.from_numpy(np.asarray(y)).long()

    class Sequences(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": ids[i], "labels": labels[i]}

    return Sequences()


def train(
    epochs: int = 3,
    batch_size: int = 32,
    learning_rate: float = 0.003,
    seed: int = 0,
    fail_first_attempt: bool = False,
) -> dict[str, Any]:
    """Fit the model on the digits with ``Trainer``; returns the evaluation of the last
    epoch, the epoch it resumed at, and every rank's weight sum (equal: DDP keeps
    them so). ``fail_first_attempt``: rank 1 fails in the first attempt after the first
    epoch's checkpoint (with ``JobConfig(max_failures=1)`` the retry resumes from it)."""
    import numpy as np
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import mlflow_hvd
    from mlflow_hvd.torch import restore_checkpoint_files, save_checkpoint_files

    # Trainer's checkpoints on this host's own disk, removed when the function returns
    with tempfile.TemporaryDirectory(prefix="hf-") as scratch:
        x_train, y_train, x_test, y_test = digits_keras.load_data(seed)
        args = TrainingArguments(
            output_dir=scratch,  # this host's own disk
            num_train_epochs=epochs,
            per_device_train_batch_size=batch_size,  # per process, as Trainer documents it
            per_device_eval_batch_size=128,
            learning_rate=learning_rate,
            eval_strategy="epoch",
            save_strategy="epoch",
            logging_strategy="epoch",
            report_to=["mlflow"],
            seed=seed,
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
            dataloader_num_workers=0,
        )

        class ToTheRun(TrainerCallback):
            """Each checkpoint Trainer saved, into the job's run (rank 0 uploads it)."""

            def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                epoch = round(state.epoch) - 1
                path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
                save_checkpoint_files(path, epoch, state.global_step)
                # to show the resume: rank 1 fails once, after the first checkpoint
                if (fail_first_attempt and epoch == 0 and mlflow_hvd.attempt() == 0
                        and int(os.environ["RANK"]) == 1):
                    raise RuntimeError("rank 1 fails after the first epoch's checkpoint")

        def accuracy(predicted: Any) -> dict[str, float]:
            return {"accuracy": float(np.mean(predicted.predictions.argmax(-1)
                                              == predicted.label_ids))}

        model = build_model(seed=seed)
        trainer = Trainer(model=model, args=args, train_dataset=to_sequences(x_train, y_train),
                          eval_dataset=to_sequences(x_test, y_test), compute_metrics=accuracy,
                          callbacks=[ToTheRun()])
        # a retried attempt: every rank gets the run's latest checkpoint directory (None first)
        resume, start = restore_checkpoint_files()
        trainer.train(resume_from_checkpoint=resume)
        final = [e for e in trainer.state.log_history if "eval_loss" in e][-1]  # the last epoch's
        weights = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
        every_rank: list[Any] = [None] * args.world_size
        torch.distributed.all_gather_object(every_rank, weights)
        return {
            "eval_loss": float(final["eval_loss"]),
            "eval_accuracy": float(final["eval_accuracy"]),
            "start_epoch": start,
            "attempt": mlflow_hvd.attempt(),
            "weights": every_rank,
            "world_size": args.world_size,
        }


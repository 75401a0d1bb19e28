"""Images from a Spark DataFrame, decoded and augmented in DataLoader worker processes:
the digits as PNG files, classified in PyTorch with ``horovod.torch``, the eight steps.

The data is what image users have: a DataFrame with an encoded image (PNG bytes) and a
label per row (here scikit-learn's bundled digits, rendered to 8x8 PNGs: no download).
Passed to ``run()``, it arrives on every rank as that rank's own equal shard; the shard's
``torch_loader`` hands each row to ``transform`` (decode, then a random one-pixel shift)
inside ``num_workers`` worker processes, which split the shard between them (each row
once per epoch). The workers are started with ``forkserver``, as Horovod's own PyTorch
examples do: forking a process after ``hvd.init()`` is not safe.

    .venv/bin/python examples/digits_images_torch.py            # local Spark, np=2
    HorovodRunner(np=2).run(train, data=images_frame(spark))
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import digits_keras  # the test set: scikit-learn's bundled digits, offline
import digits_torch  # the network


def images_frame(spark: Any, seed: int = 0) -> Any:
    """The digits' training split as a DataFrame of ``image`` (PNG bytes) and ``label``."""
    from PIL import Image

    x_train, y_train, _, _ = digits_keras.load_data(seed)
    rows = []
    for pixels, label in zip(x_train[..., 0], y_train, strict=True):
        png = io.BytesIO()
        Image.fromarray(np.round(pixels * 255).astype(np.uint8), mode="L").save(png, "PNG")
        rows.append((png.getvalue(), int(label)))
    return spark.createDataFrame(rows, "image binary, label int")


def decode_and_shift(row: dict[str, Any]) -> dict[str, Any]:
    """One row: the PNG decoded to a (1, 8, 8) float image in [0, 1], shifted by up to one
    pixel each way (the augmentation), its label as it is. Runs in the loader's workers."""
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(row["image"])), dtype=np.float32) / 255.0
    rng = np.random.default_rng()
    image = np.roll(image, tuple(rng.integers(-1, 2, size=2)), axis=(0, 1))
    return {"image": image[None], "label": row["label"]}


def train(data: Any, epochs: int = 5, batch_size: int = 32, learning_rate: float = 0.001,
          num_workers: int = 2, seed: int = 0, log_model: bool = True) -> dict[str, Any]:
    """Train on this rank's shard of ``data`` (a DataFrame of PNG ``image`` and ``label``);
    returns rank 0's held-out accuracy (and every rank's epoch lengths)."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    from mlflow_hvd import torch as hvd_torch
    from mlflow_hvd import tracking

    # 1. Initialise Horovod.
    hvd.init()

    # 2. Pin one GPU per process (local rank); skipped on CPU-only machines, where the host's
    # cores are shared between its ranks and their loader workers.
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)

    # 3. Shard the data: ``data`` is this rank's own equal shard already; its loader's
    # workers decode and augment, splitting the shard between them.
    loader = data.torch_loader(
        batch_size, label="label", features=["image"], seed=seed,
        transform=decode_and_shift, num_workers=num_workers,
        multiprocessing_context="forkserver" if num_workers else None,
        persistent_workers=num_workers > 0)

    model = digits_torch.build_model().to(device)
    # 4. Scale the learning rate by the number of workers.
    optimizer = torch.optim.Adam(model.parameters(),
                                 lr=hvd_torch.scale_learning_rate(learning_rate))
    # 5. Wrap the optimizer: gradients are averaged across ranks every step.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    start_epoch = hvd_torch.restore_from_checkpoint(model, optimizer)
    loader.dataset.set_epoch(start_epoch)  # a resumed run shuffles as the first would have
    # 6. Broadcast the initial state from rank 0.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    tracking.log_params({"framework": "pytorch", "loader_workers": num_workers,
                         "shard_size": data.rows}, keep_existing=True)

    seen: list[int] = []
    global_step = start_epoch * len(loader)
    for epoch in range(start_epoch, epochs):
        model.train()
        total, batches = 0.0, 0
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images.to(device)), labels.long().to(device))
            loss.backward()
            optimizer.step()
            total, batches, global_step = total + float(loss), batches + 1, global_step + 1
        seen.append(batches)
        mean_loss = float(hvd.allreduce(torch.tensor(total / max(batches, 1)),
                                        name="epoch_loss"))
        # 7. Checkpoints (and the epoch's metrics) only on rank 0.
        hvd_torch.save_checkpoint(model, optimizer, epoch, global_step, {"loss": mean_loss},
                                  epochs=epochs)
    # 8. Only rank 0 logs: the test accuracy, then the model.
    _, _, x_test, y_test = digits_keras.load_data(seed)
    model.eval()
    with torch.no_grad():
        features = torch.from_numpy(np.ascontiguousarray(x_test.transpose(0, 3, 1, 2)))
        accuracy = float((model(features.to(device)).argmax(1).cpu()
                          == torch.from_numpy(y_test)).float().mean())
    tracking.log_metric("test_accuracy", accuracy, step=epochs - 1)
    if log_model:
        hvd_torch.log_model(model, name="model", input_example=features[:4].numpy())
    return {"test_accuracy": accuracy, "batches_per_epoch": hvd.allgather_object(seen),
            "len": len(loader)}


def main() -> None:
    from pyspark.sql import SparkSession

    from mlflow_hvd import HorovodRunner

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this Python
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    result = HorovodRunner(np=2, spark=spark).run(train, data=images_frame(spark), epochs=5)
    print(f"test accuracy {result['test_accuracy']:.3f}")


if __name__ == "__main__":
    main()

"""docs/migration.md's training functions (examples/migration.py), run: a ``horovod.spark``
function unchanged, a TorchDistributor function before (on pyspark's own TorchDistributor)
and after its move to Horovod (on the runner: the same losses), and a
spark-tensorflow-distributor function moved to the Keras 3 drop-in. Ours run on the
module's warm ranks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlflow
import pytest

pytestmark = [pytest.mark.slow]


def test_a_horovod_spark_function_runs_unchanged(warm_ranks: Any, store: str) -> None:
    import migration

    losses = warm_ranks.run(migration.train_torch, lr=0.05, epochs=3)
    assert len(losses) == 3 and losses[-1] < losses[0], losses  # it learns


def test_a_torch_distributor_function_moved_to_horovod_trains_as_it_did(
        spark: Any, warm_ranks: Any, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same data, seed and learning rate: DistributedDataParallel under pyspark's
    TorchDistributor and Horovod's averaged gradients under the runner end at the same
    loss, averaged over the ranks (both average the two ranks' gradients every step); and
    the DDP function itself under mlflow_hvd's TorchDistributor (one import changed)."""
    import migration
    from pyspark.ml.torch.distributor import TorchDistributor

    # torchrun's processes import the function's module, as TorchDistributor's users
    # arrange: it is on their PYTHONPATH
    examples = str(Path(migration.__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [examples, *filter(None, [os.environ.get("PYTHONPATH")])]))
    theirs = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        migration.train_ddp, 0.05, 3)
    ours = warm_ranks.run(migration.train_ddp_as_horovod, lr=0.05, epochs=3)
    assert ours == pytest.approx(theirs, rel=1e-4), (ours, theirs)
    # or the function unchanged, one import changed: the same DDP, the same loss
    from mlflow_hvd import TorchDistributor as OurTorchDistributor

    unchanged = OurTorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        migration.train_ddp, 0.05, 3)
    assert unchanged == pytest.approx(theirs, rel=1e-6), (unchanged, theirs)
    run = mlflow.MlflowClient().get_run(warm_ranks.last_run_id)
    assert [m.step for m in mlflow.MlflowClient().get_metric_history(
        run.info.run_id, "loss")] == [0, 1, 2]  # rank 0 logged each epoch


def test_a_spark_tensorflow_distributor_function_moved_to_the_keras_drop_in(
        warm_ranks: Any, store: str) -> None:
    import migration

    loss = warm_ranks.run(migration.train_keras, lr=0.05, epochs=3)
    assert loss < 2.0, loss  # from ln(10) = 2.30 at random
    run = mlflow.MlflowClient().get_run(warm_ranks.last_run_id)
    assert [m.step for m in mlflow.MlflowClient().get_metric_history(
        run.info.run_id, "loss")] == [0, 1, 2]

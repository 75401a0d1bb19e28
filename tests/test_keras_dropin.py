"""Code written for Databricks' HorovodRunner and horovod.tensorflow.keras runs with one
changed import; the old import fails at once instead of training with unaveraged gradients."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import workers

from mlflow_hvd import HorovodRunner, TrackingConfig, WorkerFailedError

EXAMPLE = Path(__file__).parent.parent / "examples" / "databricks_keras.py"


@pytest.mark.slow
def test_databricks_training_function_runs_with_only_its_import_changed(
    tmp_path: Path, warm_ranks: Any
) -> None:
    import databricks_keras

    ckpt = tmp_path / "ckpt.weights.h5"
    sums = warm_ranks.run(
        databricks_keras.train_hvd, checkpoint_path=str(ckpt), epochs=2
    )
    assert len(sums) == 2 and sums[0] == sums[1], sums  # gradients averaged: same weights
    assert ckpt.exists()  # rank 0's Keras checkpoint


@pytest.mark.ranks
def test_horovods_own_keras_layer_fails_at_once_under_keras_3(tmp_path: Path) -> None:
    source = EXAMPLE.read_text().replace(
        "import mlflow_hvd.keras as hvd  # was: import horovod.tensorflow.keras as hvd",
        "import horovod.tensorflow.keras as hvd",
    )
    path = tmp_path / "databricks_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("databricks_old", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["databricks_old"] = module
    spec.loader.exec_module(module)  # the driver may import it; ranks refuse it
    try:
        with pytest.raises(WorkerFailedError) as info:
            HorovodRunner(np=-2, tracking=TrackingConfig(track=False)).run(module.train_hvd,
                checkpoint_path="x")
    finally:
        del sys.modules["databricks_old"]
    import keras

    assert info.value.root_cause.error == (
        f"IncompatibleImportError: horovod.tensorflow.keras does not work with Keras "
        f"{keras.__version__} (the Keras of TensorFlow >= 2.16): its DistributedOptimizer trains "
        "without averaging gradients, and its callbacks fail ('Variable' object has no "
        "attribute 'ref'; module 'keras.backend' has no attribute 'constant'). Replace "
        "`import horovod.tensorflow.keras as hvd` with `import mlflow_hvd.keras as hvd`: the "
        "same names, on Keras 3 (docs/keras.md, Migrating)"
    )


def test_the_drop_in_namespace_honours_or_refuses_horovods_arguments(warm_ranks: Any) -> None:
    out = warm_ranks.run(workers.keras_dropin_checks)
    assert out["bpps"] == (
        "ConfigurationError: DistributedOptimizer: backward_passes_per_step=2 is not supported; "
        "accumulate gradients with Keras 3 itself: pass gradient_accumulation_steps=N to the "
        "optimizer you wrap (it averages the N steps, i.e. average_aggregated_gradients=True)"
    )
    assert out["groups"] == (
        "ConfigurationError: DistributedOptimizer: num_groups/groups are not supported: all "
        "gradients are reduced in one fused grouped_allreduce per step"
    )
    assert out["unknown"].startswith(
        "ConfigurationError: DistributedOptimizer got unexpected keyword arguments ['colour']"
    )
    assert out["adasum"].startswith("ConfigurationError: DistributedOptimizer: op=")
    assert out["adasum"].endswith(
        "is not supported here (Adasum needs an MPI build); use hvd.Average (default) or hvd.Sum"
    )
    assert out["predivide"] == (
        "ConfigurationError: DistributedOptimizer: gradient_predivide_factor needs op=hvd.Average"
    )
    assert out["process_set"] == (
        "ConfigurationError: DistributedOptimizer: only the global process set is supported "
        "(every rank takes part)"
    )
    assert out["not_a_tape"] == (
        "ConfigurationError: DistributedGradientTape needs a tf.GradientTape, got object"
    )
    assert out["global_vars"].startswith(
        "ConfigurationError: broadcast_global_variables: Keras 3 has no global variables"
    )
    assert out["tape"] == [[1.5, 1.5, 1.5], [1.5, 1.5, 1.5]]  # mean of 1 and 2, fp16-exact
    assert out["schedule"] == [0.1, 0.05, 0.025]
    # 2 steps per epoch inferred from fit: 0.1 then 0.15 in epoch 0, 0.2 from epoch 1 on
    assert out["warmup"] == [0.15, 0.2]
    assert out["broadcast"] == [0.0, 0.0]  # rank 0's kernel (zeros) everywhere
    assert out["loaded"] == ["SGD", True]

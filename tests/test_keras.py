"""The Keras 3 layer: numerical equivalence, checkpoints, resume, a loadable model."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import digits_keras
import mlflow
import numpy as np
import pytest
import workers

from mlflow_hvd import HorovodRunner, JobConfig, TrackingConfig, WorkerFailedError
from mlflow_hvd.rank.tracking import requirements
from mlflow_hvd.rank.tracking.signature import declared_signature

pytestmark = pytest.mark.slow


@pytest.mark.new_end
@pytest.mark.old_end
def test_two_ranks_on_half_batches_match_one_rank_on_the_full_batch(warm_ranks: Any) -> None:
    one = HorovodRunner(np=-1, tracking=TrackingConfig(track=False)).run(workers.keras_numerics,
        steps=5)
    two = warm_ranks.run(workers.keras_numerics, steps=5)
    assert two["type"] == "SGD"  # the wrapper keeps the optimizer's identity
    for w1, w2 in zip(one["weights"], two["weights"], strict=True):
        np.testing.assert_allclose(np.array(w2), np.array(w1), rtol=1e-5, atol=1e-6)
    # rank 1 started from other weights: the broadcast made every rank identical
    assert len(set(two["checksums"])) == 1
    # and training moved the weights: the comparison is not between untouched models
    untouched = HorovodRunner(np=-1,
        tracking=TrackingConfig(track=False)).run(workers.keras_numerics, steps=0)
    assert not np.allclose(np.array(untouched["weights"][0]), np.array(one["weights"][0]))


@pytest.mark.old_end
def test_fit_logs_one_series_per_metric_checkpoints_and_a_loadable_model(
    store: str, warm_ranks: Any
) -> None:
    runner = warm_ranks
    result = runner.run(digits_keras.train, epochs=2)
    client = mlflow.MlflowClient()
    run_id = runner.last_run_id
    assert run_id is not None
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "effective_learning_rate"):
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == [0, 1], key  # one series, in order, no rank 1
    assert run.data.params["hvd_size"] == "2"
    assert run.data.params["opt_name"] == "Adam"
    assert float(run.data.params["opt_learning_rate"]) == pytest.approx(0.002)
    assert run.data.tags["mlflow.latest_checkpoint_artifact"] == (
        "checkpoints/epoch_1/checkpoint.keras"
    )
    ckpt = mlflow.tensorflow.load_checkpoint(run_id=run_id, epoch=0)  # MLflow's own reader
    assert type(ckpt.optimizer).__name__ == "Adam"
    (model_out,) = run.outputs.model_outputs
    assert model_out.step == 1  # linked to the final epoch's metrics, not step 0
    logged = client.get_logged_model(model_out.model_id)
    assert logged.tags["mlflow.source.name"] == run.data.tags["mlflow.source.name"]
    assert not logged.tags["mlflow.source.name"].endswith("worker.py")
    x_train, y_train, x_test, y_test = digits_keras.load_data()
    pyfunc = mlflow.pyfunc.load_model(f"models:/{model_out.model_id}")
    (inputs,) = pyfunc.metadata.get_input_schema().inputs  # what the model declares
    assert inputs.shape == (-1, 8, 8, 1)
    (outputs,) = pyfunc.metadata.get_output_schema().inputs
    assert outputs.shape == (-1, 10)
    # the input example is saved beside the declared signature (not used to infer it)
    example = pyfunc.input_example
    assert np.asarray(example).shape == (4, 8, 8, 1)
    assert np.allclose(np.asarray(example), x_test[:4])
    accuracy = float((np.asarray(pyfunc.predict(x_test)).argmax(1) == y_test).mean())
    assert accuracy == pytest.approx(result["test_accuracy"], abs=1e-6)
    assert accuracy > 0.5  # ten classes: chance is 0.1
    keras_model = mlflow.tensorflow.load_model(f"models:/{model_out.model_id}")
    assert keras_model.predict(x_test[:3], verbose=0).shape == (3, 10)
    # requirements are the training environment's own versions (no inference subprocess)
    reqs = Path(
        mlflow.artifacts.download_artifacts(f"{logged.artifact_location}/requirements.txt")
    ).read_text().split()
    v = importlib.metadata.version
    assert reqs[0] == f"mlflow=={v('mlflow')}"
    assert f"tensorflow-cpu=={v('tensorflow-cpu')}" in reqs and f"keras=={v('keras')}" in reqs
    assert f"numpy=={v('numpy')}" in reqs and f"cloudpickle=={v('cloudpickle')}" in reqs


def test_known_requirements_keep_the_users_choice() -> None:
    v = importlib.metadata.version
    pins = [f"tensorflow-cpu=={v('tensorflow-cpu')}", f"keras=={v('keras')}",
            f"numpy=={v('numpy')}", f"cloudpickle=={v('cloudpickle')}"]
    assert requirements.with_known_requirements({"step": 3}) == {
        "step": 3, "pip_requirements": pins
    }
    assert requirements.with_known_requirements({"extra_pip_requirements": ["x==1"]}) == {
        "pip_requirements": [*pins, "x==1"]
    }
    mine = {"pip_requirements": ["tensorflow"]}
    assert requirements.with_known_requirements(mine) == mine
    assert requirements.with_known_requirements({"conda_env": "env.yaml"}) == {
        "conda_env": "env.yaml"
    }
    assert requirements.installed(("not-a-package-xyz", "numpy")) == [
        f"numpy=={importlib.metadata.version('numpy')}"
    ]


def test_a_logged_models_signature_is_what_the_model_declares() -> None:
    """Read from the model, not from a prediction (which traces Keras' predict function)."""
    import keras

    def specs(schema: Any) -> list[tuple[str | None, str, tuple[int, ...]]]:
        return [(t.name, str(t.type), t.shape) for t in schema.inputs]

    seq = declared_signature(digits_keras.build_model())
    assert specs(seq.inputs) == [(None, "float32", (-1, 8, 8, 1))]
    assert specs(seq.outputs) == [(None, "float32", (-1, 10))]
    x = keras.Input((3,), name="x")
    a, b = keras.layers.Dense(2)(x), keras.layers.Dense(1, dtype="float64")(x)
    two_out = declared_signature(keras.Model(x, [a, b]))
    assert specs(two_out.inputs) == [(None, "float32", (-1, 3))]
    assert specs(two_out.outputs) == [(a.name, "float32", (-1, 2)), (b.name, "float64", (-1, 1))]
    y = keras.Input((2,), name="y")
    two_in = keras.Model([x, y], keras.layers.Concatenate()([x, y]))
    assert declared_signature(two_in) is None  # the caller would have to match input names

    class Subclassed(keras.Model):
        def call(self, inputs: Any) -> Any:
            return inputs

    assert declared_signature(Subclassed()) is None  # declares nothing


@pytest.mark.old_end
def test_resume_after_a_failure_continues_from_the_last_checkpoint(
    store: str, warm_ranks: Any
) -> None:
    runner = HorovodRunner(np=-2, job=JobConfig(stop_grace=2))
    with pytest.raises(WorkerFailedError) as info:
        runner.run(digits_keras.train, epochs=4, fail_at_epoch=2, log_model=False)
    assert info.value.root_cause.error == (
        "RuntimeError: injected failure at the start of epoch 2"
    )
    run_id = runner.last_run_id
    client = mlflow.MlflowClient()
    assert client.get_run(run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1]

    with mlflow.start_run(run_id=run_id):  # the same run, started again
        result = warm_ranks.run(digits_keras.train, epochs=4, log_model=False)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.resumed_from"] == f"{run_id}@epoch_1"
    for key in ("loss", "val_accuracy"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [0, 1, 2, 3]
    epochs = [a.path for a in client.list_artifacts(run_id, "checkpoints")]
    assert epochs == [f"checkpoints/epoch_{i}" for i in range(4)]
    assert result["test_accuracy"] > 0.5


def test_misuse_of_the_keras_layer_is_refused_on_every_rank(warm_ranks: Any) -> None:
    found = warm_ranks.run(workers.keras_misuse)
    assert found == {
        "scale": "learning_rate must be > 0, got 0",
        "optimizer": "DistributedOptimizer needs a keras.optimizers.Optimizer, got str",
        "warmup": "warmup_epochs must be >= 0 and steps_per_epoch >= 1, got -1 and 10",
        "every": "log_every_n_steps must be >= 1, got 0",
        "steps": "LearningRateWarmupCallback needs steps_per_epoch: fit did not report its "
        "number of steps (a dataset of unknown length); pass steps_per_epoch=...",
        "restore": "compile the model before restore_from_checkpoint: the checkpoint restores "
        "the optimizer's state too",
        "xla": "the model was compiled with jit_compile=True (XLA); Horovod's allreduce has no "
        "XLA kernel in this build: compile with jit_compile=False",
        "counts": "ranks hold different numbers of variables to broadcast (by rank: [6, 4]); "
        "build the model and optimizer the same way on every rank",
    }


def test_mlflow_autolog_and_the_callback_log_each_epoch_once_into_the_jobs_run(
    store: str, warm_ranks: Any
) -> None:
    """Autolog writes the epoch metrics (MlflowCallback then logs only its checkpoints), into
    the job's run, and is off again for the next job on the same warm ranks."""
    runner = warm_ranks
    assert runner.run(workers.keras_autolog_with_callback, epochs=2) == runner.last_run_id
    run_id = runner.last_run_id
    client = mlflow.MlflowClient()
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "2"  # autolog's own param of fit
    assert run.data.tags["mlflow.latest_checkpoint_artifact"] == (
        "checkpoints/epoch_1/checkpoint.keras")
    assert len(mlflow.search_runs(search_all_experiments=True, output_format="list")) == 1
    assert runner.run(workers.autolog_state, enable=False, flavor="tensorflow") is False


def _check_models_of_every_framework(run_id: str, seen: dict[str, Any],
                                     frameworks: tuple[str, ...],
                                     others: tuple[str, ...] = ()) -> None:
    """What :func:`workers.frameworks_log_models` leaves in the job's run: one model per
    ``log_model`` and autolog's, each logged once (by rank 0), each loadable, with its
    input example."""
    client = mlflow.MlflowClient()
    assert seen["seen"] == [run_id, run_id]  # autolog's run was the job's, at every epoch
    assert seen["run"] == run_id
    models = client.search_logged_models(experiment_ids=["0"],
                                         filter_string=f"source_run_id = '{run_id}'")
    names = sorted(m.name for m in models)
    # autolog's is "model"; ``others``: models the job logged besides these
    assert names == sorted(["model", *(f"{f}_model" for f in frameworks), *others])
    assert all(str(m.status) == "READY" for m in models)
    for framework in frameworks:
        model_id, model_run = seen[framework]
        assert model_run == run_id
        info = mlflow.models.get_model_info(f"models:/{model_id}")
        assert info.saved_input_example_info is not None
        out = mlflow.pyfunc.load_model(f"models:/{model_id}").predict(
            np.ones((2, 4), dtype="float32"))
        assert np.asarray(out).shape in ((2, 1), (2,))
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1]


@pytest.mark.old_end
def test_autolog_and_log_model_on_every_rank_log_each_model_once_into_the_jobs_run(
    store: str, warm_ranks: Any
) -> None:
    """MLflow's docs' way on every rank: TensorFlow autolog (with its model) and
    ``mlflow.tensorflow.log_model``; only rank 0's models exist, each returns a ModelInfo."""
    seen = warm_ranks.run(workers.frameworks_log_models, epochs=2, torch=False)
    _check_models_of_every_framework(warm_ranks.last_run_id, seen, ("keras",))
    assert len(mlflow.search_runs(search_all_experiments=True, output_format="list")) == 1


def test_a_checkpoint_resumed_on_another_number_of_ranks_rescales_the_learning_rate(
        store: str, warm_ranks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an elastic job's resize does to a Keras job: 2 ranks write the checkpoints
    (scaled rate 0.02), 1 rank resumes them: the rate the optimizer's state brings back is
    rescaled to 0.01, as scale_learning_rate gives 1 rank."""
    first = warm_ranks.run(workers.keras_lr_resumed, epochs=2)
    assert first == {"initial": 0, "lr": pytest.approx(0.02), "size": 2}
    monkeypatch.setenv("MLFLOW_RUN_ID", str(warm_ranks.last_run_id))  # resume that run
    resumed = HorovodRunner(np=-1).run(workers.keras_lr_resumed, epochs=3)
    assert resumed == {"initial": 2, "lr": pytest.approx(0.01), "size": 1}


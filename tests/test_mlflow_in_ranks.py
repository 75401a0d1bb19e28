"""MLflow's own API inside the training function, unmodified, through mlflow_hvd's tracking
store and artifact repository (MLflow's plugin seams): everything lands in the job's one
run, from rank 0 only, as plain MLflow would log it; every rank gets the same kind of
answers; reads beyond the job's run are rank 0's."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers
import yaml
from mlflow.models import Model

from mlflow_hvd import HorovodRunner

SAID = "MLflow calls on this rank write nothing"
_FILES = ("img", "info", "tables")  # where workers.mlflow_writes puts its files
_OWN_IDS = ("artifact_path", "model_id", "model_uuid", "run_id", "utc_time_created")


def _run_ids() -> set[str]:
    return {r.info.run_id for r in mlflow.search_runs(search_all_experiments=True,
                                                      output_format="list")}


def _files(client: Any, run_id: str, path: str | None = None) -> list[str]:
    out: list[str] = []
    for f in client.list_artifacts(run_id, path):
        out += _files(client, run_id, f.path) if f.is_dir else [f.path]
    return out


def _logged(run_id: str, model_id: str, tmp_path: Path) -> dict[str, Any]:
    """What MLflow has of a run that :func:`workers.mlflow_writes` logged into, with the
    run's and model's own ids left out."""
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    model = client.get_logged_model(model_id)
    history = {k: [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, k)]
               for k in ("m", "a", "b", "rmse", "fit")}
    table = client.download_artifacts(run_id, "tables/t.json", str(tmp_path / run_id))
    local = mlflow.artifacts.download_artifacts(f"models:/{model_id}",
                                                dst_path=str(tmp_path / model_id))
    mlmodel = yaml.safe_load(Path(local, "MLmodel").read_text())
    assert mlmodel["artifact_path"] == model.artifact_location  # where it is, as MLflow says
    return {
        "params": {k: v for k, v in run.data.params.items() if k in ("alpha", "beta")},
        "tags": {k: run.data.tags.get(k) for k in ("who", "t")},
        "history": history,
        "datasets": [(d.dataset.name, d.dataset.digest, d.dataset.source_type,
                      [(t.key, t.value) for t in d.tags]) for d in run.inputs.dataset_inputs],
        "outputs": [o.step for o in run.outputs.model_outputs if o.model_id == model_id],
        "files": [f for f in _files(client, run_id) if f.split("/")[0] in _FILES],
        "table": json.loads(Path(table).read_text()),
        "model": (model.name, model.source_run_id == run_id, str(model.status),
                  sorted((m.key, m.step, m.value) for m in model.metrics or []
                         if m.key in history)),
        "model_files": sorted(os.listdir(local)),
        "mlmodel": {k: v for k, v in mlmodel.items() if k not in _OWN_IDS},
        "example": Model.load(f"models:/{model_id}").load_input_example().tolist(),
    }


def _plain(tmp_path: Path) -> dict[str, Any]:
    """:func:`workers.mlflow_writes` as plain MLflow logs it, in this process."""
    plain = workers.mlflow_writes()
    return _logged(plain["run"], plain["model_id"], tmp_path / "plain")


def _check_job(runner: HorovodRunner, seen: dict[str, Any], other: str, tmp_path: Path,
               before: set[str]) -> None:
    run_id = runner.last_run_id or ""
    assert seen["run"] == seen["inside"] == seen["model_run"] == seen["after"] == run_id
    assert seen["before"] is None  # as in MLflow: no active run until one is started
    assert seen["seen_status"] == seen["server_status"] == "RUNNING"
    assert {k: seen["seen_params"][k] for k in ("alpha", "beta")} == {"alpha": "0.5",
                                                                      "beta": "2"}
    assert seen["refused"] == [
        "ConfigurationError: mlflow.start_run(nested=True) inside a HorovodRunner job",
        f"ConfigurationError: logging for run {other} inside a HorovodRunner job",
        f"ConfigurationError: logging for run {other} inside a HorovodRunner job"]
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["after"] == 1.0
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "client")] == [(7, 2.0)]
    assert _run_ids() - before == {run_id}  # no rank made a run of its own
    job = _logged(run_id, seen["model_id"], tmp_path / "job")
    assert job["tags"] == {"who": "rank0", "t": "1"}  # rank 0's writes, nobody else's
    assert job == _plain(tmp_path)


@pytest.mark.old_end
@pytest.mark.slow
def test_mlflow_as_its_docs_write_it_lands_in_the_jobs_run_as_plain_mlflow_logs_it(
    store: str, tmp_path: Path, capfd: pytest.CaptureFixture[str],
) -> None:
    with mlflow.start_run() as other:
        pass
    before = _run_ids()
    runner = HorovodRunner(np=-2, driver_log_verbosity="all")
    seen = runner.run(workers.mlflow_as_documented, other_run=other.info.run_id)
    _check_job(runner, seen, other.info.run_id, tmp_path, before)
    err = capfd.readouterr()
    said = [ln for ln in (err.out + err.err).splitlines() if SAID in ln]
    assert said == [f"[1]<stderr>: mlflow_hvd: rank 1: {SAID} (only rank 0 logs, into the job's "
                    f"run {runner.last_run_id}); the first wrote params"]


@pytest.mark.old_end
def test_names_bound_from_mlflow_before_the_job_log_into_its_run_from_rank_0(
    store: str, capfd: pytest.CaptureFixture[str],
) -> None:
    """MLflow's quickstart style, ``from mlflow import log_metric, log_param`` at the top of
    the module: the names are MLflow's own, bound when the payload is unpickled."""
    runner = HorovodRunner(np=-2, driver_log_verbosity="all")
    runner.run(workers.quickstart, steps=3)
    client = mlflow.MlflowClient()
    run = client.get_run(runner.last_run_id or "")
    assert run.data.params == {**run.data.params, "who": "rank0"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (0, 1.0), (1, 0.5), (2, 1 / 3)]
    assert _run_ids() == {run.info.run_id}
    err = capfd.readouterr()
    assert sum(SAID in ln for ln in (err.out + err.err).splitlines()) == 1


@pytest.mark.old_end
@pytest.mark.slow
@pytest.mark.spark
def test_mlflow_on_spark_ranks_writes_over_http_into_the_jobs_run(
    spark: Any, loopback_server: Any, tmp_path: Path,
) -> None:
    """Every case on Spark ranks in one job (the quickstart, the documented calls, autolog
    and each framework's log_model: PyTorch where installed, not at the old end), through an
    ``mlflow server`` with proxied artifacts."""
    mlflow.set_tracking_uri(loopback_server.url)  # restore_tracking_uri resets it
    with mlflow.start_run() as other:
        pass
    before = _run_ids()
    runner = HorovodRunner(np=2, spark=spark)
    torch = importlib.util.find_spec("torch") is not None
    seen = runner.run(workers.spark_everything, other_run=other.info.run_id, torch=torch)
    frameworks = seen.pop("frameworks")
    _check_job(runner, seen, other.info.run_id, tmp_path, before)
    from test_keras import _check_models_of_every_framework

    history = mlflow.MlflowClient().get_metric_history(runner.last_run_id, "quickstart_loss")
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 0.5), (2, 1 / 3)]
    _check_models_of_every_framework(runner.last_run_id or "", frameworks,
                                     ("keras", "torch") if torch else ("keras",), ("linear",))


@pytest.mark.slow
def test_reads_beyond_the_jobs_run_are_rank_0s_and_other_ranks_are_told_how(
    store: str, tmp_path: Path,
) -> None:
    import numpy as np
    from sklearn.linear_model import LinearRegression

    with mlflow.start_run():
        x = np.eye(2)
        mlflow.sklearn.log_model(LinearRegression().fit(x, [1.0, 2.0]), name="m",
                                 registered_model_name="toy", pip_requirements=["scikit-learn"])
    mlflow.MlflowClient().set_registered_model_alias("toy", "champion", "1")
    HorovodRunner(np=-2).run(workers.mlflow_reads, model_uri="models:/toy@champion",
                             out_dir=str(tmp_path))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == {"rank": 0, "register": "1", "search_runs": 2,
                     "registry": ["from_rank_0", "toy"], "load": [1.5]}
    registered = mlflow.pyfunc.load_model("models:/from_rank_0/1")  # the job's model, rank 0's
    assert registered.predict(np.ones((1, 2))).tolist() == [pytest.approx(0.5)]
    assert rank1["search_runs"].startswith(
        "searching runs on rank 1: inside a HorovodRunner job only rank 0 talks to the "
        f"tracking server ({store}), with the driver's credentials. Do it on rank 0 and send "
        "the result to the others (hvd.broadcast_object(value, root_rank=0))")
    assert rank1["registry"].startswith("the Model Registry (search_registered_models) on "
                                        "rank 1: inside a HorovodRunner job only rank 0")
    assert rank1["load"].startswith("the Model Registry (")
    assert rank1["register"].startswith("the Model Registry (")


@pytest.mark.slow
def test_autolog_a_job_enables_is_off_again_for_the_next_job_on_warm_ranks(store: str) -> None:
    with HorovodRunner(np=-1) as runner:
        assert runner.run(workers.autolog_state, enable=True) is True
        assert runner.run(workers.autolog_state, enable=False) is False


@pytest.mark.slow
def test_a_model_logged_after_mlflows_own_metrics_links_to_their_latest_step(
        store: str, warm_ranks: Any) -> None:
    """MLflow's own API and mlflow_hvd's functions write through one path on rank 0: a
    model logged with mlflow_hvd after mlflow.log_metric(..., step=5) is linked to step 5
    (it was linked to step 0: the step moved only with mlflow_hvd's own metrics)."""
    warm_ranks.run(workers.model_after_mlflows_metrics)
    run = mlflow.MlflowClient().get_run(str(warm_ranks.last_run_id))
    assert [o.step for o in run.outputs.model_outputs] == [5]


def test_a_training_function_that_points_mlflow_elsewhere_is_told_so(
    store: str, capfd: pytest.CaptureFixture[str],
) -> None:
    uri = "http://127.0.0.1:9"  # set, never used
    runner = HorovodRunner(np=-1, driver_log_verbosity="all")
    assert runner.run(workers.set_own_tracking_uri, uri=uri) == uri
    err = capfd.readouterr()
    said = [ln for ln in (err.out + err.err).splitlines() if "set MLflow's tracking URI" in ln]
    assert said == [
        f"[0]<stderr>: mlflow_hvd: rank 0: the training function set MLflow's tracking URI to "
        f"{uri}: its MLflow calls after that went there directly, from every rank, outside "
        "the job's run. Leave the tracking URI as the job sets it (set it on the driver) to "
        "log into the job's run from rank 0"]

"""MLflow's own fluent API inside the training function writes into the job's run on rank 0,
through the same queued path as mlflow_hvd.tracking, and nothing anywhere else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers

from mlflow_hvd import HorovodRunner


def _run_ids() -> set[str]:
    return {r.info.run_id for r in mlflow.search_runs(search_all_experiments=True,
                                                      output_format="list")}


def _check_the_job_run_got_everything(run_id: str, tmp_path: Path, before: set[str]) -> None:
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert {k: run.data.params[k] for k in ("alpha", "beta")} == {"alpha": "0.5", "beta": "2"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "m")] == [
        (0, 0.0), (1, 10.0), (2, 20.0)]
    assert (run.data.metrics["a"], run.data.metrics["b"]) == (1.0, 2.0)
    assert (run.data.tags["who"], run.data.tags["t"]) == ("rank0", "1")
    path = client.download_artifacts(run_id, "info/fluent.json", str(tmp_path))
    assert json.loads(Path(path).read_text()) == {"rank": 0}
    assert _run_ids() - before == {run_id}  # no rank created a run of its own


@pytest.mark.slow
def test_mlflow_fluent_calls_on_local_ranks_go_into_the_jobs_run_from_rank_0_only(
    store: str, tmp_path: Path, capfd: pytest.CaptureFixture[str],
) -> None:
    runner = HorovodRunner(np=-2, driver_log_verbosity="all")
    seen = runner.run(workers.fluent_mlflow)
    assert seen == {"active": runner.last_run_id, "run": runner.last_run_id,
                    "after": runner.last_run_id}
    _check_the_job_run_got_everything(runner.last_run_id or "", tmp_path, set())
    err = capfd.readouterr()
    said = [ln for ln in (err.out + err.err).splitlines() if "MLflow calls on this rank" in ln]
    assert len(said) == 1, said  # once, by rank 1
    assert said[0].endswith(f"mlflow_hvd: rank 1: MLflow calls on this rank write nothing "
                            f"(only rank 0 logs, into the job's run {runner.last_run_id}); "
                            "the first was mlflow.start_run")


@pytest.mark.slow
@pytest.mark.spark
def test_mlflow_fluent_calls_on_spark_ranks_reach_a_tracking_server(
    spark: Any, loopback_server: Any, tmp_path: Path,
) -> None:
    mlflow.set_tracking_uri(loopback_server.url)  # restore_tracking_uri resets it
    before = _run_ids()
    runner = HorovodRunner(np=2, spark=spark)
    seen = runner.run(workers.fluent_mlflow)
    assert seen["run"] == seen["active"] == runner.last_run_id
    _check_the_job_run_got_everything(runner.last_run_id or "", tmp_path, before)


def test_other_runs_are_refused_on_rank_0_with_the_reason(store: str) -> None:
    refused = HorovodRunner(np=-1).run(workers.fluent_refusals)
    assert len(refused) == 3
    assert refused[0].startswith("mlflow.start_run(nested=True) inside a HorovodRunner job: "
                                 "the job logs into one run")
    assert refused[1].startswith(f"mlflow.start_run(run_id='{'0' * 32}') inside a "
                                 "HorovodRunner job: rank 0 logs into the job's run")
    assert refused[2].startswith(f"mlflow.log_metric(run_id='{'0' * 32}')")


@pytest.mark.slow
def test_autolog_a_job_enables_is_off_again_for_the_next_job_on_warm_ranks(store: str) -> None:
    with HorovodRunner(np=-1) as runner:
        assert runner.run(workers.autolog_state, enable=True) is True
        assert runner.run(workers.autolog_state, enable=False) is False

"""Hyperopt sweeps of distributed trials, each a nested MLflow run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers
from hyperopt import hp

from mlflow_hvd import JobConfig
from mlflow_hvd.errors import ConfigurationError, MlflowHvdError, TrackingError
from mlflow_hvd.sweep import space_from_json, sweep

SPACE = {"x": hp.uniform("x", 0.0, 1.0), "y": hp.choice("y", [0, 1, 2])}


def _children(parent_id: str) -> list[Any]:
    runs = mlflow.search_runs(
        search_all_experiments=True,
        filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
        output_format="list",
    )
    return sorted(runs, key=lambda r: int(r.data.tags["mlflow_hvd.sweep.trial"]))


@pytest.mark.old_end
@pytest.mark.slow
@pytest.mark.spark
def test_sweep_of_three_spark_trials(store: str, spark: Any) -> None:
    import matplotlib

    matplotlib.use("pdf")  # the caller's choice: the sweep's chart must not change it
    result = sweep(workers.quadratic_trial, SPACE, max_evals=3, np=2, seed=1,
                   spark=spark)
    assert matplotlib.get_backend() == "pdf"
    client = mlflow.MlflowClient()
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED"
    children = _children(result.parent_run_id)
    assert [c.data.tags["mlflow_hvd.sweep.trial"] for c in children] == ["0", "1", "2"]
    assert {c.info.status for c in children} == {"FINISHED"}
    assert {c.data.tags["mlflow_hvd.backend"] for c in children} == {"spark"}
    losses = {c.info.run_id: c.data.metrics["val_loss"] for c in children}
    best_id = min(losses, key=losses.__getitem__)
    assert parent.data.tags["mlflow_hvd.sweep.best_run_id"] == best_id == result.best_run_id
    best_child = client.get_run(best_id)
    # sampled params, np and the function's other arguments: columns shared with plain runs
    params = best_child.data.params
    assert sorted(params) == ["fail_marker", "np", "x", "y"]
    assert (params["np"], params["fail_marker"]) == ("2", "")
    # the params logged are the ones the trial ran with: its loss follows from them
    x, y = float(params["x"]), int(params["y"])
    # (x travels as a float32 tensor through the allreduce)
    assert losses[best_id] == pytest.approx((x - 0.3) ** 2 + y / 10.0, abs=1e-6)
    assert result.best_params == {"x": pytest.approx(x), "y": y}
    assert parent.data.params["best_x"] == best_child.data.params["x"]
    assert parent.data.params["best_y"] == best_child.data.params["y"]
    assert parent.data.metrics["best_val_loss"] == pytest.approx(losses[best_id])
    assert isinstance(result.best_params["y"], int)  # real types, not "1.0"
    arts = {a.path for a in client.list_artifacts(result.parent_run_id)}
    assert {"loss_per_trial.png", "search_space.json", "hyperopt"} <= arts


@pytest.mark.slow
def test_failing_trial_is_a_failed_child_and_the_sweep_goes_on(
    store: str, tmp_path: Path
) -> None:
    marker = str(tmp_path / "failed-once")
    result = sweep(workers.quadratic_torch_trial, SPACE, max_evals=3, np=-2, seed=2,
        fixed_params={"fail_marker": marker}, job=JobConfig(stop_grace=2))
    children = _children(result.parent_run_id)
    assert [c.info.status for c in children] == ["FAILED", "FINISHED", "FINISHED"]
    assert children[0].data.tags["mlflow_hvd.root_cause"] == (
        "RuntimeError: first trial fails on purpose"
    )
    assert (result.trials, result.failed_trials) == (3, 1)
    assert result.losses[0] is None
    assert result.best_run_id in {c.info.run_id for c in children[1:]}


@pytest.mark.slow
def test_resume_repeats_no_trial_and_matches_an_uninterrupted_sweep(store: str) -> None:
    first = sweep(workers.quadratic_torch_trial, SPACE, max_evals=2, np=-1, seed=7)
    resumed = sweep(workers.quadratic_torch_trial, SPACE, max_evals=3, np=-1, seed=7,
                    parent_run_id=first.parent_run_id)
    assert resumed.parent_run_id == first.parent_run_id
    children = _children(first.parent_run_id)
    assert len(children) == 3 and resumed.trials == 3
    # fresh processes per trial (warm=False) give the same trials as warm ranks
    straight = sweep(workers.quadratic_torch_trial, SPACE, max_evals=3, np=-1, seed=7,
                     warm=False)
    straight_children = _children(straight.parent_run_id)
    # same seed, same sampled params, whether or not the sweep was interrupted
    assert [c.data.params for c in children] == [c.data.params for c in straight_children]
    assert resumed.losses == straight.losses


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "space must be a non-empty dict"),
        ({"x": ["gaussian", 0, 1]}, r"search space entry 'x' must be \[kind, \*args\]"),
        ({"x": "uniform"}, r"search space entry 'x' must be \[kind, \*args\]"),
        ({"x": ["choice", []]}, r"space\['x'\] cannot be sampled"),
    ],
)
def test_bad_search_spaces_fail_before_any_trial(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        space_from_json(spec)


def test_bad_sweep_arguments_start_nothing(store: str) -> None:
    with pytest.raises(ConfigurationError, match="max_evals must be an integer >= 1, got 0"):
        sweep(workers.quadratic_trial, SPACE, max_evals=0, np=-1)
    with pytest.raises(ConfigurationError, match="np=0 is not a valid number"):
        sweep(workers.quadratic_trial, SPACE, max_evals=1, np=0)
    with pytest.raises(ConfigurationError, match="space must be a non-empty dict"):
        sweep(workers.quadratic_trial, {}, max_evals=1, np=-1)
    with pytest.raises(ConfigurationError, match=r"^run\(quadratic_trial, \.\.\.\): it takes no "
                       r"argument 'yy' \(did you mean 'y'\?\)"):
        sweep(workers.quadratic_trial, {"x": SPACE["x"], "yy": SPACE["y"]}, max_evals=1, np=-1)
    assert mlflow.search_runs(search_all_experiments=True, output_format="list") == []


def test_no_progress_rule_counts_trials_since_the_best() -> None:
    from mlflow_hvd.sweep.trials_store import no_progress

    def trials(*losses: float | None) -> list[dict[str, float]]:
        return [{"loss": v} if v is not None else {} for v in losses]

    assert not no_progress(trials(3.0, 2.0, 2.5), 2)
    assert no_progress(trials(3.0, 2.0, 2.5, 2.1), 2)
    assert no_progress(trials(1.0, None, None), 2)  # failed trials are no progress
    assert not no_progress(trials(None, None), 1)  # no successful trial yet: keep going


def test_unreadable_saved_trials_stop_the_sweep_before_any_trial(store: str) -> None:
    client = mlflow.MlflowClient()
    parent = client.create_run("0")
    client.log_text(parent.info.run_id, "not a pickle", "hyperopt/trials.pkl")
    with pytest.raises(TrackingError) as info:
        sweep(workers.quadratic_trial, SPACE, max_evals=2, np=-1,
              parent_run_id=parent.info.run_id)
    assert str(info.value).startswith(
        f"sweep run {parent.info.run_id} has saved trials (hyperopt/trials.pkl) that cannot be "
        "read: UnpicklingError: "
    )
    assert str(info.value).endswith(
        "Fix access to the run's artifacts and rerun, or start a new sweep without parent_run_id"
    )
    # nothing was overwritten, and no trial ran
    text = mlflow.artifacts.load_text(f"runs:/{parent.info.run_id}/hyperopt/trials.pkl")
    assert text == "not a pickle"
    assert client.get_run(parent.info.run_id).info.status == "FAILED"
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert [r.info.run_id for r in runs] == [parent.info.run_id]


@pytest.mark.ranks
def test_a_sweep_whose_every_trial_fails_says_so(store: str, tmp_path: Path) -> None:
    with pytest.raises(MlflowHvdError) as info:
        sweep(workers.quadratic_torch_trial, SPACE, max_evals=1, np=-1,
              fixed_params={"fail_marker": str(tmp_path / "marker")})
    assert str(info.value) == "all 1 trials failed; see the child runs"


def test_metric_must_be_named(store: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        sweep(workers.quadratic_trial, SPACE, max_evals=1, np=-1, metric="")
    assert str(info.value) == "metric must name the metric to optimise, e.g. 'val_loss'"

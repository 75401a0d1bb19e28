"""Sweeps that run several distributed trials at once (``parallelism``): overlapping trials
on a Spark cluster with room for two, suggestions that match the sequential sweep, pruning
and resume with concurrency, refusals, and Ctrl-C stopping every running trial."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers
from conftest import REPO, assert_no_workers_left
from hyperopt import hp
from services import Program, stderr_tail

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.sweep import MedianRule, sweep

SPACE = {"x": hp.uniform("x", 0.0, 1.0)}


def _children(parent_id: str) -> list[Any]:
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list",
                              filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    return sorted(runs, key=lambda r: int(r.data.tags["mlflow_hvd.sweep.trial"]))


def _overlap(a: Any, b: Any) -> bool:
    return max(a.info.start_time, b.info.start_time) < min(a.info.end_time, b.info.end_time)


CLUSTER_SWEEP = """
import json, sys
sys.path.insert(0, {tests!r})
import mlflow, workers
from hyperopt import hp
from pyspark.sql import SparkSession
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.sweep import sweep

mlflow.set_tracking_uri({uri!r})
spark = (SparkSession.builder.master("local-cluster[2,2,1024]")
         .config("spark.ui.enabled", "false").getOrCreate())  # PYSPARK_PYTHON: conftest's
space = {{"x": hp.uniform("x", 0.0, 1.0)}}
out = {{}}
try:
    sweep(workers.paced_trial, space, max_evals=2, np=2, parallelism=3,
          spark=spark)
except ConfigurationError as exc:
    out["refused"] = str(exc)
r = sweep(workers.paced_trial, space, max_evals=3, np=2, parallelism="auto", seed=1,
          fixed_params={{"epochs": 3, "seconds": 1.0}}, spark=spark)
out["parent"] = r.parent_run_id
out["best"] = [r.best_run_id, r.best_loss]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_two_np2_trials_run_at_once_on_a_cluster_with_room_for_two(tmp_path: Path) -> None:
    """local-cluster[2,2,1024] has 4 task slots: parallelism='auto' runs two np=2 trials
    at once (each its own barrier stage in one application), 3 would not fit and is refused
    before any trial."""
    uri = f"sqlite:///{tmp_path}/sweep.db"
    code = CLUSTER_SWEEP.format(tests=str(REPO / "tests"), uri=uri)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, stderr_tail(proc.stderr)
    out = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert out["refused"] == (
        "parallelism=3 with np=2 needs 6 barrier task slots at once, but the Spark cluster "
        "(master local-cluster[2,2,1024]) has 4: at most 2 trials of np=2 fit. Use "
        "parallelism=2 or 'auto', or add executors or cores")
    mlflow.set_tracking_uri(uri)
    parent = mlflow.MlflowClient().get_run(out["parent"])
    assert parent.info.status == "FINISHED" and parent.data.params["parallelism"] == "2"
    children = _children(out["parent"])
    assert [c.data.tags["mlflow_hvd.sweep.trial"] for c in children] == ["0", "1", "2"]
    assert {c.info.status for c in children} == {"FINISHED"}
    assert {c.data.tags["mlflow_hvd.backend"] for c in children} == {"spark"}
    # seen from the runs themselves: the first two overlapped; the third took the slot
    # the first one to end freed
    assert _overlap(children[0], children[1])
    assert children[2].info.start_time >= min(children[0].info.end_time,
                                               children[1].info.end_time)
    for child in children:  # each result is its own trial's: the loss follows from its x
        x = float(child.data.params["x"])
        assert child.data.metrics["val_loss"] == pytest.approx((x - 0.3) ** 2 + 1 / 3, abs=1e-5)
    best = min(children, key=lambda c: c.data.metrics["val_loss"])
    assert out["best"] == [best.info.run_id, pytest.approx(best.data.metrics["val_loss"])]
    assert parent.data.tags["mlflow_hvd.sweep.best_run_id"] == best.info.run_id


@pytest.mark.slow
def test_concurrent_trials_suggest_as_the_sequential_sweep_prune_and_resume(
    store: str,
) -> None:
    """Local np=-1 trials two at a time: the points of trials 0-3 are the sequential
    sweep's (TPE's random start), trial numbers follow suggestion order, the median rule
    (over the trials that ended or reached the epoch) prunes, and a resume continues the
    numbering and the saved history."""
    fixed = {"epochs": 3, "seconds": 0.3}
    sequential = sweep(workers.paced_trial, SPACE, max_evals=4, np=-1, seed=4,
                       fixed_params=fixed)
    seq_x = [c.data.params["x"] for c in _children(sequential.parent_run_id)]
    rule = MedianRule(min_trials=1)
    first = sweep(workers.paced_trial, SPACE, max_evals=4, np=-1, seed=4, parallelism=2,
                  fixed_params=fixed, prune=rule)
    children = _children(first.parent_run_id)
    assert [c.data.params["x"] for c in children] == seq_x
    assert [c.data.tags["mlflow_hvd.sweep.trial"] for c in children] == ["0", "1", "2", "3"]
    assert {c.info.status for c in children} == {"FINISHED"}
    pruned = [c for c in children if c.data.tags.get("mlflow_hvd.sweep.pruned_at_epoch")]
    assert first.pruned_trials == len(pruned) >= 1
    for c in pruned:  # stopped where the judge said, fewer epochs than planned
        at = int(c.data.tags["mlflow_hvd.sweep.pruned_at_epoch"])
        steps = [m.step for m in mlflow.MlflowClient().get_metric_history(
            c.info.run_id, "val_loss")]
        assert steps == list(range(at)) and at < 3
    resumed = sweep(workers.paced_trial, SPACE, max_evals=6, np=-1, seed=4, parallelism=2,
                    fixed_params=fixed, prune=rule, parent_run_id=first.parent_run_id)
    children = _children(first.parent_run_id)
    assert resumed.trials == 6 and len(children) == 6
    assert [c.data.tags["mlflow_hvd.sweep.trial"] for c in children] == [
        "0", "1", "2", "3", "4", "5"]
    finished = [c for c in children if not c.data.tags.get("mlflow_hvd.sweep.pruned_at_epoch")]
    best = min(finished, key=lambda c: c.data.metrics["val_loss"])
    assert resumed.best_run_id == best.info.run_id


@pytest.mark.parametrize("value", [0, -1, 1.5, "two", True])
def test_parallelism_must_be_a_positive_whole_number_or_auto(store: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match="parallelism must be a whole number >= 1"):
        sweep(workers.paced_trial, SPACE, max_evals=2, np=-1, parallelism=value)


@pytest.mark.ranks
def test_sigterm_stops_every_running_trial_and_leaves_no_rank(tmp_path: Path) -> None:
    """SIGTERM to the driver while two trials run: both runs and the parent end KILLED, and
    no rank process is left."""
    uri = f"sqlite:///{tmp_path}/sweep.db"
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "import mlflow, workers\n"
        "from hyperopt import hp\n"
        "from mlflow_hvd.sweep import sweep\n"
        f"mlflow.set_tracking_uri({uri!r})\n"
        "sweep(workers.paced_trial, {'x': hp.uniform('x', 0, 1)}, max_evals=4, np=-1,\n"
        "      parallelism=2, fixed_params={'epochs': 100, 'seconds': 1.0})\n")
    with Program([sys.executable, "-c", code], cwd=tmp_path, stderr=subprocess.STDOUT) as prog:
        prog.wait_for_line("[trial 0][0]<log>: epoch 1 done", 300)
        if not any("[trial 1][0]<log>: epoch 1" in ln for ln in prog.lines):
            prog.wait_for_line("[trial 1][0]<log>: epoch 1 done", 120)
        prog.proc.send_signal(signal.SIGTERM)
        assert prog.finish(120) != 0
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    statuses = {r.info.run_name: r.info.status for r in runs}
    assert statuses.get("sweep") == "KILLED", statuses
    trials = {k: v for k, v in statuses.items() if k.startswith("trial-")}
    assert len(trials) == 2 and set(trials.values()) == {"KILLED"}, statuses
    assert_no_workers_left()


@pytest.mark.parametrize(("text", "expected"), [("1", 1), ("2.0", 2), ("auto", "auto"),
                                                ("AUTO", "auto")])
def test_the_sweep_entry_points_parallelism(text: str, expected: Any) -> None:
    from mlflow_hvd.cli.sweep import parallelism_choice

    assert parallelism_choice(text) == expected


@pytest.mark.parametrize("text", ["0", "1.5", "two", "-2"])
def test_the_sweep_entry_point_refuses_other_parallelism(text: str) -> None:
    from mlflow_hvd.cli.sweep import parallelism_choice

    with pytest.raises(ConfigurationError, match="parallelism must be a whole number"):
        parallelism_choice(text)


@pytest.mark.slow
def test_a_failing_trial_frees_its_slot_and_the_others_go_on(
    store: str, tmp_path: Path
) -> None:
    """Two at a time, the first trial to run fails: it becomes a FAILED child, its slot
    takes the next point (on new ranks), and the sweep ends with every trial run."""
    marker = tmp_path / "failed-once"
    result = sweep(workers.quadratic_torch_trial,
                   {"x": SPACE["x"], "y": hp.choice("y", [0, 1])}, max_evals=4, np=-1,
                   parallelism=2, fixed_params={"fail_marker": str(marker)})
    assert marker.exists()
    assert (result.trials, result.failed_trials) == (4, 1)
    children = _children(result.parent_run_id)
    assert sorted(c.info.status for c in children) == ["FAILED", "FINISHED", "FINISHED",
                                                       "FINISHED"]
    assert result.best_run_id in {c.info.run_id for c in children
                                  if c.info.status == "FINISHED"}

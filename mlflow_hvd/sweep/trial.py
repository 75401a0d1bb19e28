"""Driver side: one trial of a sweep: its child run, the distributed job, its pruning judge
and the result hyperopt records."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mlflow_hvd.common.config import ClusterConfig, JobConfig, TrackingConfig
from mlflow_hvd.common.horovod_env import HorovodOptions
from mlflow_hvd.driver.feed import is_dataframe
from mlflow_hvd.errors import MlflowHvdError
from mlflow_hvd.runner import HorovodRunner, RunHooks
from mlflow_hvd.sweep.pruning import History, LiveHistory, Rule, TrialJudge
from mlflow_hvd.sweep.space import plain

TAG = "mlflow_hvd.sweep."

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """The validated arguments of one sweep."""

    train_fn: Callable[..., Any]
    space: dict[str, Any]
    max_evals: int
    np: int
    metric: str
    seed: int
    early_stop_rounds: int | None
    fixed: dict[str, Any]
    job: JobConfig
    cluster: ClusterConfig
    tracking: TrackingConfig
    horovod: HorovodOptions | None = None
    spark: Any = None  # the SparkSession given to sweep(), if any
    warm: bool = True
    rule: Rule | None = None
    sign: float = 1.0  # +1: the metric is minimised; -1: maximised (hyperopt's loss = -value)

    def runner(self) -> HorovodRunner:
        """A runner for this sweep's trials (the options are already checked)."""
        return HorovodRunner(np=self.np, spark=self.spark, job=self.job, cluster=self.cluster,
                             tracking=self.tracking, horovod=self.horovod)


@dataclass
class Notes:
    """What the sweep said once (not per trial)."""

    no_metric: bool = False
    ignored: bool = False


def run_trial(
    client: Any,
    index: int,
    params: dict[str, Any],
    plan: Plan,
    runner: HorovodRunner,
    done: list[dict[str, Any]] | None = None,
    notes: Notes | None = None,
    *,
    live: LiveHistory | None = None,
    parent_run_id: str | None = None,
) -> dict[str, Any]:
    """One trial as a child run: the distributed job, then its loss (hyperopt's result).

    ``done``: the results of the trials before it, which a pruning rule compares it with.
    """
    import mlflow
    from hyperopt import STATUS_FAIL, STATUS_OK

    values = {k: plain(v) for k, v in params.items()}
    run_params = {**trial_params(plan), **values}
    judge = _judge(plan, index, run_params, done, live)
    parent: Any = mlflow.active_run()
    start: dict[str, Any] = {"nested": True}
    if parent_run_id is not None:  # a trial's own thread: no active run there
        parent = client.get_run(parent_run_id)
        start = {"parent_run_id": parent_run_id,
                 "experiment_id": parent.info.experiment_id}
    with mlflow.start_run(run_name=f"trial-{index}", **start) as child:
        run_id = child.info.run_id
        client.set_tag(run_id, f"{TAG}trial", str(index))
        # every argument of the trial, not only the sampled ones: trials and plain runs of
        # the same function share one set of columns in the MLflow UI
        mlflow.log_params(run_params)
        t0 = time.monotonic()
        try:
            hooks = RunHooks(epoch_judge=judge, log_prefix=f"[trial {index}]",
                             dataset_runs=(parent.info.run_id,) if parent else ())
            runner.run_with(hooks, plan.train_fn, **values, **plan.fixed)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM, or the sweep stopping every trial
            mlflow.end_run("KILLED")
            raise
        except MlflowHvdError as exc:
            mlflow.end_run("FAILED")
            return {"status": STATUS_FAIL, "error": str(exc).splitlines()[0], "run_id": run_id,
                    **_judged(judge, index, plan, None)}  # a failure: nothing to say of it
        wall = time.monotonic() - t0
        history = client.get_metric_history(run_id, plan.metric)
        if not history:
            mlflow.end_run("FAILED")
            return {
                "status": STATUS_FAIL,
                "run_id": run_id,
                "error": f"the trial logged no value of the metric {plan.metric!r}",
            }
        value = float(max(history, key=lambda m: (m.step, m.timestamp)).value)
        judged = _judged(judge, index, plan, notes)
        if judged.get("pruned_at_epoch"):
            client.set_tag(run_id, f"{TAG}pruned_at_epoch", str(judged["pruned_at_epoch"]))
        mlflow.log_metric("trial_wall_seconds", wall)
        return {"status": STATUS_OK, "loss": plan.sign * value, "value": value,
                "run_id": run_id, **judged}


def _judge(plan: Plan, index: int, run_params: Mapping[str, Any],
           done: list[dict[str, Any]] | None, live: LiveHistory | None) -> TrialJudge | None:
    """The trial's pruning judge: against the trials before it, or (concurrent trials,
    ``live``) against the others as they go on."""
    if plan.rule is None:
        return None
    if live is not None:
        return TrialJudge(plan.rule, lambda: live.without(index), plan.metric, plan.sign,
                          _planned_epochs(run_params), lambda raw: live.report(index, raw))
    return TrialJudge(plan.rule, History.from_results(done or [], plan.sign), plan.metric,
                      plan.sign, _planned_epochs(run_params))


def _judged(judge: TrialJudge | None, index: int, plan: Plan,
            notes: Notes | None) -> dict[str, Any]:
    """What the trial's pruning judge saw, for its hyperopt result; says once per sweep
    (``notes``) when a trial gave the judge nothing to work with or trained on past a
    stop."""
    if judge is None:
        return {}
    outcome = judge.outcome()
    notes = notes or Notes(no_metric=True, ignored=True)  # None: say nothing
    if not outcome.curve and not notes.no_metric:
        notes.no_metric = True
        log.warning(
            "mlflow_hvd: sweep prune=%r: trial %d logged no value of %r with a step, so it "
            "cannot be pruned (nor any trial like it): log it per epoch with MlflowCallback "
            "or mlflow_hvd.tracking.log_metrics({%r: value}, step=epoch)",
            plan.rule.name if plan.rule else None, index, plan.metric, plan.metric)
    if outcome.ignored_at_epoch and not notes.ignored:
        notes.ignored = True
        log.warning(
            "mlflow_hvd: trial %d was to stop after epoch %d but trained on: call "
            "mlflow_hvd.tracking.should_prune() on every rank after each epoch's metrics "
            "are logged and leave the loop when it returns True (MlflowCallback does)",
            index, outcome.ignored_at_epoch)
    return {"curve": list(outcome.curve), "pruned_at_epoch": outcome.pruned_at_epoch,
            "planned_epochs": judge.max_epochs}


def _planned_epochs(run_params: Mapping[str, Any]) -> int | None:
    """How many epochs the trial is set to train: its ``epochs`` argument, if it has one."""
    epochs = run_params.get("epochs")
    return epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else None


def trial_params(plan: Plan) -> dict[str, Any]:
    """``np``, the fixed params and the training function's defaults that are plain values
    (what the trial runs with besides the sampled params)."""
    import inspect

    out: dict[str, Any] = {"np": plan.np}
    try:
        signature = inspect.signature(plan.train_fn)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        for name, p in signature.parameters.items():
            if isinstance(p.default, bool | int | float | str):
                out[name] = p.default
    # a DataFrame is recorded as a dataset input, not a param
    out.update({k: plain(v) for k, v in plan.fixed.items() if not is_dataframe(v)})
    return out

"""Driver side: the sweep loop, one HorovodRunner job per trial, one trial after another.

Every trial is a full distributed run and a child MLflow run (``mlflow.parentRunId``) of the
sweep's parent run; the SparkSession is reused across trials. Hyperopt's ``Trials`` are
saved in the parent run after every trial, so running the sweep again against the same
parent run continues after the last finished trial.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlflow_hvd.common import config
from mlflow_hvd.common.config import ClusterConfig, JobConfig, TrackingConfig
from mlflow_hvd.common.horovod_env import HorovodOptions
from mlflow_hvd.common.options import check_np, check_positive_int
from mlflow_hvd.driver.payload import check_call
from mlflow_hvd.driver.signals import sigterm_interrupts
from mlflow_hvd.driver.tracking.run import store_lock
from mlflow_hvd.errors import ConfigurationError, MlflowHvdError
from mlflow_hvd.runner import HorovodRunner
from mlflow_hvd.sweep.loop import check_parallelism, resolve_parallelism, run_trials
from mlflow_hvd.sweep.plot import plot_losses
from mlflow_hvd.sweep.pruning import Rule, describe, make_rule
from mlflow_hvd.sweep.registry import check_name, check_registry, register_best
from mlflow_hvd.sweep.space import plain, validate_space
from mlflow_hvd.sweep.trial import TAG, Plan
from mlflow_hvd.sweep.trials_store import load_trials

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepResult:
    """What a sweep found.

    Attributes:
        parent_run_id: The sweep's MLflow run.
        best_params: Sampled params of the best trial (real Python types).
        best_loss: Its value of the sweep's metric (the lowest, or the highest when the
            metric is maximised), from the trials that were not pruned.
        best_run_id: The best trial's child run.
        trials: Number of trials in the sweep (including resumed ones).
        failed_trials: How many of them failed.
        losses: The metric's last value in every trial, in order; None for failed ones.
        pruned_trials: How many trials were pruned.
        epochs_trained: Epochs trained by all trials (as reported per epoch; 0 without
            pruning, which does not count them).
        epochs_saved: Epochs the pruned trials did not train.
        registered_version: With ``register_model``: the version of the registered model
            that holds the best trial's model; None without it.
        registered_uri: ``models:/name@champion`` when the alias points at that version.
    """

    parent_run_id: str
    best_params: dict[str, Any]
    best_loss: float
    best_run_id: str
    trials: int
    failed_trials: int
    losses: tuple[float | None, ...] = field(default=())
    pruned_trials: int = 0
    epochs_trained: int = 0
    epochs_saved: int = 0
    registered_version: str | None = None
    registered_uri: str | None = None


def sweep(
    train_fn: Callable[..., Any],
    space: Mapping[str, Any],
    *,
    max_evals: int,
    np: int,
    metric: str = "val_loss",
    seed: int = 0,
    early_stop_rounds: int | None = None,
    parent_run_id: str | None = None,
    fixed_params: Mapping[str, Any] | None = None,
    warm: bool = True,
    prune: str | Rule | None = None,
    grace_epochs: int = 1,
    mode: str | None = None,
    register_model: str | None = None,
    parallelism: int | str = 1,
    spark: Any = None,
    job: JobConfig | None = None,
    cluster: ClusterConfig | None = None,
    tracking: TrackingConfig | None = None,
    horovod: HorovodOptions | None = None,
    **misplaced: Any,
) -> SweepResult:
    """Optimise ``metric`` over ``space`` with TPE, one distributed trial at a time.

    Each trial calls ``HorovodRunner(np=np, spark=spark, job=job, cluster=cluster,
    tracking=tracking, horovod=horovod).run(train_fn, **params, **fixed_params)`` inside a
    child MLflow run; its result is the last value of ``metric``
    that rank 0 logged there (hyperopt's loss: that value, or minus it when maximising). A
    trial whose ranks fail becomes a FAILED child run and a ``STATUS_FAIL`` trial; the
    sweep goes on. Ctrl-C marks the trial and the parent KILLED.

    With ``prune``, rank 0 reports ``metric`` to the driver each time it is logged with a
    step (``MlflowCallback``, ``tracking.log_metrics(..., step=epoch)``); after each epoch
    the driver compares the trial with the earlier ones and may stop it there: every rank
    leaves training after that epoch (``MlflowCallback``, or ``tracking.should_prune()`` in
    a custom loop), the child run ends FINISHED with the tag
    ``mlflow_hvd.sweep.pruned_at_epoch``, and its loss is the metric's value at that epoch.

    With ``warm`` (default) the trials share one set of ranks (``with HorovodRunner``):
    each trial after the first starts in under a second instead of paying for new
    processes and imports; a failed trial's ranks are replaced. ``warm=False`` starts
    fresh processes for every trial (for training code that leaves global state behind).

    Args:
        max_evals: Total trials, including those of a resumed sweep.
        seed: Same seed, same sequence of sampled params.
        early_stop_rounds: Stop after this many trials without a new best loss (the rule
            of hyperopt's ``no_progress_loss``); None: run all ``max_evals``.
        parent_run_id: Resume this sweep run (its saved trials are not repeated). Default:
            the active run, else a new parent run.
        prune: ``"median"`` (stop a trial whose best value so far is worse than the median of
            the earlier trials' values at the same epoch, once 3 trials finished), ``"asha"``
            (successive halving, rungs at ``grace_epochs * 3**k``: past a rung only the top
            third by the value at the rung), a :class:`~mlflow_hvd.sweep.MedianRule` /
            :class:`~mlflow_hvd.sweep.AshaRule` with other settings, or None (every trial
            trains to its end).
        grace_epochs: Epochs every trial trains before it can be pruned.
        mode: ``"min"`` or ``"max"``; default: ``"max"`` when the metric's name says
            accuracy, AUC, precision, recall, F1, R2 or score, else ``"min"``.
        parallelism: Trials at once (default 1: one after another). Each runs as its own
            barrier stage of ``np`` tasks in the sweep's Spark application (``np < 0``: on
            the driver), on its own warm ranks; hyperopt suggests a new point as each trial
            ends, with the running ones known to TPE. ``"auto"``: as many as the cluster's
            task slots hold (``slots // np``; ``np < 0``: the driver's cores // -np); a
            number whose trials would need more slots than the cluster has is refused
            before the first trial. With pruning, a trial is judged against the trials
            that ended and the epochs the running ones reached.
        register_model: Register the best trial's model (the last one its rank 0 logged)
            as a new version of this registered model, with the alias ``champion`` and tags
            naming the sweep run and the metric's value. Checked before the first trial:
            the store must have a Model Registry and the user may update this model
            (created when missing). A resumed sweep whose best trial already has a version
            leaves the alias where it is.
        spark: The SparkSession every trial's ``HorovodRunner`` uses (classic or Spark
            Connect; None: the active one, else one the runner builds).
        job: Every trial's :class:`~mlflow_hvd.JobConfig`.
        cluster: Every trial's :class:`~mlflow_hvd.ClusterConfig`.
        tracking: Every trial's :class:`~mlflow_hvd.TrackingConfig`.
        horovod: Every trial's :class:`~mlflow_hvd.HorovodOptions`. Any other keyword is
            refused naming the group it belongs to.

    Raises:
        ConfigurationError: Bad space, max_evals, metric, mode, prune, np, option group
            or register_model, before any trial starts.
        TrackingError: The parent run has saved trials that cannot be read; the registry
            cannot be used or refuses the user (before any trial); the best trial logged no
            model (after the sweep, which a resume then registers).
        MlflowHvdError: Every trial failed.
    """

    if misplaced:
        raise ConfigurationError(config.misplaced(next(iter(misplaced)), "sweep"))
    groups = Groups(
        config.group_argument(job, JobConfig, "job"),
        config.group_argument(cluster, ClusterConfig, "cluster"),
        config.group_argument(tracking, TrackingConfig, "tracking"),
        horovod,
    )
    plan = _validate(train_fn, space, max_evals, np, metric, seed, early_stop_rounds,
                     fixed_params, groups, spark, warm, prune, grace_epochs, mode)
    runner = plan.runner()  # checks np and the options now, before anything starts
    model_name = None if register_model is None else check_name(register_model)
    at_once = check_parallelism(parallelism)
    with sigterm_interrupts():  # SIGTERM ends the sweep and its trials KILLED, like Ctrl-C
        return _sweep(plan, runner, parent_run_id, model_name, at_once)


@dataclass(frozen=True)
class Groups:
    """The runner's option groups as sweep() was given them (checked)."""

    job: JobConfig
    cluster: ClusterConfig
    tracking: TrackingConfig
    horovod: HorovodOptions | None


def _sweep(plan: Plan, runner: HorovodRunner, parent_run_id: str | None,
           model_name: str | None = None, parallelism: int | str = 1) -> SweepResult:
    import mlflow

    client = mlflow.MlflowClient()
    if model_name is not None:
        check_registry(client, model_name)  # refused before any run or rank starts
    runner.prepare()  # a new SparkSession boots while the parent run is set up
    with store_lock(mlflow.get_tracking_uri()):
        owned = mlflow.active_run() is None
        name = None if parent_run_id else "sweep"  # a new parent run; a resumed one keeps its
        parent = mlflow.start_run(run_id=parent_run_id, run_name=name) if owned else (
            mlflow.active_run())
    parent_id = parent.info.run_id  # type: ignore[union-attr]
    try:
        saved = load_trials(client, parent_id)
        _describe_parent(client, parent_id, plan)
        with runner if plan.warm else contextlib.nullcontext(runner):
            at_once = resolve_parallelism(parallelism, plan.np, runner, plan.max_evals - (
                len(saved.trials) if saved is not None else 0))
            _log_params_once(client, parent_id, {"parallelism": at_once})
            trials = run_trials(client, parent_id, saved, plan, runner, at_once)
        result = _summarise(client, parent_id, trials, plan)
        if model_name is not None:
            result = _register(client, model_name, result, plan)
    except KeyboardInterrupt:
        active = mlflow.active_run()
        while active is not None and active.info.run_id != parent_id:
            mlflow.end_run("KILLED")  # the interrupted trial's child run
            active = mlflow.active_run()
        if owned:
            mlflow.end_run("KILLED")
        raise
    except BaseException:
        if owned:
            mlflow.end_run("FAILED")
        raise
    if owned:
        mlflow.end_run("FINISHED")
    return result


def _validate(
    train_fn: Callable[..., Any],
    space: Mapping[str, Any],
    max_evals: int,
    np: int,
    metric: str,
    seed: int,
    early_stop_rounds: int | None,
    fixed_params: Mapping[str, Any] | None,
    groups: Groups,
    spark: Any = None,
    warm: bool = True,
    prune: str | Rule | None = None,
    grace_epochs: int = 1,
    mode: str | None = None,
) -> Plan:
    check_positive_int("max_evals", max_evals)
    if early_stop_rounds is not None:
        check_positive_int("early_stop_rounds", early_stop_rounds)
    if not metric or not isinstance(metric, str):
        raise ConfigurationError("metric must name the metric to optimise, e.g. 'val_loss'")
    sign = -1.0 if direction(metric, mode) == "max" else 1.0
    rule = make_rule(prune, grace_epochs)
    validate_space(space, seed)
    check_np(np)
    # every trial calls train_fn(**sampled, **fixed): a name it does not take fails now
    check_call(train_fn, {**dict.fromkeys(space), **dict(fixed_params or {})})
    return Plan(
        train_fn,
        dict(space),
        max_evals,
        np,
        metric,
        seed,
        early_stop_rounds,
        dict(fixed_params or {}),
        groups.job,
        groups.cluster,
        groups.tracking,
        groups.horovod,
        spark,
        bool(warm),
        rule,
        sign,
    )


MAXIMISED = ("acc", "auc", "precision", "recall", "f1", "r2", "score")


def direction(metric: str, mode: str | None) -> str:
    """``mode`` if given ("min" or "max"), else "max" for a name that says accuracy, AUC,
    precision, recall, F1, R2 or score (and not loss or error), else "min"."""
    if mode is not None:
        if mode not in ("min", "max"):
            raise ConfigurationError(f"mode must be 'min', 'max' or None, got {mode!r}")
        return mode
    name = metric.lower()
    if "loss" in name or "error" in name:
        return "min"
    return "max" if any(word in name for word in MAXIMISED) else "min"


def _describe_parent(client: Any, parent_id: str, plan: Plan) -> None:
    client.set_tag(parent_id, f"{TAG}role", "parent")
    _log_params_once(
        client,
        parent_id,
        {
            "max_evals": plan.max_evals,
            "np": plan.np,
            "metric": plan.metric,
            "seed": plan.seed,
            "algo": "tpe",
            "early_stop_rounds": plan.early_stop_rounds,
            "mode": "max" if plan.sign < 0 else "min",
            **describe(plan.rule),
        },
    )
    client.log_text(
        parent_id,
        json.dumps({k: str(v) for k, v in plan.space.items()}, indent=2),
        "search_space.json",
    )


def _log_params_once(client: Any, run_id: str, params: Mapping[str, Any]) -> None:
    existing = client.get_run(run_id).data.params
    for key, value in params.items():
        if key not in existing:
            client.log_param(run_id, key, str(value))


def _register(client: Any, name: str, result: SweepResult, plan: Plan) -> SweepResult:
    done = register_best(client, name, result.best_run_id, result.parent_run_id, plan.metric,
                         result.best_loss)
    client.set_tag(result.parent_run_id, f"{TAG}registered_model", f"{name}/{done.version}")
    return dataclasses.replace(result, registered_version=done.version,
                               registered_uri=done.model_uri)


def _summarise(client: Any, parent_id: str, trials: Any, plan: Plan) -> SweepResult:
    from hyperopt import STATUS_OK, space_eval

    ok = [
        (t, r)
        for t, r in zip(trials.trials, trials.results, strict=True)
        if r.get("status") == STATUS_OK
    ]
    results = trials.results
    values = tuple(_value(r, plan) for r in results)
    pruned = [r for r in results if r.get("pruned_at_epoch")]
    failed = len(results) - len(ok)
    plot_losses(client, parent_id, values, plan.metric,
                tuple(bool(r.get("pruned_at_epoch")) for r in results), plan.sign < 0)
    if plan.rule is not None:
        trained, saved = _epochs(results)
        client.log_metric(parent_id, "trials_pruned", len(pruned))
        client.log_metric(parent_id, "epochs_trained", trained)
        client.log_metric(parent_id, "epochs_saved", saved)
    else:
        trained = saved = 0
    if not ok:
        client.set_tag(parent_id, f"{TAG}best_run_id", "")
        raise MlflowHvdError(f"all {len(results)} trials failed; see the child runs")
    # the best of the trials that trained to their end (a pruned trial's value is from an
    # earlier epoch); of the pruned ones only if none did
    candidates = [tr for tr in ok if not tr[1].get("pruned_at_epoch")] or ok
    best_trial, best = min(candidates, key=lambda tr: tr[1]["loss"])
    vals = {k: v[0] for k, v in best_trial["misc"]["vals"].items() if v}
    best_params = {k: plain(v) for k, v in space_eval(plan.space, vals).items()}
    best_value = _value(best, plan)
    assert best_value is not None  # an ok trial has a loss
    _log_params_once(client, parent_id, {f"best_{k}": v for k, v in best_params.items()})
    client.log_metric(parent_id, f"best_{plan.metric}", best_value)
    client.set_tag(parent_id, f"{TAG}best_run_id", best["run_id"])
    client.set_tag(parent_id, f"{TAG}failed_trials", str(failed))
    return SweepResult(
        parent_id,
        best_params,
        best_value,
        best["run_id"],
        len(results),
        failed,
        values,
        len(pruned),
        trained,
        saved,
    )


def _value(result: Mapping[str, Any], plan: Plan) -> float | None:
    """The trial's value of the metric (hyperopt's loss is minus it when maximising)."""
    if "value" in result:
        return float(result["value"])
    loss = result.get("loss")
    return None if loss is None else plan.sign * float(loss)


def _epochs(results: list[dict[str, Any]]) -> tuple[int, int]:
    """Epochs trained by all trials, and epochs the pruned ones did not train (each up to
    its ``epochs`` argument, else up to the longest trial that was not pruned)."""
    trained = sum(len(r.get("curve") or ()) for r in results)
    longest = max((len(r.get("curve") or ()) for r in results
                   if not r.get("pruned_at_epoch")), default=0)
    saved = 0
    for r in results:
        k = r.get("pruned_at_epoch")
        if k:
            saved += max(0, (r.get("planned_epochs") or longest) - k)
    return trained, saved

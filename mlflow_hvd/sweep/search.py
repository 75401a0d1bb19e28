"""The sweep loop: one HorovodRunner job per trial, one trial after another (driver side).

Every trial is a full distributed run and a child MLflow run (``mlflow.parentRunId``) of the
sweep's parent run; the SparkSession is reused across trials. Hyperopt's ``Trials`` are
saved in the parent run after every trial, so running the sweep again against the same
parent run continues after the last finished trial.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlflow_hvd.common.options import check_positive_int
from mlflow_hvd.driver.signals import sigterm_interrupts
from mlflow_hvd.driver.tracking.run import store_lock
from mlflow_hvd.errors import ConfigurationError, MlflowHvdError
from mlflow_hvd.runner import HorovodRunner
from mlflow_hvd.sweep.plot import plot_losses
from mlflow_hvd.sweep.space import plain, validate_space
from mlflow_hvd.sweep.trials_store import load_trials, save_trials

TAG = "mlflow_hvd.sweep."

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepResult:
    """Outcome of a sweep.

    Attributes:
        parent_run_id: The sweep's MLflow run.
        best_params: Sampled params of the best trial (real Python types).
        best_loss: Its loss (value of the named metric).
        best_run_id: The best trial's child run.
        trials: Number of trials in the sweep (including resumed ones).
        failed_trials: How many of them failed.
        losses: Loss of every trial in order, None for failed ones.
    """

    parent_run_id: str
    best_params: dict[str, Any]
    best_loss: float
    best_run_id: str
    trials: int
    failed_trials: int
    losses: tuple[float | None, ...] = field(default=())


@dataclass(frozen=True)
class _Plan:
    """The validated arguments of one sweep."""

    train_fn: Callable[..., Any]
    space: dict[str, Any]
    max_evals: int
    np: int
    metric: str
    seed: int
    early_stop_rounds: int | None
    fixed: dict[str, Any]
    runner_options: dict[str, Any]
    warm: bool = True


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
    runner_options: Mapping[str, Any] | None = None,
    warm: bool = True,
) -> SweepResult:
    """Minimise ``metric`` over ``space`` with TPE, one distributed trial at a time.

    Each trial calls ``HorovodRunner(np=np, **runner_options).run(train_fn, **params,
    **fixed_params)`` inside a child MLflow run; its loss is the last value of ``metric``
    that rank 0 logged there. A trial whose ranks fail becomes a FAILED child run and a
    ``STATUS_FAIL`` trial; the sweep goes on. Ctrl-C marks the trial and the parent KILLED.

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

    Raises:
        ConfigurationError: Bad space, max_evals, metric or np, before any trial starts.
        TrackingError: The parent run has saved trials that cannot be read.
        MlflowHvdError: Every trial failed.
    """

    plan = _validate(
        train_fn,
        space,
        max_evals,
        np,
        metric,
        seed,
        early_stop_rounds,
        fixed_params,
        runner_options,
        warm,
    )
    with sigterm_interrupts():  # SIGTERM ends the sweep and its trial KILLED, like Ctrl-C
        return _sweep(plan, parent_run_id)


def _sweep(plan: _Plan, parent_run_id: str | None) -> SweepResult:
    import mlflow

    runner = HorovodRunner(np=plan.np, **plan.runner_options)
    runner.prepare()  # a new SparkSession boots while the parent run is set up
    client = mlflow.MlflowClient()
    with store_lock(mlflow.get_tracking_uri()):
        owned = mlflow.active_run() is None
        parent = mlflow.start_run(run_id=parent_run_id) if owned else mlflow.active_run()
    parent_id = parent.info.run_id  # type: ignore[union-attr]
    try:
        from hyperopt import Trials

        trials = load_trials(client, parent_id) or Trials()
        _describe_parent(client, parent_id, plan)
        with runner if plan.warm else contextlib.nullcontext(runner):
            _run_trials(client, parent_id, trials, plan, runner)
        result = _summarise(client, parent_id, trials, plan)
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
    runner_options: Mapping[str, Any] | None,
    warm: bool = True,
) -> _Plan:
    check_positive_int("max_evals", max_evals)
    if early_stop_rounds is not None:
        check_positive_int("early_stop_rounds", early_stop_rounds)
    if not metric:
        raise ConfigurationError("metric must name the metric to minimise, e.g. 'val_loss'")
    validate_space(space, seed)
    HorovodRunner(np=np, **dict(runner_options or {}))  # validates np and options now
    return _Plan(
        train_fn,
        dict(space),
        max_evals,
        np,
        metric,
        seed,
        early_stop_rounds,
        dict(fixed_params or {}),
        dict(runner_options or {}),
        bool(warm),
    )


def _describe_parent(client: Any, parent_id: str, plan: _Plan) -> None:
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
        },
    )
    client.log_text(
        parent_id,
        json.dumps({k: str(v) for k, v in plan.space.items()}, indent=2),
        "search_space.json",
    )


def _run_trials(
    client: Any, parent_id: str, trials: Any, plan: _Plan, runner: HorovodRunner
) -> None:
    """Run the remaining trials, saving the history after each one."""
    import numpy
    from hyperopt import fmin, tpe
    from hyperopt.exceptions import AllTrialsFailed

    def objective(params: dict[str, Any]) -> dict[str, Any]:
        return run_trial(client, len(trials.trials) - 1, params, plan, runner)

    for n in range(len(trials.trials) + 1, plan.max_evals + 1):
        # One evaluation per call, with an rng that depends only on (seed, n): the same
        # seed gives the same params whether or not the sweep was interrupted.
        try:
            fmin(
                objective,
                plan.space,
                algo=tpe.suggest,
                max_evals=n,
                trials=trials,
                rstate=numpy.random.default_rng(plan.seed + n),
                show_progressbar=False,
                return_argmin=False,
            )
        except AllTrialsFailed:
            # fmin's closing argmin found no successful trial yet; every trial is recorded
            # in `trials` (and saved below): the sweep goes on
            log.debug("sweep %s: no successful trial after %d", parent_id, n)
        save_trials(client, parent_id, trials)
        if plan.early_stop_rounds and no_progress(trials.results, plan.early_stop_rounds):
            client.set_tag(parent_id, f"{TAG}early_stopped", f"after {n} trials")
            return


def run_trial(
    client: Any, index: int, params: dict[str, Any], plan: _Plan, runner: HorovodRunner
) -> dict[str, Any]:
    """One trial as a child run: the distributed job, then its loss (hyperopt's result)."""
    import mlflow
    from hyperopt import STATUS_FAIL, STATUS_OK

    values = {k: plain(v) for k, v in params.items()}
    with mlflow.start_run(nested=True, run_name=f"trial-{index}") as child:
        run_id = child.info.run_id
        client.set_tag(run_id, f"{TAG}trial", str(index))
        # every argument of the trial, not only the sampled ones: trials and plain runs of
        # the same function share one set of columns in the MLflow UI
        mlflow.log_params({**trial_params(plan), **values})
        t0 = time.monotonic()
        try:
            runner.log_prefix = f"[trial {index}]"
            runner.run(plan.train_fn, **values, **plan.fixed)
        except MlflowHvdError as exc:
            mlflow.end_run("FAILED")
            return {"status": STATUS_FAIL, "error": str(exc).splitlines()[0], "run_id": run_id}
        wall = time.monotonic() - t0
        history = client.get_metric_history(run_id, plan.metric)
        if not history:
            mlflow.end_run("FAILED")
            return {
                "status": STATUS_FAIL,
                "run_id": run_id,
                "error": f"the trial logged no metric {plan.metric!r} to minimise",
            }
        loss = float(max(history, key=lambda m: (m.step, m.timestamp)).value)
        mlflow.log_metric("trial_wall_seconds", wall)
        return {"status": STATUS_OK, "loss": loss, "run_id": run_id}


def trial_params(plan: _Plan) -> dict[str, Any]:
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
    out.update({k: plain(v) for k, v in plan.fixed.items()})
    return out


def no_progress(results: list[dict[str, Any]], rounds: int) -> bool:
    """hyperopt's ``no_progress_loss`` rule (no new best loss for ``rounds`` trials), as a
    pure function of the trial history so that it holds across a resume, and with failed
    trials counted as no progress (hyperopt's own raises on them)."""
    losses = [r.get("loss") for r in results]
    best_at = None
    best = math.inf
    for i, loss in enumerate(losses):
        if loss is not None and loss < best:
            best, best_at = loss, i
    return best_at is not None and len(losses) - 1 - best_at >= rounds


def _log_params_once(client: Any, run_id: str, params: Mapping[str, Any]) -> None:
    existing = client.get_run(run_id).data.params
    for key, value in params.items():
        if key not in existing:
            client.log_param(run_id, key, str(value))


def _summarise(client: Any, parent_id: str, trials: Any, plan: _Plan) -> SweepResult:
    from hyperopt import STATUS_OK, space_eval

    ok = [
        (t, r)
        for t, r in zip(trials.trials, trials.results, strict=True)
        if r.get("status") == STATUS_OK
    ]
    losses = tuple(r.get("loss") for r in trials.results)
    failed = len(trials.results) - len(ok)
    plot_losses(client, parent_id, losses, plan.metric)
    if not ok:
        client.set_tag(parent_id, f"{TAG}best_run_id", "")
        raise MlflowHvdError(f"all {len(trials.results)} trials failed; see the child runs")
    best_trial, best = min(ok, key=lambda tr: tr[1]["loss"])
    vals = {k: v[0] for k, v in best_trial["misc"]["vals"].items() if v}
    best_params = {k: plain(v) for k, v in space_eval(plan.space, vals).items()}
    _log_params_once(client, parent_id, {f"best_{k}": v for k, v in best_params.items()})
    client.log_metric(parent_id, f"best_{plan.metric}", best["loss"])
    client.set_tag(parent_id, f"{TAG}best_run_id", best["run_id"])
    client.set_tag(parent_id, f"{TAG}failed_trials", str(failed))
    return SweepResult(
        parent_id,
        best_params,
        float(best["loss"]),
        best["run_id"],
        len(trials.results),
        failed,
        losses,
    )

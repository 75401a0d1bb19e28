"""Hyperopt sweep of distributed trials: one HorovodRunner job per trial, one after another.

Every trial is a full distributed run and a child MLflow run (``mlflow.parentRunId``) of the
sweep's parent run; the SparkSession is reused across trials. Hyperopt's ``Trials`` are
saved in the parent run after every trial (``hyperopt/trials.pkl``), so running the sweep
again against the same parent run continues after the last finished trial.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlflow_hvd.errors import ConfigurationError, MlflowHvdError
from mlflow_hvd.runner import HorovodRunner

TRIALS_ARTIFACT = "hyperopt/trials.pkl"
TAG = "mlflow_hvd.sweep."


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
    """

    parent_run_id: str
    best_params: dict[str, Any]
    best_loss: float
    best_run_id: str
    trials: int
    failed_trials: int
    losses: tuple[float | None, ...] = field(default=())


def validate_space(space: Mapping[str, Any], seed: int = 0) -> None:
    """Check the search space can be sampled before any trial starts.

    Raises:
        ConfigurationError: Not a non-empty mapping of names to hyperopt expressions (or
            constants), or sampling it fails; the message names the culprit.
    """
    from hyperopt.pyll import stochastic

    if not isinstance(space, Mapping) or not space:
        raise ConfigurationError(
            "space must be a non-empty dict of parameter names to hyperopt expressions, e.g. "
            "{'learning_rate': hp.loguniform('learning_rate', -7, -2)}; got "
            f"{type(space).__name__}"
        )
    for name, expr in space.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"space keys must be non-empty strings, got {name!r}")
        try:
            stochastic.sample(expr, rng=__import__("numpy").random.default_rng(seed))
        except Exception as exc:
            raise ConfigurationError(
                f"space[{name!r}] cannot be sampled: {type(exc).__name__}: {exc}"
            ) from exc


def space_from_json(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Build a hyperopt space from a JSON-able description.

    ``{"learning_rate": ["loguniform", -7, -2], "batch_size": ["choice", [16, 32, 64]],
    "epochs": ["quniform", 2, 6, 1]}``: each value is ``[hp function name, *arguments]``.
    ``quniform``/``qloguniform`` values that are whole numbers become ints.
    """
    from hyperopt import hp

    allowed = {"uniform", "loguniform", "quniform", "qloguniform", "normal", "choice",
               "randint"}
    space: dict[str, Any] = {}
    for name, desc in spec.items():
        if not isinstance(desc, list | tuple) or not desc or desc[0] not in allowed:
            raise ConfigurationError(
                f"search space entry {name!r} must be [kind, *args] with kind one of "
                f"{sorted(allowed)}, got {desc!r}"
            )
        kind, *args = desc
        try:
            space[name] = getattr(hp, kind)(name, *args)
        except Exception as exc:
            raise ConfigurationError(f"search space entry {name!r}: {exc}") from exc
    validate_space(space)
    return space


def _plain(value: Any) -> Any:
    """numpy scalars to Python; whole-number floats from q-distributions to int."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


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
) -> SweepResult:
    """Minimise ``metric`` over ``space`` with TPE, one distributed trial at a time.

    Each trial calls ``HorovodRunner(np=np, **runner_options).run(train_fn, **params,
    **fixed_params)`` inside a child MLflow run; its loss is the last value of ``metric``
    that rank 0 logged there. A trial whose ranks fail becomes a FAILED child run and a
    ``STATUS_FAIL`` trial; the sweep goes on. Ctrl-C marks the trial and the parent KILLED.

    Args:
        max_evals: Total trials, including those of a resumed sweep.
        seed: Same seed, same sequence of sampled params.
        early_stop_rounds: Stop after this many trials without a new best loss (the rule
            of hyperopt's ``no_progress_loss``); None: run all ``max_evals``.
        parent_run_id: Resume this sweep run (its saved trials are not repeated). Default:
            the active run, else a new parent run.

    Raises:
        ConfigurationError: Bad space, max_evals, metric or np, before any trial starts.
    """
    import mlflow
    import numpy
    from hyperopt import STATUS_FAIL, STATUS_OK, Trials, fmin, space_eval, tpe
    from hyperopt.exceptions import AllTrialsFailed

    if isinstance(max_evals, bool) or not isinstance(max_evals, int) or max_evals < 1:
        raise ConfigurationError(f"max_evals must be a positive int, got {max_evals!r}")
    if early_stop_rounds is not None and early_stop_rounds < 1:
        raise ConfigurationError(f"early_stop_rounds must be >= 1, got {early_stop_rounds}")
    if not metric:
        raise ConfigurationError("metric must name the metric to minimise, e.g. 'val_loss'")
    validate_space(space, seed)
    HorovodRunner(np=np, **dict(runner_options or {}))  # validates np and options now
    fixed = dict(fixed_params or {})
    client = mlflow.MlflowClient()

    owned = mlflow.active_run() is None
    parent = mlflow.start_run(run_id=parent_run_id) if owned else mlflow.active_run()
    assert parent is not None
    parent_id = parent.info.run_id
    trials = _load_trials(client, parent_id) or Trials()
    done_before = len(trials.trials)
    try:
        client.set_tag(parent_id, f"{TAG}role", "parent")
        _log_params_once(client, parent_id, {
            "max_evals": max_evals, "np": np, "metric": metric, "seed": seed,
            "algo": "tpe", "early_stop_rounds": early_stop_rounds,
        })
        client.log_text(parent_id, json.dumps({k: str(v) for k, v in space.items()}, indent=2),
                        "search_space.json")

        def objective(params: dict[str, Any]) -> dict[str, Any]:
            values = {k: _plain(v) for k, v in params.items()}
            index = len(trials.trials) - 1
            with mlflow.start_run(nested=True, run_name=f"trial-{index}") as child:
                client.set_tag(child.info.run_id, f"{TAG}trial", str(index))
                mlflow.log_params(values)
                t0 = time.monotonic()
                try:
                    HorovodRunner(np=np, **dict(runner_options or {})).run(
                        train_fn, **values, **fixed
                    )
                except MlflowHvdError as exc:
                    mlflow.end_run("FAILED")
                    return {"status": STATUS_FAIL, "error": str(exc).splitlines()[0],
                            "run_id": child.info.run_id}
                wall = time.monotonic() - t0
                history = client.get_metric_history(child.info.run_id, metric)
                if not history:
                    mlflow.end_run("FAILED")
                    return {"status": STATUS_FAIL, "run_id": child.info.run_id,
                            "error": f"the trial logged no metric {metric!r} to minimise"}
                loss = float(max(history, key=lambda m: (m.step, m.timestamp)).value)
                mlflow.log_metric("trial_wall_seconds", wall)
                return {"status": STATUS_OK, "loss": loss, "run_id": child.info.run_id}

        for n in range(done_before + 1, max_evals + 1):
            # One evaluation per call, with an rng that depends only on (seed, n): the same
            # seed gives the same params whether or not the sweep was interrupted.
            try:
                fmin(objective, dict(space), algo=tpe.suggest, max_evals=n, trials=trials,
                     rstate=numpy.random.default_rng(seed + n), show_progressbar=False,
                     return_argmin=False)
            except AllTrialsFailed:
                pass  # fmin's closing argmin has no successful trial yet: the sweep goes on
            _save_trials(client, parent_id, trials)
            if early_stop_rounds and _no_progress(trials, early_stop_rounds):
                client.set_tag(parent_id, f"{TAG}early_stopped", f"after {n} trials")
                break
        result = _summarise(client, parent_id, trials, space, metric)
    except KeyboardInterrupt:
        active = mlflow.active_run()
        while active is not None and active.info.run_id != parent_id:
            mlflow.end_run("KILLED")
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
    _ = space_eval
    return result


def _no_progress(trials: Any, rounds: int) -> bool:
    """hyperopt's ``no_progress_loss`` rule (no new best loss for ``rounds`` trials), as a
    pure function of the trial history so that it holds across a resume, and with failed
    trials counted as no progress (hyperopt's own raises on them)."""
    losses = [r.get("loss") for r in trials.results]
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


def _load_trials(client: Any, run_id: str) -> Any:
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run_id, TRIALS_ARTIFACT, tmp)
        except (MlflowException, OSError):
            return None
        with open(path, "rb") as f:
            return pickle.load(f)


def _save_trials(client: Any, run_id: str, trials: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, os.path.basename(TRIALS_ARTIFACT))
        with open(path, "wb") as f:
            pickle.dump(trials, f)
        client.log_artifact(run_id, path, os.path.dirname(TRIALS_ARTIFACT))


def _summarise(
    client: Any, parent_id: str, trials: Any, space: Mapping[str, Any], metric: str
) -> SweepResult:
    from hyperopt import STATUS_OK, space_eval

    ok = [(t, r) for t, r in zip(trials.trials, trials.results, strict=True)
          if r.get("status") == STATUS_OK]
    losses = tuple(r.get("loss") for r in trials.results)
    failed = len(trials.results) - len(ok)
    _plot(client, parent_id, losses, metric)
    if not ok:
        client.set_tag(parent_id, f"{TAG}best_run_id", "")
        raise MlflowHvdError(f"all {len(trials.results)} trials failed; see the child runs")
    best_trial, best = min(ok, key=lambda tr: tr[1]["loss"])
    vals = {k: v[0] for k, v in best_trial["misc"]["vals"].items() if v}
    best_params = {k: _plain(v) for k, v in space_eval(dict(space), vals).items()}
    _log_params_once(client, parent_id, {f"best_{k}": v for k, v in best_params.items()})
    client.log_metric(parent_id, f"best_{metric}", best["loss"])
    client.set_tag(parent_id, f"{TAG}best_run_id", best["run_id"])
    client.set_tag(parent_id, f"{TAG}failed_trials", str(failed))
    return SweepResult(parent_id, best_params, float(best["loss"]), best["run_id"],
                       len(trials.results), failed, losses)


def _plot(client: Any, run_id: str, losses: tuple[float | None, ...], metric: str) -> None:
    """PNG of the loss per trial, failures as x at the bottom, the best ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    xs = [i for i, v in enumerate(losses) if v is not None]
    ys = [v for v in losses if v is not None]
    ax.plot(xs, ys, "o-", color="tab:blue", label=metric)
    failed = [i for i, v in enumerate(losses) if v is None]
    if failed:
        low = min(ys) if ys else 0.0
        ax.plot(failed, [low] * len(failed), "x", color="tab:red", label="failed trial")
    if ys:
        b = xs[ys.index(min(ys))]
        ax.plot([b], [min(ys)], "o", markersize=14, markerfacecolor="none",
                markeredgecolor="tab:green", markeredgewidth=2, label=f"best (trial {b})")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title("hyperopt sweep")
    ax.legend()
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "loss_per_trial.png")
        fig.savefig(path)
        client.log_artifact(run_id, path)
    plt.close(fig)

"""MLflow's own fluent API inside a training function, as MLflow's and Databricks' examples
use it: ``mlflow.log_metric(...)``, ``with mlflow.start_run():``, ``mlflow.autolog()``.

During a tracked job, in every rank (installed when MLflow is imported, or at once if it
already is; removed when the job ends, so a warm rank starts the next job clean):

On **rank 0**:

* ``mlflow.active_run()`` is the job's run (put on MLflow's run stack without creating or
  updating a run);
* ``mlflow.start_run()`` (or with the job's ``run_id``) returns it, so ``with
  mlflow.start_run():`` works and leaves it open; a nested run, a parent run or another run id
  is refused with :class:`~mlflow_hvd.errors.ConfigurationError`: a job logs into one run;
* ``mlflow.end_run()`` leaves the job's run to the driver, which ends it with the job's status;
* ``mlflow.log_metric(s)``, ``log_param(s)``, ``set_tag(s)``, ``log_artifact(s)``,
  ``log_dict`` go through :mod:`mlflow_hvd.tracking`: queued, never blocking training,
  buffered through a tracking-server outage;
* ``mlflow.autolog()`` / ``mlflow.tensorflow.autolog()`` / ``mlflow.keras.autolog()`` log into
  the job's run with MLflow's own client (MLflow offers no way to route autolog's writes);
  what the job enabled is disabled when it ends. With autolog on,
  :class:`~mlflow_hvd.keras.MlflowCallback` leaves the epoch metrics to autolog (it still
  checkpoints), so no value is logged twice;
* the rest (``log_text``, ``log_figure``, ``log_model`` of a flavor, ...) is MLflow's own,
  into the job's run, synchronous.

On **other ranks** all of these, ``log_text``/``log_figure``/``log_image``/``log_table`` and
the Keras/TensorFlow/PyTorch flavors' ``log_model`` write nothing and create no run
(``active_run()`` is None, ``start_run()`` returns a stand-in whose ``info.run_id`` is the
job's run), and the rank's stderr says once that its MLflow calls are dropped.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.protocol.messages import TrackingTarget
from mlflow_hvd.rank.after_import import spec_then
from mlflow_hvd.rank.tracking import api

WRITES = ("log_metric", "log_metrics", "log_param", "log_params", "set_tag", "set_tags",
          "log_artifact", "log_artifacts", "log_dict")
DROPPED_ONLY = ("log_text", "log_figure", "log_image", "log_table", "log_input",
                "set_experiment_tag", "set_experiment_tags", "delete_tag")
FLAVORS = ("mlflow.tensorflow", "mlflow.keras", "mlflow.pytorch")


class _Job:
    """What the patches of one job need."""

    def __init__(self, target: TrackingTarget, rank: int) -> None:
        self.target = target
        self.rank = rank
        self.active: Any = None  # the ActiveRun put on MLflow's stack (rank 0)
        self.said = False
        self.autologged: set[str] = set()  # "" for mlflow.autolog, else the flavor module
        self.originals: list[tuple[types.ModuleType, str, Any]] = []
        self.previous_uri: str | None = None  # MLflow's tracking URI before the job's

    def drop(self, what: str) -> None:
        if not self.said:
            self.said = True
            sys.stderr.write(
                f"mlflow_hvd: rank {self.rank}: MLflow calls on this rank write nothing (only "
                f"rank 0 logs, into the job's run {self.target.run_id}); the first was "
                f"mlflow.{what}\n")


_JOB: _Job | None = None


def install(target: TrackingTarget | None, rank: int) -> None:
    """Called by the worker before the user's function; nothing when the job does not track."""
    global _JOB
    uninstall()
    if target is None:
        return
    _JOB = _Job(target, rank)
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    for name in ("mlflow", *FLAVORS):
        module = sys.modules.get(name)
        if module is not None:
            _patch(name, module)


def uninstall() -> None:
    """Called by the worker after the user's function, on every path: autolog the job
    enabled is disabled, the job's run leaves MLflow's stack (not ended), MLflow's functions
    are restored."""
    global _JOB
    job, _JOB = _JOB, None
    if job is None:
        return
    for module, name, original in reversed(job.originals):
        setattr(module, name, original)
    for flavor in job.autologged:
        try:
            module = sys.modules["mlflow"] if not flavor else sys.modules[flavor]
            module.autolog(disable=True)
        except Exception as exc:  # the job is over: say it, never fail here
            sys.stderr.write(f"mlflow_hvd: disabling {flavor or 'mlflow'}.autolog failed: "
                             f"{exc}\n")
    if job.active is not None:
        stack = _stack()
        if stack is not None and job.active in stack:
            stack.remove(job.active)
    if job.previous_uri is not None:
        import mlflow

        mlflow.set_tracking_uri(job.previous_uri)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches MLflow's modules right after they are imported during a job."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if _JOB is None or fullname not in ("mlflow", *FLAVORS):
            return None
        return spec_then(fullname, path, lambda module: _patch(fullname, module))


def _set(job: _Job, module: types.ModuleType, name: str, value: Any) -> None:
    if hasattr(module, name):
        job.originals.append((module, name, getattr(module, name)))
        setattr(module, name, value)


def _patch(name: str, module: types.ModuleType) -> None:
    job = _JOB
    if job is None:
        return
    if name in FLAVORS:
        _set(job, module, "autolog", _autolog(job, name, module.autolog))
        if job.rank != 0:  # a model logged from another rank would land in the job's run
            _set(job, module, "log_model", _dropped(job, f"{name[len('mlflow.'):]}.log_model"))
        return
    import mlflow.tracking.fluent as fluent

    for where in (module, fluent):
        for fn in WRITES:
            _set(job, where, fn, _write(job, fn))
        for fn in DROPPED_ONLY:
            if job.rank != 0:
                _set(job, where, fn, _dropped(job, fn))
        _set(job, where, "start_run", _start_run(job))
        _set(job, where, "end_run", _end_run(job))
        _set(job, where, "autolog", _autolog(job, "", fluent.autolog))
        # rank 0: the job's run, put on MLflow's stack at the first look
        _set(job, where, "active_run", (lambda: None) if job.rank != 0 else
             (lambda: _activate(job)))


def autologging() -> bool:
    """Whether the running job enabled MLflow's autolog on this rank."""
    return _JOB is not None and bool(_JOB.autologged)


def _stack() -> list[Any] | None:
    """MLflow's stack of active runs of this thread (the same in MLflow 3.10-3.17)."""
    import mlflow.tracking.fluent as fluent

    holder = getattr(fluent, "_active_run_stack", None)
    return holder.get() if holder is not None else None


def _activate(job: _Job) -> Any:
    """Rank 0: put the job's run on MLflow's stack (once per job) and return it."""
    if job.active is None:
        import mlflow

        # MLflow's own calls (log_text, a flavor's log_model, autolog) go to the job's
        # store, whatever the rank's environment said when it started (a warm rank outlives
        # the store of the job that started it)
        job.previous_uri = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(job.target.tracking_uri)
        run = mlflow.MlflowClient(job.target.tracking_uri).get_run(job.target.run_id)
        job.active = mlflow.ActiveRun(run)
        stack = _stack()
        if stack is not None:
            stack.append(job.active)
    return job.active


def _refuse_other_run(job: _Job, run_id: str | None, call: str) -> None:
    if run_id is not None and run_id != job.target.run_id:
        raise ConfigurationError(
            f"mlflow.{call}(run_id={run_id!r}) inside a HorovodRunner job: rank 0 logs into "
            f"the job's run {job.target.run_id} only; drop run_id")


def _write(job: _Job, fn: str) -> Callable[..., Any]:
    def write(*args: Any, **kwargs: Any) -> Any:
        if job.rank != 0:
            job.drop(fn)
            return args[1] if fn == "log_param" and len(args) > 1 else None
        _refuse_other_run(job, kwargs.get("run_id"), fn)
        _activate(job)
        return _WRITERS[fn](*args, **kwargs)

    write.__name__ = fn
    return write


def _dropped(job: _Job, fn: str) -> Callable[..., None]:
    def dropped(*args: Any, **kwargs: Any) -> None:
        job.drop(fn)

    return dropped


class _StandIn:
    """What ``mlflow.start_run()`` returns on a rank other than 0: no run behind it."""

    def __init__(self, run_id: str) -> None:
        self.info = types.SimpleNamespace(run_id=run_id, run_uuid=run_id, status="RUNNING")
        self.data = types.SimpleNamespace(metrics={}, params={}, tags={})

    def __enter__(self) -> _StandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _start_run(job: _Job) -> Callable[..., Any]:
    def start_run(run_id: str | None = None, experiment_id: str | None = None,
                  run_name: str | None = None, nested: bool = False,
                  parent_run_id: str | None = None, tags: Mapping[str, Any] | None = None,
                  description: str | None = None, **_: Any) -> Any:
        if job.rank != 0:
            job.drop("start_run")
            return _StandIn(job.target.run_id)
        _refuse_other_run(job, run_id, "start_run")
        if nested or parent_run_id is not None:
            raise ConfigurationError(
                "mlflow.start_run(nested=True) inside a HorovodRunner job: the job logs into "
                f"one run ({job.target.run_id}), which the driver owns; log into it "
                "(mlflow.start_run() returns it), or start nested runs on the driver")
        if tags:
            api.set_tags(tags)
        if description:
            api.set_tag("mlflow.note.content", description)
        return _activate(job)

    return start_run


def _end_run(job: _Job) -> Callable[..., None]:
    def end_run(status: str = "FINISHED") -> None:
        # the job's run is the driver's to end, with the job's status
        return None

    return end_run


def _autolog(job: _Job, flavor: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def autolog(*args: Any, **kwargs: Any) -> Any:
        if job.rank != 0:
            job.drop(f"{flavor[len('mlflow.'):] + '.' if flavor else ''}autolog")
            return None
        if not kwargs.get("disable"):
            _activate(job)  # autolog finds the job's run active and logs into it
            job.autologged.add(flavor)
        return original(*args, **kwargs)

    return autolog


def _log_metric(key: str, value: float, step: int | None = None, *_: Any, **__: Any) -> None:
    api.log_metric(key, value, step)


def _log_metrics(metrics: Mapping[str, float], step: int | None = None, *_: Any,
                 **__: Any) -> None:
    api.log_metrics(metrics, step)


def _log_param(key: str, value: Any, *_: Any, **__: Any) -> Any:
    api.log_param(key, value)
    return value


def _log_params(params: Mapping[str, Any], *_: Any, **__: Any) -> None:
    api.log_params(params)


def _set_tag(key: str, value: Any, *_: Any, **__: Any) -> None:
    api.set_tag(key, value)


def _set_tags(tags: Mapping[str, Any], *_: Any, **__: Any) -> None:
    api.set_tags(tags)


def _log_artifact(local_path: str, artifact_path: str | None = None, *_: Any,
                  **__: Any) -> None:
    api.log_artifact(local_path, artifact_path)


def _log_artifacts(local_dir: str, artifact_path: str | None = None, *_: Any,
                   **__: Any) -> None:
    api.log_artifacts(local_dir, artifact_path)


def _log_dict(dictionary: Mapping[str, Any], artifact_file: str, *_: Any, **__: Any) -> None:
    api.log_dict(dictionary, artifact_file)


_WRITERS: dict[str, Callable[..., Any]] = {
    "log_metric": _log_metric, "log_metrics": _log_metrics, "log_param": _log_param,
    "log_params": _log_params, "set_tag": _set_tag, "set_tags": _set_tags,
    "log_artifact": _log_artifact, "log_artifacts": _log_artifacts, "log_dict": _log_dict,
}

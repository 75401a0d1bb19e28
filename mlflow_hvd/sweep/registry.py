"""Driver side: a sweep's best model in the MLflow Model Registry.

Before the first trial, :func:`check_registry` makes sure the registry can be used (the store
has one, the driver's user may add versions to the registered model) and creates the
registered model if it does not exist yet. After the sweep, :func:`register_best` makes the
best trial's logged model a new version with tags naming the sweep run and the metric's
value, and points the alias ``champion`` at it.

A trial that already has a version of the model (a resumed sweep whose best trial is still
the one it registered) gets no second version and the alias is left where it is, so
resuming a sweep moves ``champion`` only when it found a better trial.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mlflow_hvd.errors import ConfigurationError, TrackingError

ALIAS = "champion"
TAG = "mlflow_hvd.sweep."
MODEL_TAG = "mlflow_hvd.registered_by"  # on the registered model: who adds versions to it

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    """What :func:`register_best` did.

    Attributes:
        name: The registered model.
        version: The version that holds the best trial's model.
        created: True when this call created that version and moved the alias to it; False
            when the trial already had it (the alias was left where it was).
        model_uri: ``models:/name@champion`` when the alias points at ``version``, else
            ``models:/name/version``.
    """

    name: str
    version: str
    created: bool
    model_uri: str


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ConfigurationError(
            f"register_model must be the name of a registered model (a non-empty string), "
            f"got {name!r}")
    return name.strip()


def check_registry(client: Any, name: str) -> None:
    """Make sure the best model can be registered as ``name`` before any trial runs: the
    registry exists at the client's registry URI and its user may update ``name`` (created
    here when missing, with the tag :data:`MODEL_TAG`; an existing model gets that tag, the
    same kind of write as adding a version).

    Raises:
        TrackingError: no registry there, or the user may not create or update ``name``;
            the message names the registry URI and what to do.
    """
    from mlflow.exceptions import MlflowException

    try:
        try:
            client.get_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            client.create_registered_model(
                name, tags={MODEL_TAG: "mlflow_hvd sweep"},
                description="Best models of mlflow_hvd sweeps; the alias 'champion' names the "
                            "latest sweep's best.")
            log.info("registered model %r created", name)
            return
        client.set_registered_model_tag(name, MODEL_TAG, "mlflow_hvd sweep")
    except MlflowException as exc:
        raise TrackingError(_refusal(client, name, exc)) from exc


def _refusal(client: Any, name: str, exc: Exception) -> str:
    import mlflow

    uri = mlflow.get_registry_uri()  # the client's: the sweep's client takes the default
    status = _http_status(exc)
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    if status in (401, 403):
        return (f"register_model={name!r}: the Model Registry at {uri} refused the driver's "
                f"user (HTTP {status}): it may not create or update the registered model "
                f"{name!r}. Ask its owner or an admin for EDIT (or MANAGE) permission on it, "
                "or choose another name. No trial was run.")
    if "not supported by the store" in str(exc):
        return (f"register_model={name!r}: the MLflow store {uri} has no Model Registry "
                f"({first}). Set MLFLOW_REGISTRY_URI (or mlflow.set_registry_uri) to one "
                "that has, e.g. the tracking server or a database URI, or leave "
                "register_model out. No trial was run.")
    return (f"register_model={name!r}: the Model Registry at {uri} cannot be used: {first}. "
            "No trial was run.")


def _http_status(exc: Exception) -> int | None:
    try:
        return int(exc.get_http_status_code())  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return None


def register_best(client: Any, name: str, run_id: str, sweep_run_id: str, metric: str,
                  value: float) -> Registration:
    """A new version of ``name`` from the model that trial run ``run_id`` logged last, with
    the alias :data:`ALIAS` moved to it; nothing new when the trial already has a version.

    Raises:
        TrackingError: the trial logged no model, or the registry refused the version.
    """
    from mlflow.exceptions import MlflowException

    try:
        mine = client.search_model_versions(f"name = '{_quoted(name)}' and run_id = '{run_id}'")
        if mine:
            version = max(mine, key=lambda v: int(v.version))
            aliased = ALIAS in (version.aliases or ())
            log.info("the best trial %s already is version %s of %r: the alias %r is left "
                     "as it is", run_id, version.version, name, ALIAS)
            return Registration(name, str(version.version), False,
                                _uri(name, version.version, aliased))
        run = client.get_run(run_id)
        outputs = list(run.outputs.model_outputs) if run.outputs else []
        if not outputs:
            raise TrackingError(
                f"register_model={name!r}: the best trial (run {run_id}) logged no model, so "
                "there is nothing to register. Have the training function log one on rank 0 "
                "at the end of training (mlflow_hvd.tracking.log_model, "
                "mlflow_hvd.torch.log_model or a flavor's log_model). For this sweep, log a "
                f"model into run {run_id} (e.g. from its checkpoint) and resume the sweep with "
                f"parent_run_id={sweep_run_id!r}: it registers without running the trials "
                "again.")
        model = max(outputs, key=lambda o: o.step)  # the last one it logged
        tags = {
            f"{TAG}run_id": sweep_run_id,
            f"{TAG}trial_run_id": run_id,
            f"{TAG}metric": metric,
            f"{TAG}metric_value": repr(float(value)),
        }
        created = client.create_model_version(
            name, source=f"models:/{model.model_id}", run_id=run_id, model_id=model.model_id,
            tags=tags, description=f"Best trial of sweep run {sweep_run_id}: {metric} = {value:g}")
        client.set_registered_model_alias(name, ALIAS, created.version)
    except MlflowException as exc:
        raise TrackingError(f"register_model={name!r}: registering run {run_id}'s model "
                            f"failed: {exc}") from exc
    log.info("version %s of %r holds the sweep's best model; alias %r moved to it",
             created.version, name, ALIAS)
    return Registration(name, str(created.version), True, _uri(name, created.version, True))


def _uri(name: str, version: object, aliased: bool) -> str:
    return f"models:/{name}@{ALIAS}" if aliased else f"models:/{name}/{version}"


def _quoted(name: str) -> str:
    return name.replace("'", "\\'")

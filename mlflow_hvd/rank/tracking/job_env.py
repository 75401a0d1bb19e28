"""Rank side: the environment that points MLflow's own API at the job's run, set before the
training function and undone after it (a warm rank starts its next job clean).

``MLFLOW_TRACKING_URI`` names the job's store (:mod:`.store`), ``MLFLOW_RUN_ID`` and
``MLFLOW_EXPERIMENT_ID`` the driver's run and its experiment, ``MLFLOW_REGISTRY_URI`` the
driver's Model Registry on rank 0 (which holds the credentials) and, on other ranks, a
registry that says to use it from rank 0. MLflow is touched only if the job imported it: at
the end, runs user code left active are ended (the store leaves the job's run to the driver)
and autologging the job turned on is turned off (which integrations are on is read
through :mod:`mlflow_hvd.common.mlflow_private`).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

from mlflow_hvd.common import mlflow_private
from mlflow_hvd.protocol.messages import TrackingTarget
from mlflow_hvd.rank.tracking.plugin import ENTRY_POINTS

SCHEME = ENTRY_POINTS["mlflow.tracking_store"][0]
VARS = ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID",
        "MLFLOW_EXPERIMENT_NAME", "MLFLOW_REGISTRY_URI")


@dataclass(frozen=True)
class Saved:
    """The variables as they were before the job (None: unset), and what the job set."""

    values: tuple[tuple[str, str | None], ...]
    uri: str = ""
    rank: int = 0


def job_uri(run_id: str) -> str:
    """The tracking URI of MLflow in a rank during the job of run ``run_id``."""
    return f"{SCHEME}://{run_id}"


def enter(target: TrackingTarget, rank: int) -> Saved:
    uri = job_uri(target.run_id)
    saved = Saved(tuple((k, os.environ.get(k)) for k in VARS), uri, rank)
    registry = (target.registry_uri or target.tracking_uri) if rank == 0 else uri
    os.environ.pop("MLFLOW_EXPERIMENT_NAME", None)
    os.environ.update(MLFLOW_TRACKING_URI=uri, MLFLOW_RUN_ID=target.run_id,
                      MLFLOW_EXPERIMENT_ID=target.experiment_id, MLFLOW_REGISTRY_URI=registry)
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:  # a warm rank: code of an earlier job may have set them in MLflow
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(registry)
    return saved


def leave(saved: Saved) -> None:
    """Undo :func:`enter`. Never raises: the job's outcome is already decided; what fails
    here is said on stderr."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        current = mlflow.get_tracking_uri()
        if saved.uri and current != saved.uri:
            sys.stderr.write(
                f"mlflow_hvd: rank {saved.rank}: the training function set MLflow's tracking "
                f"URI to {current}: its MLflow calls after that went there directly, from "
                "every rank, outside the job's run. Leave the tracking URI as the job sets it "
                "(set it on the driver) to log into the job's run from rank 0\n")
        try:
            while mlflow.active_run() is not None:
                mlflow.end_run()
        except Exception as exc:
            sys.stderr.write(f"mlflow_hvd: ending the runs the job left active failed: {exc}\n")
        for name in enabled_autologging():
            try:  # each integration by its own module: mlflow.autolog(disable=True) skips some
                module = mlflow if name == "mlflow" else importlib.import_module(f"mlflow.{name}")
                module.autolog(disable=True)
            except Exception as exc:
                sys.stderr.write(f"mlflow_hvd: turning off the job's {name} autologging "
                                 f"failed: {exc}\n")
        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)
    for key, value in saved.values:
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def enabled_autologging() -> list[str]:
    """MLflow's autologging integrations turned on in this process (``"mlflow"`` for
    ``mlflow.autolog()``, else the flavor: ``"tensorflow"``, ``"sklearn"``, ...)."""
    if "mlflow" not in sys.modules:
        return []
    return mlflow_private.enabled_autologging()


def autologging(flavors: tuple[str, ...]) -> bool:
    """Whether MLflow's autologging is on in this process for one of ``flavors``."""
    return any(name in flavors for name in enabled_autologging())

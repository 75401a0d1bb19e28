"""MLflow's plugin seams, as mlflow_hvd declares them (``pyproject.toml`` entry points):

* ``mlflow.tracking_store``: ``mlflow-hvd`` -> :func:`tracking_store` (:mod:`.store`);
* ``mlflow.artifact_repository``: ``mlflow-hvd-artifacts`` -> :func:`artifact_repository`
  (:mod:`.artifacts`);
* ``mlflow.model_registry_store``: ``mlflow-hvd`` -> :func:`registry_store` (ranks other
  than 0: every call says to use the registry from rank 0).

MLflow loads these functions whenever it is imported in a process where mlflow_hvd is
installed, so this module imports nothing heavy; the stores are only usable inside a rank
during a job. A rank whose mlflow_hvd is not an installed distribution (e.g. on
``PYTHONPATH``) declares the same entry points itself (:func:`ensure_registered`) before
MLflow is imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from typing import Any

ENTRY_POINTS = {  # group -> (name, object)
    "mlflow.tracking_store": ("mlflow-hvd", f"{__name__}:tracking_store"),
    "mlflow.artifact_repository": ("mlflow-hvd-artifacts", f"{__name__}:artifact_repository"),
    "mlflow.model_registry_store": ("mlflow-hvd", f"{__name__}:registry_store"),
}
DIST = "mlflow_hvd_rank_plugins-0.dist-info"


def tracking_store(store_uri: str, artifact_uri: str | None = None) -> Any:
    from mlflow_hvd.rank.tracking.store import JobStore

    return JobStore(store_uri, artifact_uri)


def artifact_repository(artifact_uri: str, tracking_uri: str | None = None,
                        registry_uri: str | None = None) -> Any:
    from mlflow_hvd.rank.tracking.artifacts import JobArtifactRepository

    return JobArtifactRepository(artifact_uri, tracking_uri, registry_uri)


def registry_store(store_uri: str, tracking_uri: str | None = None) -> Any:
    from mlflow_hvd.rank.tracking.store import RankRegistry

    return RankRegistry(store_uri, tracking_uri)


def registered() -> bool:
    """Whether every entry point above is visible to ``importlib.metadata``."""
    return all(any(ep.name == name and ep.value == value
                   for ep in importlib.metadata.entry_points(group=group))
               for group, (name, value) in ENTRY_POINTS.items())


def ensure_registered(folder: str) -> None:
    """Make the entry points visible if the installed distribution does not declare them:
    a ``.dist-info`` directory in ``folder``, put on ``sys.path``. Called by the worker
    before any user code (MLflow reads entry points once, when it is imported).

    Raises:
        TrackingError: MLflow was imported already, without them.
    """
    if registered():
        return
    if "mlflow" in sys.modules:
        from mlflow_hvd.errors import TrackingError

        raise TrackingError("MLflow was imported in this rank before mlflow_hvd could declare "
                            "its tracking store; install mlflow_hvd (pip install) so that "
                            "MLflow finds it by itself")
    dist = os.path.join(folder, DIST)
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: mlflow_hvd_rank_plugins\nVersion: 0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as f:
        for group, (name, value) in ENTRY_POINTS.items():
            f.write(f"[{group}]\n{name} = {value}\n\n")
    if folder not in sys.path:
        sys.path.append(folder)
    importlib.invalidate_caches()

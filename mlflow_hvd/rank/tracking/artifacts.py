"""MLflow's artifact repository inside a rank (the ``mlflow.artifact_repository`` entry point
for the ``mlflow-hvd-artifacts`` scheme, :mod:`.plugin`): where MLflow's API puts files
logged from the training function.

The job's run's artifact URI in a rank is ``mlflow-hvd-artifacts://<run id>/run`` and a model
the job logs has ``mlflow-hvd-artifacts://<run id>/models/<model id>`` (:mod:`.store`
answers so). On rank 0:

* the run's files (``log_artifact``, ``log_text``, ``log_dict``, ``log_figure``,
  ``log_image``, ``log_table``, checkpoints) are copied at once and queued for rank 0's
  delivery, in order with the metrics: never blocking training, kept through an outage;
* a model's files go to the model's real location synchronously (its id already came
  from the server);
* listing or downloading waits for what is queued (within the job's ``tracking_timeout``)
  and reads the artifact store.

On other ranks files are dropped (the rank says so once), a listing is empty and a
download raises :class:`~mlflow_hvd.errors.TrackingError`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any
from urllib.parse import urlparse

from mlflow.store.artifact.artifact_repo import ArtifactRepository

from mlflow_hvd.errors import TrackingError
from mlflow_hvd.rank.tracking.session import SESSION, RankLogger
from mlflow_hvd.rank.tracking.store import not_on_this_rank


class JobArtifactRepository(ArtifactRepository):
    """The artifact repository of ``mlflow-hvd-artifacts://...`` (see the module docstring)."""

    def __init__(self, artifact_uri: str, tracking_uri: str | None = None,
                 registry_uri: str | None = None) -> None:
        super().__init__(artifact_uri)
        parsed = urlparse(artifact_uri)
        self.run_id = parsed.netloc
        parts = [p for p in parsed.path.split("/") if p]
        if parts[:1] == ["run"]:
            self.model_id, self.sub = None, "/".join(parts[1:])
        elif parts[:1] == ["models"] and len(parts) >= 2:
            self.model_id, self.sub = parts[1], "/".join(parts[2:])
        else:
            raise TrackingError(f"not an artifact location of a HorovodRunner job: "
                                f"{artifact_uri}")

    # --- where -------------------------------------------------------------------------------
    def _logger(self) -> RankLogger | None:
        target = SESSION.target
        if target is None or target.run_id != self.run_id or SESSION.job_run is None:
            raise TrackingError(
                f"the artifact location {self.artifact_uri} belongs to a HorovodRunner job that "
                "is not running in this process")
        return SESSION.logger()

    def _path(self, artifact_path: str | None) -> str:
        """``artifact_path`` below this repository's root, from the run's (or model's) root."""
        return "/".join(p.strip("/") for p in (self.sub, artifact_path) if p)

    def _real_root(self, logger: RankLogger) -> str:
        """The location this repository stands for, as the tracking server names it."""
        target = logger.target
        if self.model_id is None:
            return target.artifact_uri or logger.client.get_run(target.run_id).info.artifact_uri
        assert SESSION.job_run is not None
        model = SESSION.job_run.models.get(self.model_id)
        if model is None:
            raise TrackingError(f"model {self.model_id} was not logged by this job")
        return str(model.artifact_location)

    def _real(self, logger: RankLogger) -> Any:
        """The repository this one stands for, on rank 0."""
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        return get_artifact_repository(self._real_root(logger),
                                       tracking_uri=logger.target.tracking_uri)

    # --- writes -------------------------------------------------------------------------------
    def log_artifact(self, local_file: str, artifact_path: str | None = None) -> None:
        logger = self._logger()
        if logger is None:
            SESSION.drop("an artifact")
        elif self.model_id is not None:
            self._real(logger).log_artifact(local_file, self._path(artifact_path) or None)
        else:
            staged = logger.delivery.stage_file(local_file)
            logger.put_artifact(staged, self._path(artifact_path))

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        logger = self._logger()
        if logger is None:
            SESSION.drop("artifacts")
        elif self.model_id is not None:
            if not self._path(artifact_path):
                _name_real_location(local_dir, self.artifact_uri, self._real_root(logger))
            self._real(logger).log_artifacts(local_dir, self._path(artifact_path) or None)
        else:
            for root, _, files in sorted(os.walk(local_dir)):
                rel = os.path.relpath(root, local_dir)
                folder = self._path("/".join(p for p in (artifact_path,
                                                         "" if rel == "." else rel) if p))
                for name in sorted(files):
                    staged = logger.delivery.stage_file(os.path.join(root, name))
                    logger.put_artifact(staged, folder)

    # --- reads --------------------------------------------------------------------------------
    def list_artifacts(self, path: str | None = None) -> list[Any]:
        logger = self._logger()
        if logger is None:
            return []  # nothing this rank logged is stored anywhere
        logger.flush()
        real = self._real(logger)
        return real.list_artifacts(self._path(path) or None) if self.model_id is not None \
            else _relative(real.list_artifacts(self._path(path) or None), self.sub)

    def _download_file(self, remote_file_path: str, local_path: str) -> None:
        logger = self._logger()
        if logger is None:
            raise not_on_this_rank(SESSION.rank, f"downloading artifact {remote_file_path}",
                                   SESSION.target.tracking_uri if SESSION.target else "")
        logger.flush()
        with tempfile.TemporaryDirectory() as tmp:
            got = self._real(logger).download_artifacts(self._path(remote_file_path), tmp)
            shutil.move(got, local_path)


def _name_real_location(local_dir: str, ours: str, real: str) -> None:
    """The model's ``MLmodel`` names where the model is (``artifact_path``), which MLflow
    reads back, e.g. to load its input example: the real location, as plain MLflow writes
    it, not this repository's."""
    path = os.path.join(local_dir, "MLmodel")
    if not os.path.isfile(path):
        return
    from mlflow.models import Model

    model = Model.load(path)
    if model.artifact_path == ours:
        model.artifact_path = real
        model.save(path)


def _relative(infos: list[Any], sub: str) -> list[Any]:
    """File infos of the run's root made relative to ``sub`` (what a repository rooted there
    answers)."""
    if not sub:
        return infos
    from mlflow.entities import FileInfo

    prefix = sub.rstrip("/") + "/"
    return [FileInfo(i.path[len(prefix):] if i.path.startswith(prefix) else i.path, i.is_dir,
                     i.file_size) for i in infos]

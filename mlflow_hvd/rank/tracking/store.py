"""MLflow's tracking store inside a rank: MLflow's own API, unmodified, writes into the job's
run through it (MLflow's plugin seam: the ``mlflow.tracking_store`` entry point for the
``mlflow-hvd`` scheme, :mod:`.plugin`).

During a tracked job each rank's environment names the job's run
(``MLFLOW_TRACKING_URI=mlflow-hvd://<run id>``, ``MLFLOW_RUN_ID``, ``MLFLOW_EXPERIMENT_ID``),
so ``mlflow.start_run()`` resumes it and a bare ``mlflow.log_metric`` lands in it; names
bound with ``from mlflow import ...`` before the job and ``MlflowClient()`` behave the same.

Writes to the job's run (``log_batch``, ``log_inputs``, ``log_outputs``, artifacts through
:mod:`.artifacts`) become records for rank 0's delivery (:mod:`.delivery`: never blocking
training, kept through a tracking-server outage, saved for replay), with everything MLflow
passes (timestamps, steps, ``model_id``, dataset). On other ranks they are kept only in the
rank's view of the run (:class:`~.job_run.JobRun`) and the rank says once that its writes go
nowhere. Ending the run (``mlflow.end_run()``, leaving ``with mlflow.start_run()``) leaves it
to the driver, which ends it with the job's status; a "new" run (``start_run()`` after
``end_run()``) is the job's run: no rank makes a run of its own. Nested runs and writes to
other runs are refused.

Reads of the job's run (``get_run``, ``active_run()``, a metric's history, models the job
logged) are answered from the rank's view, on every rank, without the server. Other reads
(``search_runs``, other runs, experiments, logged models, the Model Registry) go to the
tracking server from rank 0, which holds the credentials; other ranks get a
:class:`TrackingError` saying to read on rank 0 and broadcast.

A logged model's id comes from the server: ``create_logged_model`` on rank 0 is a
synchronous call, bounded by MLflow's HTTP retries; during an outage it raises
:class:`TrackingError` (the model is not logged; the job's other records stay queued).
Other ranks get a placeholder id (``m-`` and 32 hex digits) that names no model on the
server: ``hvd.broadcast_object`` rank 0's ``ModelInfo`` if every rank needs the real one.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlparse

from mlflow.store.tracking.abstract_store import AbstractStore

from mlflow_hvd.common.tracking_server import is_outage
from mlflow_hvd.errors import ConfigurationError, TrackingError
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.rank.tracking import writes
from mlflow_hvd.rank.tracking.job_run import JobRun, model_root
from mlflow_hvd.rank.tracking.session import SESSION, RankLogger

log = logging.getLogger(__name__)
PARENT_TAG = "mlflow.parentRunId"
_BY_NAME = re.compile(r"name\s*=\s*'([^']*)'")
T = TypeVar("T")


def not_on_this_rank(rank: int, what: str, uri: str) -> TrackingError:
    """The error of a rank other than 0 asked to read from the tracking server."""
    return TrackingError(
        f"{what} on rank {rank}: inside a HorovodRunner job only rank 0 talks to the tracking "
        f"server ({uri}), with the driver's credentials. Do it on rank 0 and send the result "
        "to the others (hvd.broadcast_object(value, root_rank=0)), or do it on the driver and "
        "pass the result to run()")


class JobStore(AbstractStore):
    """The tracking store of ``mlflow-hvd://<run id>`` (see the module docstring). It holds
    no state of its own: each call reads this process's tracking session, so a store MLflow
    cached for an earlier job refuses calls instead of writing into the wrong run."""

    def __init__(self, store_uri: str, artifact_uri: str | None = None) -> None:
        super().__init__()
        self.uri = store_uri
        self.run_id = urlparse(store_uri).netloc

    # --- the job --------------------------------------------------------------------------
    def _job(self) -> JobRun:
        job, target = SESSION.job_run, SESSION.target
        if job is None or target is None or target.run_id != self.run_id:
            raise TrackingError(
                f"the MLflow tracking URI {self.uri} names the run of a HorovodRunner job that "
                "is not running in this process: mlflow_hvd sets it in ranks while a job runs. "
                "Outside a job, set MLFLOW_TRACKING_URI to your tracking server")
        return job

    def _own(self, run_id: str, what: str) -> JobRun:
        """The job, if ``run_id`` is its run; a write to another run is refused."""
        job = self._job()
        if run_id != job.target.run_id:
            raise ConfigurationError(
                f"{what} for run {run_id} inside a HorovodRunner job: the job logs into its "
                f"own run {job.target.run_id} only (rank 0 writes it); log into that run "
                "(drop run_id), or write to other runs from the driver")
        return job

    def _logger(self) -> RankLogger | None:
        """Rank 0's logger; None on other ranks."""
        self._job()
        return SESSION.logger()

    def _server(self, what: str, call: Callable[[Any], T]) -> T:
        """``call(client)`` against the tracking server, on rank 0 only."""
        logger = self._logger()
        if logger is None:
            raise not_on_this_rank(SESSION.rank, what, self._job().target.tracking_uri)
        try:
            return call(logger.client)
        except Exception as exc:
            if is_outage(exc):
                raise TrackingError(
                    f"{what} needs the tracking server at {logger.target.tracking_uri}, which "
                    f"does not answer: {str(exc).splitlines()[0] if str(exc) else repr(exc)}. "
                    "The job's metrics, params, tags and artifacts are queued and delivered "
                    "when it is back; this call's result is not") from exc
            raise

    def _write(self, run_id: str, records: Sequence[rec.Record], what: str) -> None:
        job = self._own(run_id, what)
        logger = SESSION.logger()
        if logger is None:
            job.add(records)
            SESSION.drop(what)
            return
        for r in records:
            logger.put(r)

    # --- runs -----------------------------------------------------------------------------
    def get_run(self, run_id: str) -> Any:
        job = self._job()
        if run_id == job.target.run_id:
            return job.run()
        return self._server(f"reading run {run_id}", lambda c: c.get_run(run_id))

    def create_run(self, experiment_id: str, user_id: str, start_time: int, tags: Any,
                   run_name: str | None) -> Any:
        """``mlflow.start_run()`` after the job's run was ended by user code: the job's run
        again (with the tags the user gave), never a new one."""
        job = self._job()
        given = {t.key: t.value for t in tags or ()}
        if PARENT_TAG in given:
            raise ConfigurationError(
                "mlflow.start_run(nested=True) inside a HorovodRunner job: the job logs into "
                f"one run ({job.target.run_id}), which the driver owns; log into it "
                "(mlflow.start_run() returns it), or start nested runs on the driver")
        user = job.user_tags(given)
        if user:
            self._write(job.target.run_id, [rec.Tag(k, str(v)) for k, v in user.items()],
                        "tags")
        return job.run()

    def update_run_info(self, run_id: str, run_status: Any, end_time: Any,
                        run_name: str | None) -> Any:
        """Ending the job's run (``mlflow.end_run()``) is the driver's: it ends it with the
        job's status. The run stays RUNNING."""
        return self._own(run_id, "changing the run's status").info()

    def delete_run(self, run_id: str) -> None:
        self._own(run_id, "deleting a run")
        raise ConfigurationError(
            f"deleting the job's run {run_id} from inside the job: delete it from the driver "
            "once the job has ended")

    def restore_run(self, run_id: str) -> None:
        self._own(run_id, "restoring a run")

    def _search_runs(self, *args: Any, **kwargs: Any) -> Any:  # search_runs is overridden
        raise NotImplementedError

    def search_runs(self, experiment_ids: Any, filter_string: Any, run_view_type: Any,
                    max_results: Any = None, order_by: Any = None,
                    page_token: Any = None) -> Any:
        return self._server("searching runs", lambda c: c.search_runs(
            experiment_ids, filter_string, run_view_type, max_results, order_by, page_token))

    def get_metric_history(self, run_id: str, metric_key: str, max_results: Any = None,
                           page_token: Any = None) -> Any:
        from mlflow.store.entities.paged_list import PagedList

        job = self._job()
        if run_id == job.target.run_id:
            history = job.history(metric_key)
            return PagedList(history[:max_results] if max_results else history, None)
        return self._server(f"reading run {run_id}'s metric {metric_key!r}",
                            lambda c: PagedList(c.get_metric_history(run_id, metric_key), None))

    # --- writes to the job's run ----------------------------------------------------------
    def log_batch(self, run_id: str, metrics: Any, params: Any, tags: Any) -> None:
        job = self._own(run_id, "logging")
        logger = SESSION.logger()
        given = {p.key: p.value for p in params or ()}
        records: list[rec.Record] = []
        records += (writes.params(logger, given) if logger is not None
                    else [rec.Param(k, str(v)) for k, v in given.items()])
        logged = writes.unrepeated(logger, [
            rec.Metric(m.key, m.value, int(m.timestamp), int(m.step or 0), m.model_id,
                       m.dataset_name, m.dataset_digest) for m in metrics or ()])
        records += logged
        records += [rec.Tag(t.key, str(t.value)) for t in tags or ()]
        if records:
            self._write(job.target.run_id, records, _describe(records))
        if logger is not None:  # the step a model links to; a pruning sweep's epoch
            writes.metrics_logged(logger, logged)

    def delete_tag(self, run_id: str, key: str) -> None:
        job = self._own(run_id, "deleting a tag")
        job.delete_tag(key)
        logger = SESSION.logger()
        if logger is None:
            SESSION.drop("a tag deletion")
            return
        logger.flush()  # after the tag it deletes
        self._server(f"deleting tag {key!r}", lambda c: c.delete_tag(run_id, key))

    def log_inputs(self, run_id: str, datasets: Any = None, models: Any = None) -> None:
        record = rec.Inputs(
            tuple(rec.Dataset(d.dataset.name, d.dataset.digest, d.dataset.source_type,
                              d.dataset.source, d.dataset.schema, d.dataset.profile,
                              tuple((t.key, t.value) for t in d.tags or ()))
                  for d in datasets or ()),
            tuple(m.model_id for m in models or ()))
        if record.datasets or record.models:
            self._write(run_id, [record], "a dataset or model input")

    def log_outputs(self, run_id: str, models: Any) -> None:
        record = rec.Outputs(tuple((m.model_id, int(m.step or 0)) for m in models or ()))
        if record.models:
            self._write(run_id, [record], "a model output")

    def link_traces_to_run(self, trace_ids: list[str], run_id: str) -> None:
        self._own(run_id, "linking traces")
        if SESSION.logger() is None:
            SESSION.drop("trace links")
            return
        self._server("linking traces to the run",
                     lambda c: c.link_traces_to_run(trace_ids, run_id))

    # --- experiments ----------------------------------------------------------------------
    def get_experiment(self, experiment_id: str) -> Any:
        job = self._job()
        if experiment_id == job.target.experiment_id:
            if SESSION.logger() is not None:
                try:
                    return self._server("reading the job's experiment",
                                        lambda c: c.get_experiment(experiment_id))
                except TrackingError as exc:  # an outage: what the job knows of it
                    log.info("job's experiment %s answered without the server: %s",
                             experiment_id, exc)
            from mlflow.entities import Experiment

            return Experiment(experiment_id, "", "", "active")
        return self._server(f"reading experiment {experiment_id}",
                            lambda c: c.get_experiment(experiment_id))

    def get_experiment_by_name(self, experiment_name: str) -> Any:
        return self._server(f"reading experiment {experiment_name!r}",
                            lambda c: c.get_experiment_by_name(experiment_name))

    def search_experiments(self, *args: Any, **kwargs: Any) -> Any:
        return self._server("searching experiments",
                            lambda c: c.search_experiments(*args, **kwargs))

    def create_experiment(self, name: str, artifact_location: Any = None,
                          tags: Any = None) -> Any:
        return self._server(f"creating experiment {name!r}", lambda c: c.create_experiment(
            name, artifact_location, {t.key: t.value for t in tags or ()}))

    def delete_experiment(self, experiment_id: str) -> None:
        self._server("deleting an experiment", lambda c: c.delete_experiment(experiment_id))

    def restore_experiment(self, experiment_id: str) -> None:
        self._server("restoring an experiment", lambda c: c.restore_experiment(experiment_id))

    def rename_experiment(self, experiment_id: str, new_name: str) -> None:
        self._server("renaming an experiment",
                     lambda c: c.rename_experiment(experiment_id, new_name))

    def set_experiment_tag(self, experiment_id: str, tag: Any) -> None:
        if self._logger() is None:
            SESSION.drop("an experiment tag")
            return
        self._server("setting an experiment tag",
                     lambda c: c.set_experiment_tag(experiment_id, tag.key, tag.value))

    # --- logged models (MLflow 3) ---------------------------------------------------------
    def create_logged_model(self, experiment_id: str, name: str | None = None,
                            source_run_id: str | None = None, tags: Any = None,
                            params: Any = None, model_type: str | None = None) -> Any:
        job = self._job()
        if source_run_id is not None:
            self._own(source_run_id, "logging a model")
        tag_map = {t.key: t.value for t in tags or ()}
        param_map = {p.key: p.value for p in params or ()}
        logger = SESSION.logger()
        if logger is not None:
            logger.check_artifacts()
            model = self._server("logging a model (its id comes from the server)",
                                 lambda c: c.create_logged_model(
                                     experiment_id, name, source_run_id, tag_map, param_map,
                                     model_type))
        else:
            from mlflow.entities import LoggedModel, LoggedModelStatus

            now = int(time.time() * 1000)
            model = LoggedModel(experiment_id, f"m-{uuid.uuid4().hex}", name or "model", "",
                                now, now, model_type, source_run_id,
                                LoggedModelStatus.PENDING, tags=tag_map, params=param_map)
            SESSION.drop("a model")
        job.models[model.model_id] = model
        return self._local(job, model)

    def get_logged_model(self, model_id: str, allow_deleted: bool = False) -> Any:
        job = self._job()
        if model_id in job.models:
            return self._local(job, job.models[model_id])
        return self._server(f"reading model {model_id}", lambda c: c.get_logged_model(model_id))

    def finalize_logged_model(self, model_id: str, status: Any) -> Any:
        return self._model_write(model_id, "finalizing a model",
                                 lambda c: c.finalize_logged_model(model_id, status),
                                 lambda m: _replace(m, status=status))

    def set_logged_model_tags(self, model_id: str, tags: Any) -> None:
        tag_map = {t.key: t.value for t in tags or ()}
        self._model_write(model_id, "tagging a model",
                          lambda c: (c.set_logged_model_tags(model_id, tag_map),
                                     c.get_logged_model(model_id))[1],
                          lambda m: _replace(m, tags={**m.tags, **tag_map}))

    def delete_logged_model_tag(self, model_id: str, key: str) -> None:
        self._model_write(model_id, "deleting a model's tag",
                          lambda c: (c.delete_logged_model_tag(model_id, key),
                                     c.get_logged_model(model_id))[1],
                          lambda m: _replace(m, tags={k: v for k, v in m.tags.items()
                                                      if k != key}))

    def log_logged_model_params(self, model_id: str, params: Any) -> None:
        param_map = {p.key: p.value for p in params or ()}
        self._model_write(model_id, "logging a model's params",
                          lambda c: (c.log_model_params(model_id, param_map),
                                     c.get_logged_model(model_id))[1],
                          lambda m: _replace(m, params={**m.params, **param_map}))

    def search_logged_models(self, experiment_ids: list[str], filter_string: str | None = None,
                             datasets: Any = None, max_results: int | None = None,
                             order_by: Any = None, page_token: str | None = None) -> Any:
        """Rank 0: the server's answer. Other ranks: the models this job logged, for the
        search MLflow itself makes when it lists a run's artifacts (by name, in the job's
        experiment); any other search is rank 0's."""
        job = self._job()
        if SESSION.logger() is not None:
            return self._server("searching logged models", lambda c: c.search_logged_models(
                experiment_ids, filter_string, datasets, max_results, order_by, page_token))
        match = _BY_NAME.fullmatch(filter_string or "")
        if experiment_ids != [job.target.experiment_id] or datasets or order_by or (
                filter_string and match is None):
            raise not_on_this_rank(SESSION.rank, "searching logged models",
                                   job.target.tracking_uri)
        from mlflow.store.entities.paged_list import PagedList

        return PagedList([self._local(job, m) for m in job.models.values()
                          if match is None or m.name == match.group(1)], None)

    def _model_write(self, model_id: str, what: str, call: Callable[[Any], Any],
                     local: Callable[[Any], Any]) -> Any:
        job = self._job()
        if model_id not in job.models:  # a model of another job: rank 0, on the server
            return self._server(what, call)
        model = (self._server(what, call) if SESSION.logger() is not None
                 else local(job.models[model_id]))
        job.models[model_id] = model
        return self._local(job, model)

    @staticmethod
    def _local(job: JobRun, model: Any) -> Any:
        """The model as MLflow in this rank sees it. Its real location where MLflow can
        write to it from here (a path, a bucket): that is also what a Model Registry
        reached from this rank records. Otherwise (a placeholder on ranks other than 0; a
        server's proxied ``mlflow-artifacts:`` location, which MLflow resolves against the
        tracking URI, here the job's) this job's artifact repository (:mod:`.artifacts`),
        which knows where the files really go; a registry behind that server resolves the
        model itself."""
        location = str(model.artifact_location or "")
        if location and not location.startswith("mlflow-artifacts:"):
            return model
        return _replace(model, artifact_location=model_root(job.target.run_id, model.model_id))


def _replace(model: Any, **changes: Any) -> Any:
    """A copy of an ``mlflow.entities.LoggedModel`` with ``changes``."""
    from mlflow.entities import LoggedModel

    fields = dict(
        experiment_id=model.experiment_id, model_id=model.model_id, name=model.name,
        artifact_location=model.artifact_location, creation_timestamp=model.creation_timestamp,
        last_updated_timestamp=model.last_updated_timestamp, model_type=model.model_type,
        source_run_id=model.source_run_id, status=model.status,
        status_message=model.status_message, tags=dict(model.tags or {}),
        params=dict(model.params or {}), metrics=model.metrics)
    fields.update(changes)
    return LoggedModel(**fields)


def _describe(records: Sequence[rec.Record]) -> str:
    kinds = sorted({type(r).__name__.lower() + "s" for r in records})
    return ", ".join(kinds)


class RankRegistry:
    """The Model Registry store of ranks other than 0 (``MLFLOW_REGISTRY_URI`` names the
    ``mlflow-hvd`` scheme there): every call says to use the registry from rank 0. Rank 0's
    registry URI is the driver's, so it reaches the real registry."""

    def __init__(self, store_uri: str, tracking_uri: str | None = None) -> None:
        self.uri = store_uri

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        target = SESSION.target
        raise not_on_this_rank(SESSION.rank, f"the Model Registry ({name})",
                               target.registry_uri or target.tracking_uri if target else "")

"""Rank side: the job's run as this rank logged it, so that every rank answers MLflow's
reads of it (``get_run``, ``active_run().info``, a metric's history, a model the job logged)
without asking the tracking server: during an outage, and on ranks without credentials.

It starts from what the driver read before the job (:class:`~mlflow_hvd.protocol.messages.
RunFacts`: params and the program's tags) and adds what this rank logs during the job,
through MLflow (:mod:`.store`) or :mod:`mlflow_hvd.tracking`. Rank 0 delivers those writes;
the other ranks only keep them here, so that code which reads back what it logged runs the
same on every rank. Metric values are kept as given (a tensor from
:mod:`mlflow_hvd.tracking` is converted when read), one small tuple each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.messages import TrackingTarget

_SYSTEM_PREFIX = "mlflow."


class JobRun:
    """One job's run on one rank (see the module docstring); thread-safe."""

    def __init__(self, target: TrackingTarget, rank: int) -> None:
        self.target, self.rank = target, rank
        self._lock = threading.Lock()
        facts = target.facts
        self.params: dict[str, str] = dict(facts.params) if facts else {}
        self.tags: dict[str, str] = dict(facts.source_tags) if facts else {}
        if target.run_name:
            self.tags.setdefault("mlflow.runName", target.run_name)
        self._metrics: dict[str, list[rec.Metric]] = {}
        self._datasets: dict[tuple[str, str], rec.Dataset] = {}
        self._model_inputs: list[str] = []
        self._model_outputs: list[tuple[str, int]] = []
        self.models: dict[str, Any] = {}  # model id -> LoggedModel, as MLflow was answered
        self.start_time = target.start_time or int(time.time() * 1000)

    # --- what was logged ----------------------------------------------------------------
    def add(self, records: Iterable[rec.Record]) -> None:
        with self._lock:
            for r in records:
                if isinstance(r, rec.Metric):
                    self._metrics.setdefault(r.key, []).append(r)
                elif isinstance(r, rec.Param):
                    self.params.setdefault(r.key, r.value)
                elif isinstance(r, rec.Tag):
                    self.tags[r.key] = r.value
                elif isinstance(r, rec.Commit):
                    self.add_unlocked(r.metrics)
                    self.tags.update((t.key, t.value) for t in r.tags)
                elif isinstance(r, rec.Inputs):
                    for d in r.datasets:
                        self._datasets.setdefault((d.name, d.digest), d)
                    self._model_inputs.extend(m for m in r.models
                                              if m not in self._model_inputs)
                elif isinstance(r, rec.Outputs):
                    self._model_outputs.extend(m for m in r.models
                                               if m not in self._model_outputs)

    def add_unlocked(self, metrics: Iterable[rec.Metric]) -> None:
        for m in metrics:
            self._metrics.setdefault(m.key, []).append(m)

    def delete_tag(self, key: str) -> None:
        with self._lock:
            self.tags.pop(key, None)

    def user_tags(self, tags: dict[str, str]) -> dict[str, str]:
        """Of the tags ``mlflow.start_run`` resolves for a new run, those the user gave (not
        MLflow's own ``mlflow.*`` context: the driver's run already has the program's)."""
        return {k: v for k, v in tags.items()
                if not k.startswith(_SYSTEM_PREFIX) or k == "mlflow.note.content"}

    # --- MLflow's view ------------------------------------------------------------------
    def run(self) -> Any:
        """The run as ``mlflow.entities.Run``: RUNNING (the driver ends it with the job)."""
        from mlflow.entities import (
            Dataset,
            DatasetInput,
            InputTag,
            LoggedModelInput,
            LoggedModelOutput,
            Metric,
            Param,
            Run,
            RunData,
            RunInputs,
            RunOutputs,
            RunTag,
        )

        with self._lock:
            latest = {k: max(v, key=lambda m: (m.step, m.timestamp))
                      for k, v in self._metrics.items() if v}
            data = RunData(
                metrics=[Metric(m.key, float(m.value), m.timestamp, m.step)
                         for m in latest.values()],
                params=[Param(k, v) for k, v in self.params.items()],
                tags=[RunTag(k, v) for k, v in self.tags.items()])
            inputs = RunInputs(
                dataset_inputs=[DatasetInput(Dataset(d.name, d.digest, d.source_type, d.source,
                                                     d.schema, d.profile),
                                             [InputTag(k, v) for k, v in d.tags])
                                for d in self._datasets.values()],
                model_inputs=[LoggedModelInput(m) for m in self._model_inputs])
            outputs = RunOutputs([LoggedModelOutput(m, s) for m, s in self._model_outputs])
        return Run(self.info(), data, inputs, outputs)

    def info(self) -> Any:
        from mlflow.entities import RunInfo

        t = self.target
        return RunInfo(run_id=t.run_id, experiment_id=t.experiment_id, user_id=t.user_id,
                       status="RUNNING", start_time=self.start_time, end_time=None,
                       lifecycle_stage="active", artifact_uri=artifact_root(t.run_id),
                       run_name=t.run_name or None)

    def history(self, key: str) -> list[Any]:
        from mlflow.entities import Metric

        with self._lock:
            values = list(self._metrics.get(key, ()))
        return [Metric(m.key, float(m.value), m.timestamp, m.step, model_id=m.model_id,
                       dataset_name=m.dataset_name, dataset_digest=m.dataset_digest,
                       run_id=self.target.run_id) for m in values]


ARTIFACT_SCHEME = "mlflow-hvd-artifacts"


def artifact_root(run_id: str) -> str:
    """Where MLflow uploads the job's run artifacts from a rank (:mod:`.artifacts`)."""
    return f"{ARTIFACT_SCHEME}://{run_id}/run"


def model_root(run_id: str, model_id: str) -> str:
    """Where MLflow uploads a logged model's files from a rank (:mod:`.artifacts`)."""
    return f"{ARTIFACT_SCHEME}://{run_id}/models/{model_id}"

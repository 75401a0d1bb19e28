"""Tracking records: the typed, ordered, replayable form of everything rank 0 logs, and the
one codec that writes them to disk.

Records are frozen dataclasses: :class:`Metric` (with the ``model_id`` and dataset MLflow
passes), :class:`Param`, :class:`Tag` (sent in ``log_batch`` calls, within MLflow's limits
per call), :class:`Artifact` (a file uploaded to a directory of the run), :class:`Commit`
(metrics and tags in one ``log_batch``: a checkpoint's metrics and its latest-checkpoint
tag, both or neither), :class:`Inputs` (datasets and models the run used, ``log_inputs``),
:class:`Outputs` (models it produced, ``log_outputs``) and :class:`Status` (end the run;
only in a saved bundle). They cross process boundaries pickled (rank 0 to
the driver) and are written to disk by :func:`encode` / :func:`decode`, one JSON line each,
in files that start with :func:`header` (rank 0's spill file and the driver's replay
bundle): a file of another format version is refused by name, and a file without a header
(bundles saved before the header existed) is read as version 1, whose lines it shares.

Sending a record twice is harmless: MLflow keeps one copy of an identical metric value
(same key, value, timestamp and step), an identical param, tag or artifact. That is what
lets a batch whose answer was lost be sent again, and a saved bundle be replayed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

FORMAT = "mlflow_hvd.records"
VERSION = 2  # 2: metrics may carry model_id and dataset; inputs and outputs records
READS = (1, 2)  # version 1 files (no model ids, no inputs/outputs) read as they are
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100


@dataclass(frozen=True)
class Metric:
    """One metric value. ``value`` may be a tensor until the delivery thread converts it
    (:meth:`converted`), off the training thread."""

    kind: ClassVar[str] = "metric"
    key: str
    value: Any
    timestamp: int
    step: int
    model_id: str | None = None  # the LoggedModel the value measures (MLflow 3)
    dataset_name: str | None = None  # the dataset it was computed on (both or neither)
    dataset_digest: str | None = None

    def converted(self) -> Metric:
        if type(self.value) is float:
            return self
        return dataclasses.replace(self, value=float(self.value))


@dataclass(frozen=True)
class Param:
    kind: ClassVar[str] = "param"
    key: str
    value: str


@dataclass(frozen=True)
class Tag:
    kind: ClassVar[str] = "tag"
    key: str
    value: str


@dataclass(frozen=True)
class Artifact:
    """A file to upload: ``path`` on this host (in a bundle: relative to it) into the run's
    directory ``artifact_dir`` ("" for the root)."""

    kind: ClassVar[str] = "artifact"
    path: str
    artifact_dir: str


@dataclass(frozen=True)
class Commit:
    """Metrics and tags written in one call: both land, or neither.

    A checkpoint's commit (the latest-checkpoint tag) also says which ``epoch`` it makes
    resumable and whether the training loop called it its ``last`` (None: it did not say);
    once it is written, rank 0 tells the driver so
    (:class:`~mlflow_hvd.protocol.messages.CheckpointCommitted`). Neither is part of the
    written record (:func:`encode`): a replayed commit tells no one."""

    kind: ClassVar[str] = "commit"
    metrics: tuple[Metric, ...]
    tags: tuple[Tag, ...]
    epoch: int | None = None
    last: bool | None = None


@dataclass(frozen=True)
class Dataset:
    """A dataset the run used, as MLflow describes it (``mlflow.entities.Dataset``) with the
    input's tags (e.g. ``mlflow.data.context``)."""

    name: str
    digest: str
    source_type: str
    source: str
    schema: str | None = None
    profile: str | None = None
    tags: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Inputs:
    """Datasets and models (by id) the run used: one ``log_inputs`` call."""

    kind: ClassVar[str] = "inputs"
    datasets: tuple[Dataset, ...] = ()
    models: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outputs:
    """Models (id, step) the run produced: one ``log_outputs`` call."""

    kind: ClassVar[str] = "outputs"
    models: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Status:
    """End the run with ``status`` (FINISHED, FAILED, KILLED)."""

    kind: ClassVar[str] = "status"
    status: str


Record = Metric | Param | Tag | Artifact | Commit | Inputs | Outputs | Status
BATCHED = (Metric, Param, Tag)


def next_batch(records: Sequence[Record]) -> int:
    """How many records from the head of ``records`` go in the next call (at least one).

    A run of metric/param/tag records is batched up to MLflow's per-call limits; any other
    record is sent alone, in order.
    """
    if not records:
        return 0
    if not isinstance(records[0], BATCHED):
        return 1
    counts = {Metric: 0, Param: 0, Tag: 0}
    limits = {Metric: MAX_METRICS, Param: MAX_PARAMS, Tag: MAX_TAGS}
    n = 0
    params: set[str] = set()
    for record in records:
        kind = type(record)
        if not isinstance(record, BATCHED) or counts[kind] >= limits[kind]:
            break
        if isinstance(record, Param):
            if record.key in params:
                break  # the same param twice in one call is refused by some stores
            params.add(record.key)
        counts[kind] += 1
        n += 1
    return n


def send(client: Any, run_id: str, batch: Sequence[Record], artifacts: Any = None) -> None:
    """Make the MLflow call(s) for ``batch`` (a result of :func:`next_batch`): with
    ``client``, an ``MlflowClient``, and for artifact files with ``artifacts``, the run's
    artifact repository, when given (in a rank, MLflow's per-run cache of repositories
    holds the job's own, :mod:`mlflow_hvd.rank.tracking.artifacts`)."""
    from mlflow.entities import Metric as MlflowMetric
    from mlflow.entities import Param as MlflowParam
    from mlflow.entities import RunTag

    def metric(m: Metric) -> Any:
        return MlflowMetric(m.key, float(m.value), int(m.timestamp), int(m.step),
                            model_id=m.model_id, dataset_name=m.dataset_name,
                            dataset_digest=m.dataset_digest)

    head = batch[0]
    if isinstance(head, BATCHED):
        client.log_batch(
            run_id,
            metrics=[metric(r) for r in batch if isinstance(r, Metric)],
            params=[MlflowParam(r.key, r.value) for r in batch if isinstance(r, Param)],
            tags=[RunTag(r.key, r.value) for r in batch if isinstance(r, Tag)],
            synchronous=True,
        )
    elif isinstance(head, Artifact):
        if artifacts is not None:
            artifacts.log_artifact(head.path, head.artifact_dir or None)
        else:
            client.log_artifact(run_id, head.path, head.artifact_dir or None)
    elif isinstance(head, Commit):
        client.log_batch(run_id, metrics=[metric(m) for m in head.metrics],
                         tags=[RunTag(t.key, t.value) for t in head.tags], synchronous=True)
    elif isinstance(head, Inputs):
        from mlflow.entities import Dataset as MlflowDataset
        from mlflow.entities import DatasetInput, InputTag, LoggedModelInput

        client.log_inputs(
            run_id,
            datasets=[DatasetInput(MlflowDataset(d.name, d.digest, d.source_type, d.source,
                                                 d.schema, d.profile),
                                   [InputTag(k, v) for k, v in d.tags]) for d in head.datasets],
            models=[LoggedModelInput(m) for m in head.models])
    elif isinstance(head, Outputs):
        from mlflow.entities import LoggedModelOutput

        client.log_outputs(run_id, [LoggedModelOutput(m, step) for m, step in head.models])
    elif isinstance(head, Status):
        client.set_terminated(run_id, head.status)
    else:
        raise TypeError(f"not a tracking record: {head!r}")


def count(records: Iterable[Record]) -> dict[str, int]:
    """Values per kind: ``metric``, ``param``, ``tag``, ``artifact``, ``inputs``,
    ``outputs``, ``status`` (a commit counts its metrics and tags)."""
    out = {"metric": 0, "param": 0, "tag": 0, "artifact": 0, "inputs": 0, "outputs": 0,
           "status": 0}
    for r in records:
        if isinstance(r, Commit):
            out["metric"] += len(r.metrics)
            out["tag"] += len(r.tags)
        else:
            out[r.kind] += 1
    return out


def describe(counts: dict[str, int]) -> str:
    """``12 metric values, 1 param, 2 tags and 1 artifact file``."""
    names = {"metric": ("metric value", "metric values"), "param": ("param", "params"),
             "tag": ("tag", "tags"), "artifact": ("artifact file", "artifact files"),
             "inputs": ("input record", "input records"),
             "outputs": ("output record", "output records"),
             "status": ("run status", "run statuses")}
    parts = [f"{n} {names[k][n != 1]}" for k, n in counts.items() if n and k in names]
    if not parts:
        return "nothing"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


# --- the codec ---------------------------------------------------------------------------
def header() -> str:
    """The first line of a file of records (no newline)."""
    return json.dumps({"format": FORMAT, "version": VERSION})


def check_header(line: str, where: str) -> bool:
    """True if ``line`` is a header of this format and version; False if it is a record
    (a file from before headers: version 1).

    Raises:
        ValueError: A header of another format or version, naming ``where``.
    """
    value = json.loads(line)
    if isinstance(value, list):
        return False
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        raise ValueError(f"{where} is not a file of mlflow_hvd tracking records")
    if value.get("version") not in READS:
        raise ValueError(
            f"{where} holds tracking records of format version {value.get('version')!r}; "
            f"this mlflow_hvd reads versions {', '.join(map(str, READS))}: replay it with the "
            "mlflow_hvd that wrote it"
        )
    return True


def encode(record: Record) -> str:
    """One record as one JSON line (no newline)."""
    if isinstance(record, Metric):
        fields: list[Any] = _metric_fields(record)
    elif isinstance(record, Param | Tag):
        fields = [record.key, record.value]
    elif isinstance(record, Artifact):
        fields = [record.path, record.artifact_dir]
    elif isinstance(record, Commit):
        fields = [[_metric_fields(m) for m in record.metrics],
                  [[t.key, t.value] for t in record.tags]]
    elif isinstance(record, Inputs):
        fields = [[[d.name, d.digest, d.source_type, d.source, d.schema, d.profile,
                    [list(t) for t in d.tags]] for d in record.datasets], list(record.models)]
    elif isinstance(record, Outputs):
        fields = [[list(m) for m in record.models]]
    else:
        fields = [record.status]
    return json.dumps([record.kind, *fields], allow_nan=True)


def decode(line: str) -> Record:
    """The record of one line written by :func:`encode`.

    Raises:
        ValueError: Not such a line (the first 200 characters are quoted).
    """
    try:
        kind, *f = json.loads(line)
        if kind == "metric":
            return _metric(f)
        if kind == "param":
            return Param(str(f[0]), str(f[1]))
        if kind == "tag":
            return Tag(str(f[0]), str(f[1]))
        if kind == "artifact":
            return Artifact(str(f[0]), str(f[1] or ""))
        if kind == "commit":
            return Commit(tuple(_metric(m) for m in f[0]),
                          tuple(Tag(str(k), str(v)) for k, v in f[1]))
        if kind == "inputs":
            return Inputs(tuple(Dataset(str(d[0]), str(d[1]), str(d[2]), str(d[3]), d[4], d[5],
                                        tuple((str(k), str(v)) for k, v in d[6]))
                                for d in f[0]), tuple(str(m) for m in f[1]))
        if kind == "outputs":
            return Outputs(tuple((str(m), int(s)) for m, s in f[0]))
        if kind == "status":
            return Status(str(f[0]))
    except (ValueError, TypeError, IndexError) as exc:
        raise ValueError(f"not a tracking record: {line[:200]!r}") from exc
    raise ValueError(f"not a tracking record: {line[:200]!r}")


def _metric_fields(m: Metric) -> list[Any]:
    fields: list[Any] = [m.key, float(m.value), m.timestamp, m.step]
    if m.model_id is not None or m.dataset_name is not None:
        fields += [m.model_id, m.dataset_name, m.dataset_digest]
    return fields


def _metric(f: list[Any]) -> Metric:
    extra = [None if v is None else str(v) for v in f[4:7]] + [None] * (7 - max(len(f), 4))
    return Metric(str(f[0]), float(f[1]), int(f[2]), int(f[3]), *extra[:3])

"""Tracking records: the ordered, replayable form of everything rank 0 logs.

One record is a JSON-able list:

* ``["metric", key, value, timestamp_ms, step]``, ``["param", key, value]``,
  ``["tag", key, value]``: sent in ``log_batch`` calls (MLflow's limits per call);
* ``["artifact", local_path, artifact_dir]``: a file uploaded to ``artifact_dir``;
* ``["commit", [[key, value, ts, step], ...], [[key, value], ...]]``: metrics and tags in
  one ``log_batch`` (a checkpoint's metrics and its latest-checkpoint tag: both or neither);
* ``["status", status]``: end the run (``set_terminated``), only in a saved bundle.

Sending a record twice is harmless: MLflow keeps one copy of an identical metric value
(same key, value, timestamp and step), an identical param, tag or artifact. That is what
lets a batch whose answer was lost be sent again, and a saved bundle be replayed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Record = list[Any]
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100
BATCHED = ("metric", "param", "tag")


def next_batch(records: Sequence[Record]) -> int:
    """How many records from the head of ``records`` go in the next call (at least one).

    A run of metric/param/tag records is batched up to MLflow's per-call limits; any other
    record is sent alone, in order.
    """
    if not records:
        return 0
    if records[0][0] not in BATCHED:
        return 1
    counts = {"metric": 0, "param": 0, "tag": 0}
    limits = {"metric": MAX_METRICS, "param": MAX_PARAMS, "tag": MAX_TAGS}
    n = 0
    params: set[str] = set()
    for record in records:
        kind = record[0]
        if kind not in BATCHED or counts[kind] >= limits[kind]:
            break
        if kind == "param":
            if record[1] in params:
                break  # the same param twice in one call is refused by some stores
            params.add(record[1])
        counts[kind] += 1
        n += 1
    return n


def send(client: Any, run_id: str, batch: Sequence[Record]) -> None:
    """Make the MLflow call(s) for ``batch`` (a result of :func:`next_batch`)."""
    from mlflow.entities import Metric, Param, RunTag

    kind = batch[0][0]
    if kind in BATCHED:
        client.log_batch(
            run_id,
            metrics=[
                Metric(r[1], float(r[2]), int(r[3]), int(r[4])) for r in batch if r[0] == "metric"
            ],
            params=[Param(r[1], r[2]) for r in batch if r[0] == "param"],
            tags=[RunTag(r[1], r[2]) for r in batch if r[0] == "tag"],
            synchronous=True,
        )
    elif kind == "artifact":
        client.log_artifact(run_id, batch[0][1], batch[0][2] or None)
    elif kind == "commit":
        _, metrics, tags = batch[0]
        client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in metrics],
            tags=[RunTag(k, v) for k, v in tags],
            synchronous=True,
        )
    elif kind == "status":
        client.set_terminated(run_id, batch[0][1])
    else:
        raise ValueError(f"unknown tracking record {batch[0]!r}")


def count(records: Sequence[Record]) -> dict[str, int]:
    """Values per kind: ``metric``, ``param``, ``tag``, ``artifact`` (commits count their
    metrics and tags)."""
    out = {"metric": 0, "param": 0, "tag": 0, "artifact": 0, "status": 0}
    for r in records:
        if r[0] == "commit":
            out["metric"] += len(r[1])
            out["tag"] += len(r[2])
        else:
            out[r[0]] = out.get(r[0], 0) + 1
    return out


def describe(counts: dict[str, int]) -> str:
    """``12 metric values, 1 param, 2 tags and 1 artifact file``."""
    names = {"metric": ("metric value", "metric values"), "param": ("param", "params"),
             "tag": ("tag", "tags"), "artifact": ("artifact file", "artifact files"),
             "status": ("run status", "run statuses")}
    parts = [f"{n} {names[k][n != 1]}" for k, n in counts.items() if n and k in names]
    if not parts:
        return "nothing"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def dumps(record: Record) -> str:
    return json.dumps(record, allow_nan=True)


def loads(line: str) -> Record:
    value = json.loads(line)
    if not isinstance(value, list) or not value:
        raise ValueError(f"not a tracking record: {line[:200]!r}")
    return value

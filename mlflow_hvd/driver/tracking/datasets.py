"""Driver side: the job's DataFrames recorded as the run's MLflow dataset inputs
(``mlflow.data.from_spark``: name, digest, schema, source), with the exact split the tasks
agreed on as their profile (rows, rows per rank, rows dropped), under the context
``training``, ``validation`` or ``test`` read from the argument's name."""

from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from mlflow_hvd.common import mlflow_private
from mlflow_hvd.driver.feed import Feed
from mlflow_hvd.protocol.feed import Agreed
from mlflow_hvd.protocol.messages import FeedAgreed

log = logging.getLogger(__name__)


def context_of(argument: str) -> str:
    """``validation`` for a name with "val" or "eval" in it, ``test`` with "test", else
    ``training`` (MLflow's dataset contexts, shown in the UI's Datasets panel)."""
    name = argument.lower()
    if "val" in name or "eval" in name:
        return "validation"
    if "test" in name:
        return "test"
    return "training"


def _source_path(frame: Any) -> str | None:
    """The directory the DataFrame's files are in, when it reads files (else None: MLflow
    then records the code that built it)."""
    try:
        files = frame.inputFiles()
    except Exception:  # not every plan can list its files (e.g. Spark Connect, in memory)
        return None
    if not files:
        return None
    dirs = [os.path.dirname(f.removeprefix("file:")) for f in files]
    common = os.path.commonpath(dirs) if all(d.startswith("/") for d in dirs) else dirs[0]
    return ("file:" + common) if files[0].startswith("file:") else common


def dataset_input(argument: str, frame: Any, split: Agreed) -> Any:
    """The ``DatasetInput`` of one argument (no Spark job: the digest is the plan's hash,
    the row counts come from the feed)."""
    from mlflow.data.spark_dataset import from_spark
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    with warnings.catch_warnings():  # its hint on integer columns is about model schemas
        warnings.simplefilter("ignore", UserWarning)
        dataset = from_spark(frame, path=_source_path(frame), name=argument)
        schema = dataset.schema
    entity = Dataset(
        name=dataset.name,
        digest=dataset.digest,
        source_type=mlflow_private.dataset_source_type(dataset.source),
        source=dataset.source.to_json(),
        schema=json.dumps({"mlflow_colspec": schema.to_dict()}) if schema else None,
        profile=json.dumps({"num_rows": split.total, "ranks": len(split.partition_rows),
                            "rows_per_rank": split.rows, "dropped_rows": split.dropped}),
    )
    return DatasetInput(entity, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context_of(argument))])


def recorder(feed: Feed, run_ids: Sequence[str]) -> Callable[[FeedAgreed], None]:
    """What records ``feed``'s DataFrames in ``run_ids`` once the split is known: in a
    thread of its own, so the channel that delivered the split is not held up by the
    tracking server. A failure is a warning: the job goes on without the record."""

    def record(split: FeedAgreed) -> None:
        import mlflow

        try:
            by_argument = {a.argument: a for a in split.arguments}
            inputs = [dataset_input(argument, frame, by_argument[argument])
                      for argument, frame in feed.frames]
            client = mlflow.MlflowClient()
            for run_id in run_ids:
                client.log_inputs(run_id, datasets=inputs)
        except Exception as exc:
            log.warning("mlflow_hvd: the DataFrames %s could not be recorded as dataset "
                        "inputs of run(s) %s: %s: %s", [a for a, _ in feed.frames],
                        ", ".join(run_ids), type(exc).__name__, exc)

    def on_fed(split: FeedAgreed) -> None:
        threading.Thread(target=record, args=(split,), name="mlflow-hvd-datasets",
                         daemon=True).start()

    return on_fed

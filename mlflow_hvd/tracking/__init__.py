"""Rank side (inside the training function): MLflow tracking where rank 0 writes into the
job's run and every other rank does nothing (the one gate is :func:`is_logging_rank`).

``__all__`` is what training code calls. ``commit``, ``configure``, ``shutdown`` and
``tracking_target`` stay importable for mlflow_hvd's own layers (the worker entry point,
the Keras and PyTorch callbacks) but are not for user code.

This is the public face of :mod:`mlflow_hvd.rank.tracking.api`; the driver's side (the run
it owns and ends, the writes it makes for rank 0, what it saves during an outage) lives in
:mod:`mlflow_hvd.driver.tracking`. Saved bundles are sent with
``python -m mlflow_hvd.tracking.replay BUNDLE``.
"""

from mlflow_hvd.rank.tracking.api import (
    commit as commit,
)
from mlflow_hvd.rank.tracking.api import (
    configure as configure,
)
from mlflow_hvd.rank.tracking.api import (
    flush,
    is_logging_rank,
    log_artifact,
    log_artifacts,
    log_batch_metrics,
    log_dict,
    log_metric,
    log_metrics,
    log_model,
    log_param,
    log_params,
    max_logged_step,
    run_id,
    server_uri,
    set_tag,
    set_tags,
)
from mlflow_hvd.rank.tracking.api import (
    shutdown as shutdown,
)
from mlflow_hvd.rank.tracking.api import (
    tracking_target as tracking_target,
)
from mlflow_hvd.rank.tracking.pruning import should_prune, was_pruned

__all__ = [
    "flush",
    "is_logging_rank",
    "log_artifact",
    "log_artifacts",
    "log_batch_metrics",
    "log_dict",
    "log_metric",
    "log_metrics",
    "log_model",
    "log_param",
    "log_params",
    "max_logged_step",
    "run_id",
    "server_uri",
    "set_tag",
    "set_tags",
    "should_prune",
    "was_pruned",
]

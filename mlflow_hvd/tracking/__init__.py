"""MLflow tracking from inside a training function: rank 0 writes into the job's run, every
other rank does nothing (the one gate is :func:`is_logging_rank`).

This is the public face of :mod:`mlflow_hvd.rank.tracking.api`; the driver's side (the run
it owns and ends, the writes it makes for rank 0, what it saves during an outage) lives in
:mod:`mlflow_hvd.driver.tracking`. Saved bundles are sent with
``python -m mlflow_hvd.tracking.replay BUNDLE``.
"""

from mlflow_hvd.rank.tracking.api import (
    commit,
    configure,
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
    set_tag,
    set_tags,
    shutdown,
    tracking_target,
)
from mlflow_hvd.rank.tracking.pruning import should_prune, was_pruned

__all__ = [
    "commit",
    "configure",
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
    "set_tag",
    "set_tags",
    "should_prune",
    "shutdown",
    "tracking_target",
    "was_pruned",
]

"""MLflow tracking of a distributed job: one run, owned by the driver, written by rank 0.

Where each part runs:

* :mod:`.driver_run` - **driver**: resolves or starts the run, tags it, ends it with the
  true status (FINISHED / FAILED / KILLED).
* :mod:`.rank_logger` - **rank 0**: the asynchronous logger behind the functions below;
  every other rank is a no-op (the one gate is :func:`is_logging_rank`).
* :mod:`.checkpoints` - **rank 0**: checkpoints as artifacts in MLflow's own layout.

Training code uses the functions re-exported here (``from mlflow_hvd import tracking``).
"""

from mlflow_hvd.tracking.rank_logger import (
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
    "shutdown",
    "tracking_target",
]

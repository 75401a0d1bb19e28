"""mlflow_hvd: distributed PyTorch (torch.distributed) and TensorFlow/Keras or PyTorch with
Horovod on Spark, tracked in MLflow.

``HorovodRunner(np=...)`` is an open, working take on Databricks' HorovodRunner API;
``TorchDistributor`` takes pyspark's arguments. Neither Horovod nor TensorFlow is imported
unless the training function does (``pip install mlflow_hvd[torch]`` runs torch.distributed
code without them).

Package map (docs/architecture.md lists every module): ``runner`` (public API),
``driver/``, ``backends/``, ``sweep/`` and ``cli/`` run in the user's process (the driver);
``agent/`` hosts one rank's process on its host (``agent/spark_task.py`` in a Spark barrier
task on an executor); ``rank/`` runs inside that process; ``tracking/``, ``keras/``,
``torch/`` and ``data`` are what training code calls there; ``common/``, ``protocol/`` and
``errors`` are shared by every side.

Attributes are imported lazily, so a rank's ``import mlflow_hvd`` does not pull in the
driver stack (Spark, the channel's server).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow_hvd.common.config import ClusterConfig, JobConfig, TrackingConfig
    from mlflow_hvd.common.horovod_env import HorovodOptions
    from mlflow_hvd.distributor import TorchDistributor
    from mlflow_hvd.errors import (
        AuthenticationError,
        BackendError,
        ChannelError,
        ConfigurationError,
        IncompatibleImportError,
        InsufficientSlotsError,
        JobStopped,
        MlflowHvdError,
        RankFailure,
        RetriesExhaustedError,
        RunTimeoutError,
        SparkBarrierUnsupportedError,
        StartTimeoutError,
        Terminated,
        TrackingError,
        UnsupportedVersionError,
        WorkerFailedError,
    )
    from mlflow_hvd.rank.context import attempt, log_to_driver
    from mlflow_hvd.runner import HorovodRunner

__version__ = "0.1.0"

from mlflow_hvd.common import logs as _logs

_logs.from_env()  # MLFLOW_HVD_LOG_LEVEL=INFO shows the lifecycle log
enable_logging = _logs.enable

__all__ = [
    "AuthenticationError",
    "BackendError",
    "ChannelError",
    "ClusterConfig",
    "ConfigurationError",
    "HorovodOptions",
    "HorovodRunner",
    "IncompatibleImportError",
    "InsufficientSlotsError",
    "JobConfig",
    "JobStopped",
    "MlflowHvdError",
    "RankFailure",
    "RetriesExhaustedError",
    "RunTimeoutError",
    "SparkBarrierUnsupportedError",
    "StartTimeoutError",
    "Terminated",
    "TorchDistributor",
    "TrackingConfig",
    "TrackingError",
    "UnsupportedVersionError",
    "WorkerFailedError",
    "attempt",
    "enable_logging",
    "log_to_driver",
]
_WHERE = {
    **{name: "mlflow_hvd.errors" for name in __all__
       if name not in ("enable_logging", "TorchDistributor")},
    **{name: "mlflow_hvd.common.config"
       for name in ("ClusterConfig", "JobConfig", "TrackingConfig")},
    "HorovodOptions": "mlflow_hvd.common.horovod_env",
    "HorovodRunner": "mlflow_hvd.runner",
    "TorchDistributor": "mlflow_hvd.distributor",
    "log_to_driver": "mlflow_hvd.rank.context",
    "attempt": "mlflow_hvd.rank.context",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'mlflow_hvd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])

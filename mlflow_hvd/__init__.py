"""mlflow_hvd: distributed TensorFlow/Keras training with Horovod on Spark, tracked in MLflow.

``HorovodRunner(np=...)`` is an open, working take on Databricks' HorovodRunner API.
"""

from mlflow_hvd.context import log_to_driver
from mlflow_hvd.errors import (
    AuthenticationError,
    BackendError,
    ChannelError,
    ConfigurationError,
    InsufficientSlotsError,
    MlflowHvdError,
    RankFailure,
    RunTimeoutError,
    SparkBarrierUnsupportedError,
    StartTimeoutError,
    WorkerFailedError,
)
from mlflow_hvd.runner import HorovodRunner

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "BackendError",
    "ChannelError",
    "ConfigurationError",
    "HorovodRunner",
    "InsufficientSlotsError",
    "MlflowHvdError",
    "RankFailure",
    "RunTimeoutError",
    "SparkBarrierUnsupportedError",
    "StartTimeoutError",
    "WorkerFailedError",
    "log_to_driver",
]

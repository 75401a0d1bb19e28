"""Launch backends: local processes on the driver, and Spark barrier tasks."""

from mlflow_hvd.backends.base import Backend, JobSpec

__all__ = ["Backend", "JobSpec"]

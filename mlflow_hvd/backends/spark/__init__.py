"""Spark backend (``np > 0``): one barrier-mode stage of np tasks, one rank per task.

* :mod:`.backend` and :mod:`.session` run on the driver: choose the session, check it can
  run the stage, submit it under a job group, cancel it.
* :mod:`.task` runs on the executors: the body of one barrier task.
"""

from mlflow_hvd.backends.spark.backend import SparkBackend

__all__ = ["SparkBackend"]

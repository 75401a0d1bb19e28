"""Spark backend (``np > 0``): one barrier-mode stage of np tasks, one rank per task.

* :mod:`.placement` is where a runner's jobs run: the session given, or the one
  :mod:`.boot` chooses and starts (:mod:`.session`, :mod:`.master`);
* :mod:`.backend` runs one generation: checks the session can run the stage, submits it
  under a job group (an operation tag on Spark Connect, :mod:`.api`), cancels it;
* :mod:`.environment` and :mod:`.jvm` ship environments and prepare executors;
  :mod:`.failures` turns Spark's errors into messages.

The body of each barrier task, on the executors, is :mod:`mlflow_hvd.agent.spark_task`.
"""

from mlflow_hvd.backends.spark.backend import SparkBackend

__all__ = ["SparkBackend"]

"""Helpers every side uses (driver, host agent, rank): deadlines, process-tree control,
per-process scratch directories, option validators, the Horovod rank layout and the
tracking server's reachability. Imports nothing of the package but :mod:`mlflow_hvd.errors`
and :mod:`mlflow_hvd.protocol`."""

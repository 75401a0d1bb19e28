"""The agent: starts one rank's worker process next to it, relays its output, reports its exit.

It runs wherever a rank is hosted: in a driver thread for local processes (``np < 0``),
inside a Spark barrier task on an executor (``np > 0``). The rank's own code is in
:mod:`mlflow_hvd.rank`.
"""

from mlflow_hvd.agent.process import WorkerLaunch, run_worker
from mlflow_hvd.agent.staging import staged_payload, worker_launch

__all__ = ["WorkerLaunch", "run_worker", "staged_payload", "worker_launch"]

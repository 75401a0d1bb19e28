"""Driver side: what runs in the user's process while a job is on.

* :mod:`.pool` runs jobs on generations of ranks, cold or warm; :mod:`.generation` is one
  generation's servers, backend and answers, from set-up to tear-down; :mod:`.job` is one
  job as the driver runs it;
* :mod:`.supervisor` consumes a job's messages, owns every deadline and decides the
  outcome (a :class:`~.supervisor.JobState` machine);
* :mod:`.routing` sends each message and request to whoever handles it;
* :mod:`.rendezvous` wraps horovod's own Gloo rendezvous server;
* :mod:`.payload` cloudpickles what every rank runs; :mod:`.options` checks the runner's
  options.
"""

from mlflow_hvd.driver.job import Job, new_job_id
from mlflow_hvd.driver.pool import RankPool
from mlflow_hvd.driver.supervisor import DriverSettings, Verbosity

__all__ = ["DriverSettings", "Job", "RankPool", "Verbosity", "new_job_id"]

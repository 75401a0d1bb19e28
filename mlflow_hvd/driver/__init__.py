"""Driver side: what runs in the user's process while a job is on.

* :mod:`.job` starts the channel and rendezvous servers and the backend, and always stops
  them;
* :mod:`.supervisor` consumes the job's messages, owns every deadline and decides the
  outcome (a :class:`~.supervisor.JobState` machine);
* :mod:`.rendezvous` wraps horovod's own Gloo rendezvous server;
* :mod:`.payload` cloudpickles what every rank runs.
"""

from mlflow_hvd.driver.job import new_job_id, resolve_host, run_job
from mlflow_hvd.driver.supervisor import DriverSettings, Verbosity

__all__ = ["DriverSettings", "Verbosity", "new_job_id", "resolve_host", "run_job"]

"""The parts of Horovod's launcher (``horovod.runner``) mlflow_hvd builds on, imported in one
place: where Horovod is missing or of another version, the import fails with the version
found and the command that installs the right one, not a ``ModuleNotFoundError`` from deep
inside the driver.

None of them is Horovod's documented API, whose only launchers are ``horovodrun`` and
``horovod.spark.run`` (which need ssh or MPI, or own the Spark job): a runner that starts the
ranks itself uses what ``horovodrun --gloo`` runs inside. Each was checked on Horovod 0.28.1,
the one release supported (its last; :mod:`mlflow_hvd.common.compat` refuses others):

* ``get_host_assignments``, ``HostInfo``, ``SlotInfo``: the rank layout (``local_rank``,
  ``cross_rank``, ...) exactly as ``horovodrun`` computes it (:mod:`.layout`);
* ``create_run_env_vars``, ``create_slot_env_vars``: the ``HOROVOD_*`` variables each Gloo
  rank reads in ``hvd.init()``;
* ``RendezvousHTTPServer``, ``RendezvousHandler``: Horovod's own Gloo rendezvous server
  (``mlflow_hvd.driver.rendezvous`` runs it on the driver);
* ``config_parser``: the ``HOROVOD_*`` tuning variables ``horovodrun``'s flags become
  (:mod:`.horovod_env`).
"""

from __future__ import annotations

from mlflow_hvd.common import compat

try:
    from horovod.runner.common.util import config_parser
    from horovod.runner.common.util.hosts import HostInfo, SlotInfo, get_host_assignments
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
except ImportError:
    compat.check_horovod(tensorflow=False, where="")  # names what is wrong, if it can
    raise

__all__ = [
    "HostInfo",
    "RendezvousHTTPServer",
    "RendezvousHandler",
    "SlotInfo",
    "config_parser",
    "create_run_env_vars",
    "create_slot_env_vars",
    "get_host_assignments",
]

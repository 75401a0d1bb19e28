"""The parts of Horovod's launcher (``horovod.runner``) mlflow_hvd builds on, imported in one
place: where Horovod is missing or of another version, the import fails with the version
found and the command that installs the right one, not a ``ModuleNotFoundError`` from deep
inside the driver.

None of them is Horovod's documented API, whose only launchers are ``horovodrun`` and
``horovod.spark.run`` (which need ssh or MPI, or own the Spark job): a runner that starts the
ranks itself uses what ``horovodrun --gloo`` runs inside. Each was checked on Horovod 0.28.1,
the one release supported (its last; :mod:`mlflow_hvd.common.compat` refuses others):

* ``RendezvousHTTPServer``, ``RendezvousHandler``, ``SlotInfo``: Horovod's own Gloo rendezvous
  server and the layout it is initialised with (:mod:`mlflow_hvd.driver.gloo_server` runs it
  on the driver, only where the driver has Horovod);
* ``config_parser``: the ``HOROVOD_*`` tuning variables ``horovodrun``'s flags become
  (:mod:`.horovod_env`).

The rank layout and the ``HOROVOD_*`` variables of each rank are built without Horovod
(:mod:`.layout`; tests/test_layout.py compares them with Horovod's ``get_host_assignments``,
``create_slot_env_vars`` and ``create_run_env_vars``), so torch.distributed jobs need none.
"""

from __future__ import annotations

from mlflow_hvd.common import compat

try:
    from horovod.runner.common.util import config_parser
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
except ImportError:
    compat.check_horovod(tensorflow=False, where="")  # names what is wrong, if it can
    raise

__all__ = [
    "RendezvousHTTPServer",
    "RendezvousHandler",
    "SlotInfo",
    "config_parser",
]

"""The parts of Horovod's launcher (``horovod.runner``) mlflow_hvd builds on, imported in one
place: where Horovod is missing or of another version, the import fails with the version
found and the command that installs the right one, not a ``ModuleNotFoundError`` from deep
inside the driver."""

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

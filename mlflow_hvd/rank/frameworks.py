"""Rank side: what a rank's error says when the training function uses a framework this
environment, or this job, does not have.

Horovod and TensorFlow are optional (a job of torch.distributed code needs neither). A
function that imports one where it is missing fails on that rank at once with Python's own
``ModuleNotFoundError``; :func:`hint` adds the command that installs it to the error the
driver raises. A rank that imports ``horovod.torch`` or ``horovod.tensorflow`` where the
driver has no Horovod (so no rendezvous server runs for ``hvd.init()``) is refused at that
import (:func:`check_rendezvous`, called by :mod:`mlflow_hvd.rank.keras_guard`).
"""

from __future__ import annotations

import os
import sys

from mlflow_hvd.common import compat
from mlflow_hvd.errors import IncompatibleImportError
from mlflow_hvd.rank import identity

RENDEZVOUS_VARIABLE = "HOROVOD_GLOO_RENDEZVOUS_PORT"  # set by the agent when a server runs


def _missing_module(exc: BaseException) -> str:
    """The top-level name of the module ``exc`` (or what caused it) did not find; ""."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ModuleNotFoundError) and current.name:
            return current.name.split(".")[0]
        current = current.__cause__ or current.__context__
    return ""


def hint(exc: BaseException) -> str:
    """What to do about ``exc``, a rank's error, when it comes from importing Horovod or
    TensorFlow where this rank's environment has none (appended to the rank's error); ""
    otherwise."""
    where = f"this rank's environment ({sys.prefix})"
    missing = _missing_module(exc)
    if missing == "horovod":
        return (f" - Horovod is not installed in {where}: the training function imports it. "
                f"Build it there with `{compat.HOROVOD_COMMAND}` (against the PyTorch and "
                "TensorFlow installed; docs/install.md), or write the function with "
                "torch.distributed, which needs no Horovod")
    if missing == "tensorflow":
        return (f" - TensorFlow is not installed in {where}: the training function imports "
                f"it. {compat.TENSORFLOW_INSTALL}")
    text = str(exc)
    if isinstance(exc, ImportError) and "horovod" in text and "has not been built" in text:
        return (f" - Horovod in {where} was built without that framework's extension: build "
                f"it again against the frameworks installed, `{compat.HOROVOD_COMMAND} "
                "--rebuild`")
    return ""


def check_rendezvous(module: str) -> None:
    """Refuse ``module`` (``horovod.torch`` or ``horovod.tensorflow``) in a rank started
    without horovod's rendezvous server: the driver has no Horovod, so ``hvd.init()`` would
    have nothing to meet its peers at.

    Raises:
        IncompatibleImportError: naming the driver's missing Horovod and how to build it.
    """
    if identity.current().in_worker and not os.environ.get(RENDEZVOUS_VARIABLE):
        raise IncompatibleImportError(
            f"{module} is imported in a rank, but the driver has no Horovod, so no Gloo "
            "rendezvous server runs for hvd.init(): Horovod must be installed where "
            f"HorovodRunner.run() is called as well. Run `{compat.HOROVOD_COMMAND}` in the "
            "driver's environment, or write the function with torch.distributed, which "
            "needs no Horovod")

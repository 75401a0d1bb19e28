"""Rank side: refuse Horovod's own Keras layer under Keras 3, before it can train wrongly,
a TensorFlow outside the supported versions (:mod:`mlflow_hvd.common.compat`) when it is
imported, and a Horovod built without Gloo (or in a job whose driver has no Horovod) when
``horovod.tensorflow`` or ``horovod.torch`` is imported (its ``hvd.init()`` would otherwise
fail inside Horovod's C++ controller); and,
when TensorFlow is imported, Triton first where TensorFlow would crash it
(:mod:`mlflow_hvd.rank.llvm_order`).

``horovod.tensorflow.keras`` (and ``horovod.keras``) predate Keras 3. Under Keras 3 their
callbacks fail with errors such as ``'Variable' object has no attribute 'ref'`` or
``module 'keras.backend' has no attribute 'constant'``, and their ``DistributedOptimizer``
trains *without averaging gradients* and without any error. The worker installs
:func:`install` before it loads the user's function, so importing them fails at once with
the replacement import.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence

from mlflow_hvd.common import compat
from mlflow_hvd.errors import IncompatibleImportError, UnsupportedVersionError
from mlflow_hvd.rank import frameworks, llvm_order
from mlflow_hvd.rank.after_import import spec_then

REFUSED = ("horovod.tensorflow.keras", "horovod.keras")
GLOO_CHECKED = ("horovod.tensorflow", "horovod.torch")  # each loads its own Horovod library


@functools.cache
def keras_version() -> str | None:
    """Installed Keras' version, from package metadata (Keras is not imported); None if
    Keras is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("keras")
    except PackageNotFoundError:
        return None


def keras_major() -> int:
    """Installed Keras' major version; 0 if Keras is missing or its version unreadable."""
    try:
        return int((keras_version() or "0").split(".")[0])
    except ValueError:
        return 0


def message(name: str, keras_version: str) -> str:
    return (
        f"{name} does not work with Keras {keras_version} (the Keras of TensorFlow >= 2.16): "
        "its DistributedOptimizer trains without averaging gradients, and its callbacks fail "
        "('Variable' object has no attribute 'ref'; module 'keras.backend' has no attribute "
        "'constant'). Replace `import horovod.tensorflow.keras as hvd` with "
        "`import mlflow_hvd.keras as hvd`: the same names, on Keras 3 (docs/keras.md, Migrating)"
    )


def _refused(module: str) -> str | None:
    """The refused layer ``module`` belongs to, if any."""
    return next((n for n in REFUSED if module == n or module.startswith(n + ".")), None)


def gloo_message(where: str) -> str:
    return (
        f"Horovod at {where} was built without Gloo, which mlflow_hvd's ranks use (no MPI). "
        f"Rebuild it with `{compat.HOROVOD_COMMAND} --rebuild` (docs/install.md)"
    )


def _check_gloo(module: types.ModuleType) -> None:
    """Refuse a loaded ``horovod.tensorflow`` or ``horovod.torch`` whose library was built
    without Gloo (a call into the loaded library: nothing else is imported), or that this
    rank cannot initialise: the driver has no Horovod, so no rendezvous server runs
    (:func:`~mlflow_hvd.rank.frameworks.check_rendezvous`)."""
    frameworks.check_rendezvous(module.__name__)
    built = getattr(module, "gloo_built", None)
    if callable(built) and not built():
        raise IncompatibleImportError(gloo_message(os.path.dirname(module.__file__ or "?")))


class _Refuse(importlib.abc.MetaPathFinder):
    tensorflow_checked = False

    def __init__(self) -> None:
        self.horovod_checked: set[str] = set()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        name = _refused(fullname)
        if name is not None and keras_major() >= 3:
            raise IncompatibleImportError(message(name, keras_version() or "?"))
        if fullname == "tensorflow" and not self.tensorflow_checked:
            self.tensorflow_checked = True  # once: the version is read from metadata
            try:
                compat.check_tensorflow(compat.TENSORFLOW.installed(), " (in this rank)")
            except UnsupportedVersionError as exc:
                raise IncompatibleImportError(str(exc)) from None
            llvm_order.before_tensorflow()
        if fullname in GLOO_CHECKED and fullname not in self.horovod_checked:
            self.horovod_checked.add(fullname)
            return spec_then(fullname, path, _check_gloo)
        return None


def install() -> bool:
    """Refuse the old Keras layers in this process if Keras 3 is installed; False if the
    guard was already installed.

    Costs nothing until one of them is imported: only then is the installed Keras version
    read: reading package metadata scans every ``sys.path`` entry, and a Spark task's holds
    zip archives, on every rank's way to ``main``.
    """
    if any(isinstance(f, _Refuse) for f in sys.meta_path):
        return False
    loaded = [m for m in sys.modules if _refused(m)]
    if loaded and keras_major() >= 3:  # imported before us: the guard must still apply
        for module in loaded:
            del sys.modules[module]
    sys.meta_path.insert(0, _Refuse())
    return True

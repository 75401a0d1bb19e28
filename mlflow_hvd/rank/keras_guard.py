"""Rank side: refuse Horovod's own Keras layer under Keras 3, before it can train wrongly.

``horovod.tensorflow.keras`` (and ``horovod.keras``) predate Keras 3. Under Keras 3 their
callbacks fail with errors such as ``'Variable' object has no attribute 'ref'`` or
``module 'keras.backend' has no attribute 'constant'``, and their ``DistributedOptimizer``
trains *without averaging gradients* and without any error. The worker installs
:func:`install` before it loads the user's function, so importing them fails at once with
the replacement import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from mlflow_hvd.errors import IncompatibleImportError

REFUSED = ("horovod.tensorflow.keras", "horovod.keras")


def keras_major() -> int:
    """Installed Keras' major version, from package metadata (Keras is not imported)."""
    try:
        return int(version("keras").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


def message(name: str, keras_version: str) -> str:
    return (
        f"{name} does not work with Keras {keras_version} (the Keras of TensorFlow >= 2.16): "
        "its DistributedOptimizer trains without averaging gradients, and its callbacks fail "
        "('Variable' object has no attribute 'ref'; module 'keras.backend' has no attribute "
        "'constant'). Replace `import horovod.tensorflow.keras as hvd` with "
        "`import mlflow_hvd.keras as hvd`: the same names, on Keras 3 (README: Migrating)"
    )


class _Refuse(importlib.abc.MetaPathFinder):
    def __init__(self, keras_version: str) -> None:
        self.keras_version = keras_version

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        for name in REFUSED:
            if fullname == name or fullname.startswith(name + "."):
                raise IncompatibleImportError(message(name, self.keras_version))
        return None


def install() -> bool:
    """Refuse the old Keras layers in this process if Keras 3 is installed; True if so."""
    if keras_major() < 3 or any(isinstance(f, _Refuse) for f in sys.meta_path):
        return False
    for name in REFUSED:  # imported before us: the guard must still apply
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]
    sys.meta_path.insert(0, _Refuse(version("keras")))
    return True

"""The versions of the libraries mlflow_hvd works with, and the refusal of the others before
anything runs: one message naming the version found and the supported range, instead of a
stack trace from inside a rank.

Versions are read from package metadata (nothing is imported). Checked:

* pyspark, on the driver, by ``run()`` for ``np > 0`` (a classic Spark driver's pyspark
  matches its cluster's Spark);
* TensorFlow (``tensorflow`` or ``tensorflow-cpu``, any distribution), in every process when
  it is imported (the rank's guard, :mod:`mlflow_hvd.rank.keras_guard`) and on the driver
  for ``np < 0`` (the ranks share its environment): 2.16 is the first TensorFlow whose Keras
  is Keras 3, 2.18 the last Horovod 0.28.1 builds against;
* ``TF_USE_LEGACY_KERAS=1`` (Keras 2 as ``tf.keras``), on the driver and at the import of
  :mod:`mlflow_hvd.keras`: the drop-in layer is for Keras 3;
* Horovod, on the driver by ``run()`` (its rendezvous server runs there): installed, 0.28.1,
  and for ``np < 0`` built with its TensorFlow extension (seen as the extension's file; whether
  it has Gloo is checked where it is loaded, by the rank's guard).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version

from mlflow_hvd.errors import UnsupportedVersionError


@dataclass(frozen=True)
class Supported:
    """A supported range: ``low <= version < below`` (compared by release numbers, so
    2.18.1rc0 counts as 2.18.1)."""

    name: str
    distributions: tuple[str, ...]  # any of these installs the package
    low: str
    below: str
    why: str

    @property
    def range(self) -> str:
        return f">={self.low},<{self.below}"

    def admits(self, found: str) -> bool:
        try:
            release = Version(Version(found).base_version)
        except InvalidVersion:
            return False
        return Version(self.low) <= release < Version(self.below)

    def installed(self) -> str | None:
        """The installed version (the first distribution found), or None."""
        return _installed(self.distributions)

    def check(self, found: str | None, where: str = "") -> None:
        """Raise :class:`UnsupportedVersionError` unless ``found`` (None: not installed, not
        checked) is in the range."""
        if found is None or self.admits(found):
            return
        raise UnsupportedVersionError(
            f"{self.name} {found}{where} is not supported: mlflow_hvd works with {self.name} "
            f"{self.range} ({self.why}). Install a version in that range"
        )


PYSPARK = Supported(
    "pyspark", ("pyspark",), "3.5", "4.4",
    "the Spark versions it is tested with; the driver's pyspark must match the cluster's Spark",
)
TENSORFLOW = Supported(
    "TensorFlow", ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tensorflow-macos"),
    "2.16", "2.19",
    "2.16 is the first whose tf.keras is Keras 3; 2.18 the last Horovod 0.28.1 builds against",
)

TORCH = Supported(
    "PyTorch", ("torch",), "2.13", "2.14",
    "the release tested with horovod.torch (its CPU build; Horovod 0.28.1 needs the C++17 "
    "patch of mlflow_hvd/cli/horovod.py for it)",
)
HOROVOD = Supported(
    "Horovod", ("horovod",), "0.28.1", "0.28.2",
    "its rendezvous server and Gloo controller are what the runner drives",
)
# builds and installs Horovod against the installed TensorFlow (mlflow_hvd/cli/horovod.py)
HOROVOD_COMMAND = "python -m mlflow_hvd.cli.horovod"

LEGACY_KERAS_VARIABLE = "TF_USE_LEGACY_KERAS"


@functools.cache
def _installed(distributions: tuple[str, ...]) -> str | None:
    # reading metadata scans sys.path: once per process
    for dist in distributions:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def legacy_keras() -> bool:
    """Whether ``TF_USE_LEGACY_KERAS`` makes ``tf.keras`` Keras 2 (as TensorFlow reads it)."""
    return os.environ.get(LEGACY_KERAS_VARIABLE, "").strip().lower() in ("1", "true", "yes")


def check_legacy_keras(where: str) -> None:
    if legacy_keras():
        raise UnsupportedVersionError(
            f"{LEGACY_KERAS_VARIABLE}={os.environ[LEGACY_KERAS_VARIABLE]} {where} makes "
            "tf.keras Keras 2 (tf_keras): mlflow_hvd works with Keras 3, the Keras of "
            f"TensorFlow {TENSORFLOW.range}. Unset {LEGACY_KERAS_VARIABLE}"
        )


def horovod_tensorflow_extension() -> str | None:
    """The file of Horovod's TensorFlow extension in this environment, if it exists (found
    without importing Horovod or TensorFlow)."""
    return _horovod_extension("tensorflow", "mpi_lib")


def horovod_torch_extension() -> str | None:
    """The file of Horovod's PyTorch extension in this environment, if it exists."""
    return _horovod_extension("torch", "mpi_lib_v2")


def _horovod_extension(framework: str, library: str) -> str | None:
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = os.path.join(root, framework, library + sysconfig.get_config_var("EXT_SUFFIX"))
        if os.path.isfile(path):
            return path
    return None


def check_horovod(tensorflow: bool, where: str) -> None:
    """Refuse a missing Horovod, another version, or (``tensorflow``) one built without its
    TensorFlow extension, naming the command that builds the right one."""
    found = HOROVOD.installed()
    fix = (f"Run `{HOROVOD_COMMAND}`: it builds Horovod {HOROVOD.low} with Gloo against the "
           "installed TensorFlow and installs it (docs/install.md)")
    if found is None:
        raise UnsupportedVersionError(f"Horovod is not installed{where}. {fix}")
    if not HOROVOD.admits(found):
        raise UnsupportedVersionError(
            f"Horovod {found}{where} is not supported: mlflow_hvd works with Horovod "
            f"{HOROVOD.range} ({HOROVOD.why}). {fix}"
        )
    if tensorflow and horovod_tensorflow_extension() is None:
        raise UnsupportedVersionError(
            f"Horovod {found}{where} was built without its TensorFlow extension "
            f"(horovod/tensorflow/mpi_lib{sysconfig.get_config_var('EXT_SUFFIX')} is missing; "
            f"pip builds it so when TensorFlow is not importable during the build). {fix}"
        )


def check_driver(np: int) -> None:
    """What ``HorovodRunner.run`` refuses before starting anything.

    Raises:
        UnsupportedVersionError: pyspark (``np > 0``) or TensorFlow (``np < 0``) outside
            its range, ``TF_USE_LEGACY_KERAS`` set, or Horovod missing, of another version or
            (``np < 0``) without its TensorFlow extension.
    """
    check_legacy_keras("in the driver's environment")
    if np > 0:
        PYSPARK.check(PYSPARK.installed(), " (the driver's)")
    else:
        TENSORFLOW.check(TENSORFLOW.installed(), " (the driver's, which local ranks share)")
    check_horovod(tensorflow=np < 0, where=" (the driver's)")

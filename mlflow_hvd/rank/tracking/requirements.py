"""The pip requirements of a logged Keras model, read from what this process has installed.

``mlflow.tensorflow.log_model`` otherwise infers them by loading the saved model again in a
subprocess, seconds per model. The environment that trained the model is
known: its installed versions are the answer that inference would find.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

# What loading a Keras model needs; MLflow adds its own pin.
MODEL_PACKAGES = ("tensorflow", "tensorflow-cpu", "keras", "numpy", "cloudpickle")
# ... and a PyTorch model (torch's CPU build is a local version, e.g. 2.13.0+cpu: the pin
# names it exactly)
TORCH_PACKAGES = ("torch", "numpy", "cloudpickle")


def installed(packages: tuple[str, ...] = MODEL_PACKAGES) -> list[str]:
    """``name==version`` for each of ``packages`` that is installed, in order."""
    pins = []
    for name in packages:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return pins


def with_known_requirements(kwargs: dict[str, Any],
                            packages: tuple[str, ...] = MODEL_PACKAGES) -> dict[str, Any]:
    """``kwargs`` for ``log_model`` with ``pip_requirements`` set from this environment's
    ``packages`` (plus the caller's ``extra_pip_requirements``), unless the caller chose
    ``pip_requirements`` or ``conda_env`` themselves."""
    if kwargs.get("pip_requirements") is not None or kwargs.get("conda_env") is not None:
        return kwargs
    extra = list(kwargs.pop("extra_pip_requirements", None) or [])
    return {**kwargs, "pip_requirements": installed(packages) + extra}

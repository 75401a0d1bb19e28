"""Whether Horovod's PyTorch extension is built for CUDA tensors or for CPU tensors.

Every Linux wheel of PyTorch on PyPI is a CUDA build (``torch.version.cuda`` is set), also on
machines without a GPU. Horovod's own build (``cmake/Modules/FindPytorch.cmake``) then
compiles its PyTorch extension for CUDA as soon as PyTorch finds a ``CUDA_HOME``, and needs a
whole CUDA toolkit there: ``nvcc`` and the CUDA runtime library. A CPU machine has none, or
only parts of one (a ``nvcc`` on ``PATH`` without its libraries), and the build stops.

This module decides, before anything compiles, as PyTorch's ``torch.utils.cpp_extension``
finds ``CUDA_HOME`` (``CUDA_HOME``, ``CUDA_PATH``, ``nvcc`` on ``PATH``, ``/usr/local/cuda``;
Horovod's own ``HOROVOD_CUDA_HOME`` first):

* a CPU build of PyTorch, or a usable toolkit (``bin/nvcc`` and ``libcudart`` under
  ``lib64`` or ``lib``): Horovod's own build, unchanged;
* a CUDA build of PyTorch, no usable toolkit, no GPU operation asked for: the extension is
  built for CPU tensors (the ``torch-cpu`` patch of :mod:`mlflow_hvd.cli.horovod_patches`);
* GPU operations asked for (``HOROVOD_GPU_OPERATIONS``, ``HOROVOD_GPU_ALLREDUCE``, ...)
  without a usable toolkit: refused, naming what is missing.

Nothing here imports PyTorch: its CUDA version is read from its installed ``version.py``.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import distributions
from pathlib import Path

# Horovod's switches for GPU collectives (its CMakeLists.txt): any of them asks for CUDA
GPU_OPERATIONS = ("HOROVOD_GPU_OPERATIONS", "HOROVOD_GPU_ALLREDUCE", "HOROVOD_GPU_ALLGATHER",
                  "HOROVOD_GPU_BROADCAST", "HOROVOD_GPU_ALLTOALL", "HOROVOD_GPU_REDUCESCATTER")
_CUDA_LINE = re.compile(r"^cuda\s*(?::[^=]+)?=\s*(.+?)\s*$", re.M)


@dataclass(frozen=True)
class Toolkit:
    """The CUDA toolkit PyTorch's build helpers would use: where, and what it lacks."""

    home: str  # "": none found
    missing: str  # "": usable; else what a build would not find

    @property
    def usable(self) -> bool:
        return bool(self.home) and not self.missing

    def describe(self) -> str:
        if not self.home:
            return ("no CUDA toolkit is here (HOROVOD_CUDA_HOME, CUDA_HOME and CUDA_PATH unset, "
                    "no nvcc on PATH, no /usr/local/cuda)")
        if self.missing:
            return f"the CUDA toolkit at {self.home} is not usable: {self.missing}"
        return f"the CUDA toolkit at {self.home}"


def torch_cuda(path: list[str] | None = None) -> str:
    """The CUDA version the installed PyTorch (found on ``path``, default ``sys.path``) was
    built with ("" for a CPU build or when PyTorch is not installed), read from its
    ``torch/version.py``."""
    found_dist = next(iter(distributions(name="torch", path=path or sys.path)), None)
    if found_dist is None:
        return ""
    try:
        text = Path(str(found_dist.locate_file("torch/version.py"))).read_text()
    except OSError:
        return ""
    found = _CUDA_LINE.search(text)
    if found is None:
        return ""
    try:
        value = ast.literal_eval(found.group(1))
    except (ValueError, SyntaxError):
        return ""
    return value if isinstance(value, str) else ""


HOMES = ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH")  # a toolkit the user named
DEFAULT_HOME = "/usr/local/cuda"


def find_toolkit(environ: Mapping[str, str]) -> Toolkit:
    """The toolkit PyTorch's ``cpp_extension`` would take as ``CUDA_HOME`` under ``environ``,
    and whether a build can use it."""
    home = (environ.get("HOROVOD_CUDA_HOME") or environ.get("CUDA_HOME")
            or environ.get("CUDA_PATH") or "")
    if not home:
        nvcc = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
        if nvcc:
            home = str(Path(nvcc).parent.parent)
        elif Path(DEFAULT_HOME).exists():
            home = DEFAULT_HOME
    return _checked(home)


def gpu_toolkit(environ: Mapping[str, str]) -> Toolkit:
    """The toolkit a build with GPU operations compiles with: the one named by
    ``HOROVOD_CUDA_HOME``, ``CUDA_HOME`` or ``CUDA_PATH``, as it is; else PyTorch's choice when
    usable, else ``/usr/local/cuda`` when that is (an ``nvcc`` on ``PATH`` can be a wrapper
    outside its toolkit: ``/usr/local/bin/nvcc`` makes PyTorch's choice ``/usr/local``);
    else PyTorch's choice, for the error that names what it lacks."""
    found = find_toolkit(environ)
    if found.usable or any(environ.get(name) for name in HOMES):
        return found
    default = _checked(DEFAULT_HOME)
    return default if default.usable else found


def _checked(home: str) -> Toolkit:
    if not home:
        return Toolkit("", "")
    root = Path(home)
    lacks = []
    if not (root / "bin" / "nvcc").exists():
        lacks.append(f"no {root / 'bin' / 'nvcc'}")
    if not any(sorted((root / lib).glob("libcudart.so*")) for lib in ("lib64", "lib")):
        lacks.append(f"no libcudart under {root / 'lib64'} or {root / 'lib'}")
    return Toolkit(home, ", ".join(lacks))


def gpu_operations(environ: Mapping[str, str]) -> list[str]:
    """The GPU-operation switches set in ``environ``, as ``NAME=value``."""
    return [f"{name}={environ[name]}" for name in GPU_OPERATIONS if environ.get(name)]


def torch_for_cpu(environ: Mapping[str, str]) -> bool:
    """Whether the installed PyTorch is a CUDA build with no usable toolkit here, so that
    Horovod's build for CPU tensors must be built against it (the torch-cpu patch).

    Only for builds that ask for no GPU operation: a GPU build's toolkit is checked when it
    compiles (:func:`mlflow_hvd.cli.gpu_build.build_env`), since its cached wheel installs
    where no toolkit is.
    """
    return bool(torch_cuda()) and not find_toolkit(environ).usable


def describe_cpu_build() -> str:
    """The one line a build for CPU tensors against a CUDA build of PyTorch prints."""
    return (f"PyTorch here is a CUDA {torch_cuda()} build and "
            f"{find_toolkit(os.environ).describe()}: Horovod's PyTorch extension is built for "
            "CPU tensors (GPU operations need a toolkit: see docs/install.md)")

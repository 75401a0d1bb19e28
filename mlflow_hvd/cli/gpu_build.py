"""What a Horovod build with GPU operations (``HOROVOD_GPU_OPERATIONS=NCCL``, ...) needs beyond
Horovod's own switches: the CUDA toolkit, given to PyTorch's ``cpp_extension`` as well as to
Horovod (``CUDA_HOME`` and ``HOROVOD_CUDA_HOME``), and NCCL, found where the user has it:

* ``HOROVOD_NCCL_HOME``, ``HOROVOD_NCCL_INCLUDE`` or ``HOROVOD_NCCL_LIB`` set: Horovod's own
  search, as the user set it;
* else NVIDIA's ``nvidia-nccl-cu*`` wheel in this environment (a dependency of PyPI's CUDA
  builds of PyTorch): its ``nccl.h`` and ``libnccl.so.2``, linked as a shared library (the
  wheel ships no static one) and found at run time beside Horovod in site-packages
  (``$ORIGIN``-relative, so the wheel works wherever the environment is unpacked);
* else a system NCCL (``nccl.h`` under ``/usr/include`` or the toolkit), which Horovod's CMake
  finds by itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from mlflow_hvd.cli import cuda_toolkit
from mlflow_hvd.errors import InstallError

USER_NCCL = ("HOROVOD_NCCL_HOME", "HOROVOD_NCCL_INCLUDE", "HOROVOD_NCCL_LIB")
# from site-packages/horovod/<framework>/mpi_lib*.so to site-packages/nvidia/nccl/lib
NCCL_RPATH_DIR = "$ORIGIN/../../nvidia/nccl/lib"


def _with_rpath(environ: Mapping[str, str], directory: str) -> str:
    """The user's ``LDFLAGS`` with a run path to ``directory`` added."""
    return " ".join(filter(None, (environ.get("LDFLAGS", ""), f"-Wl,-rpath,{directory}")))


def nccl_wheel(site: Path) -> Path | None:
    """The ``nvidia/nccl`` directory of NVIDIA's NCCL wheel in ``site`` (None: not there)."""
    root = site / "nvidia" / "nccl"
    if (root / "include" / "nccl.h").is_file() and (root / "lib" / "libnccl.so.2").is_file():
        return root
    return None


def system_nccl(toolkit: str) -> Path | None:
    """A system NCCL's header (``libnccl-dev``, or one installed with the toolkit)."""
    for include in (Path("/usr/include"), Path("/usr/local/include"), Path(toolkit) / "include"):
        if (include / "nccl.h").is_file():
            return include / "nccl.h"
    return None


def build_env(environ: Mapping[str, str], site: Path, work: Path) -> dict[str, str]:
    """The variables a GPU build adds to ``environ``; ``site`` is this environment's
    site-packages, ``work`` the build's own directory (removed after it).

    Raises:
        InstallError: No usable CUDA toolkit, or no NCCL, naming what to install.
    """
    toolkit = cuda_toolkit.gpu_toolkit(environ)
    asked = ", ".join(cuda_toolkit.gpu_operations(environ))
    if not toolkit.usable:
        cuda = cuda_toolkit.torch_cuda()
        which = f"CUDA toolkit {cuda} that PyTorch was built with" if cuda else "CUDA toolkit"
        raise InstallError(
            f"{asked} asks Horovod for GPU operations, but {toolkit.describe()}. Install the "
            f"{which} (nvcc and its runtime library) and set CUDA_HOME to it; nothing was "
            "built")
    env = {"CUDA_HOME": toolkit.home, "HOROVOD_CUDA_HOME": toolkit.home}
    if any(environ.get(name) for name in USER_NCCL):
        # the build keeps no run path of its own (the gpu-runpath patch): the user's NCCL
        # directory is the one it needs
        named = environ.get("HOROVOD_NCCL_LIB") or (
            str(Path(environ["HOROVOD_NCCL_HOME"]) / "lib")
            if environ.get("HOROVOD_NCCL_HOME") else "")
        return {**env, "LDFLAGS": _with_rpath(environ, named)} if named else env
    wheel = nccl_wheel(site)
    if wheel is not None:
        # Horovod's FindNCCL looks for libnccl.so; the wheel ships only its soname
        lib = work / "nccl-lib"
        lib.mkdir(parents=True, exist_ok=True)
        link = lib / "libnccl.so"
        link.unlink(missing_ok=True)
        link.symlink_to(wheel / "lib" / "libnccl.so.2")
        return {**env, "HOROVOD_NCCL_INCLUDE": str(wheel / "include"),
                "HOROVOD_NCCL_LIB": str(lib), "HOROVOD_NCCL_LINK": "SHARED",
                "LDFLAGS": _with_rpath(environ, NCCL_RPATH_DIR)}
    if system_nccl(toolkit.home) is not None:
        return env
    raise InstallError(
        f"{asked} asks Horovod for NCCL, and none is here: install NVIDIA's wheel for your "
        "CUDA (pip install nvidia-nccl-cu13, or -cu12), or the system's (libnccl-dev), or set "
        "HOROVOD_NCCL_HOME to an NCCL installation; nothing was built")


def site_packages() -> Path:
    """This environment's site-packages (where pip installs Horovod and NVIDIA's wheels)."""
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def asked(environ: Mapping[str, str] = os.environ) -> str:
    """The GPU operations asked for, as ``NAME=value`` joined by commas ("": none)."""
    return ",".join(sorted(cuda_toolkit.gpu_operations(environ)))

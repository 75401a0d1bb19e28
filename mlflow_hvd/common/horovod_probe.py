"""Loading Horovod's framework extensions in a fresh interpreter, as a rank will, and
checking each was built with Gloo: after a build on the driver (``mlflow_hvd.cli.horovod``)
and, once per executor, in an environment shipped to it (``mlflow_hvd.agent.spark_task``).

A fresh process: loading an extension imports its framework (seconds), and a failure to
load (a missing symbol, a framework of another version) must not take the caller down.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

FRAMEWORKS = {"tensorflow": "TensorFlow", "torch": "PyTorch"}  # extension -> framework name

_PROBE = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        hvd = importlib.import_module("horovod." + name)
        fw = importlib.import_module(name)
        import horovod
        found[name] = [bool(hvd.gloo_built()), horovod.__version__, fw.__version__, "",
                       int(hvd.nccl_built() or 0), bool(hvd.cuda_built())]
    except BaseException as exc:
        found[name] = [False, "", "", "%s: %s" % (type(exc).__name__, exc), 0, False]
print("PROBE " + json.dumps(found))
"""


@dataclass(frozen=True)
class ExtensionCheck:
    """What loading one of Horovod's extensions showed.

    Attributes:
        extension: ``tensorflow`` or ``torch``.
        loaded: It imported, with its framework.
        gloo: It was built with Gloo (the runner's only controller).
        horovod: Horovod's version ("" when it did not load).
        framework_version: The framework's version ("" when it did not load).
        error: Why it did not load ("" when it did).
        nccl: The NCCL version it was built with, as NCCL codes it (``23007`` for 2.30.7;
            0: built without NCCL).
        cuda: It was built with CUDA.
    """

    extension: str
    loaded: bool
    gloo: bool
    horovod: str
    framework_version: str
    error: str
    nccl: int = 0
    cuda: bool = False

    @property
    def ok(self) -> bool:
        return self.loaded and self.gloo

    def describe(self) -> str:
        """``Horovod 0.28.1 with Gloo and TensorFlow 2.18.1`` (``with Gloo, CUDA and NCCL
        2.30.7 and ...`` for a GPU build), or what is wrong."""
        name = FRAMEWORKS.get(self.extension, self.extension)
        if not self.loaded:
            hint = missing_library_hint(self.error)
            return f"horovod.{self.extension} does not load: {self.error}" + (
                f" ({hint})" if hint else "")
        if not self.gloo:
            return f"Horovod {self.horovod} for {name} was built without Gloo"
        gpu = "".join([", CUDA" if self.cuda else "",
                       f" and NCCL {nccl_version(self.nccl)}" if self.nccl else ""])
        return f"Horovod {self.horovod} with Gloo{gpu} and {name} {self.framework_version}"


def nccl_version(code: int) -> str:
    """NCCL's version code as its version (``23007`` -> ``2.30.7``; NCCL >= 2.9's coding)."""
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


# the shared libraries a GPU build of Horovod loads that a node can lack, and what gives them
_LIBRARIES = {
    "libnccl.so": "this Horovod was built with NCCL: install it in this environment "
                  "(pip install nvidia-nccl-cu13, or -cu12 as the build's CUDA) or the "
                  "system's (libnccl2)",
    "libcudart.so": "this Horovod was built with CUDA: install its runtime (pip install "
                    "nvidia-cuda-runtime; PyPI's CUDA builds of PyTorch bring it)",
    "libc10_cuda.so": "this Horovod was built against a CUDA build of PyTorch and PyTorch "
                      "here is not one: rebuild Horovod here (python -m "
                      "mlflow_hvd.cli.horovod --rebuild)",
}


def missing_library_hint(error: str) -> str:
    """What to install when ``error`` is the dynamic loader's for a shared library a GPU
    build needs ("" otherwise)."""
    if "cannot open shared object file" not in error:
        return ""
    return next((f"{lib}* is missing: {what}" for lib, what in _LIBRARIES.items()
                 if lib in error), "")


def load_extensions(extensions: tuple[str, ...], timeout: float,
                    python: str = sys.executable) -> tuple[ExtensionCheck, ...]:
    """Load each of ``extensions`` in one fresh ``python`` process (at most ``timeout``
    seconds); one :class:`ExtensionCheck` each, in order. A process that fails or hangs
    reports every extension as not loaded, with its last lines of output."""
    if not extensions:
        return ()
    try:
        done = subprocess.run([python, "-c", _PROBE, *extensions], capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return tuple(ExtensionCheck(e, False, False, "", "", f"loading took over {timeout:.0f}s")
                     for e in extensions)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-5:])
        why = f"the interpreter exited {done.returncode}: {tail or 'no output'}"
        return tuple(ExtensionCheck(e, False, False, "", "", why) for e in extensions)
    found = json.loads(lines[-1][len("PROBE "):])
    checks = []
    for e in extensions:
        gloo, horovod, version, error, nccl, cuda = found[e]
        checks.append(ExtensionCheck(e, not error, bool(gloo), horovod, version, error,
                                     int(nccl), bool(cuda)))
    return tuple(checks)

"""The running interpreter's :class:`EnvironmentFingerprint`: on the driver when it packs
its environment, and in a Spark task running the unpacked archive, which compares the two
before its rank starts."""

from __future__ import annotations

import os
import platform
import sys
import sysconfig
from importlib.metadata import distributions

from mlflow_hvd.common import compat
from mlflow_hvd.protocol.environment import EnvironmentFingerprint


def base_python() -> str:
    """The interpreter this environment's ``python`` links to (a venv's base Python)."""
    return os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)


def packages(site: str | None = None) -> tuple[str, ...]:
    """``name==version`` of every distribution installed in ``site`` (default: this
    environment's site-packages), sorted."""
    where = [site or sysconfig.get_paths()["purelib"]]
    found = {f"{d.metadata['Name']}=={d.version}" for d in distributions(path=where)
             if d.metadata["Name"]}
    return tuple(sorted(found, key=str.lower))


def current(with_packages: bool = True) -> EnvironmentFingerprint:
    """This interpreter's fingerprint (reads package metadata; imports neither Horovod nor
    a framework). ``with_packages=False`` leaves the package list empty (what a host's
    check compares needs none of it)."""
    libc = " ".join(part for part in platform.libc_ver() if part)
    extensions = tuple(name for name, found in (
        ("tensorflow", compat.horovod_tensorflow_extension()),
        ("torch", compat.horovod_torch_extension()),
    ) if found)
    return EnvironmentFingerprint(
        python=platform.python_version(),
        platform=f"{sysconfig.get_platform()} {libc}".strip(),
        base_python=base_python(),
        horovod=compat.HOROVOD.installed() or "",
        extensions=extensions,
        packages=packages() if with_packages else (),
    )

"""Builds Horovod against the frameworks installed in this environment (PyTorch, TensorFlow,
or both), installs it and checks it: the one step pip cannot do, because Horovod compiles
against the frameworks it finds at build time (pip's isolated build environment has none, and
the result silently lacks their extensions). Only code that imports ``horovod`` needs it:
torch.distributed code (DDP, FSDP, TorchDistributor) runs without.

    python -m mlflow_hvd.cli.horovod            # build if needed, install, check
    python -m mlflow_hvd.cli.horovod --check    # only check what is installed
    python -m mlflow_hvd.cli.horovod --rebuild  # ignore the cached wheel
    HOROVOD_GPU_OPERATIONS=NCCL python -m mlflow_hvd.cli.horovod  # the NCCL build (GPUs)
    python -m mlflow_hvd.cli.horovod --cpu      # the CPU build where the NCCL build is

The wheel is built once per Horovod, framework versions, Python and CPU and kept in
``$MLFLOW_HVD_CACHE/wheels`` (default ``~/.cache/mlflow_hvd/wheels``), so a second
environment with the same versions installs it in seconds. The source is Horovod's sdist from
the package index, verified against the hash below. The build is Horovod's own with
``HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1``, and
``HOROVOD_WITH_TENSORFLOW=1`` / ``HOROVOD_WITH_PYTORCH=1`` for each framework installed
(``HOROVOD_WITHOUT_...=1`` for the other): Gloo is what the runner drives, no MPI.

Horovod 0.28.1 is the last release and predates today's frameworks: the source is changed
before the build where a framework needs it, and built without debug information, each
line checked first (the patches, their conditions and reasons:
:mod:`mlflow_hvd.cli.horovod_patches`).

With ``HOROVOD_GPU_OPERATIONS`` (or another of Horovod's ``HOROVOD_GPU_*`` switches) set,
the build is Horovod's CUDA build with those operations, against the CUDA toolkit and NCCL
found here (:mod:`mlflow_hvd.cli.gpu_build`), cached apart from the CPU build; its wheel also
runs on nodes without a GPU.

A marker in the environment records what was installed, so a check of an unchanged
environment imports nothing and takes a fraction of a second.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from mlflow_hvd.cli import cuda_toolkit, gpu_build, horovod_patches
from mlflow_hvd.common import cache, compat
from mlflow_hvd.common.horovod_probe import load_extensions
from mlflow_hvd.errors import InstallError, MlflowHvdError, UnsupportedVersionError

VERSION = compat.HOROVOD.low
# sha256 of horovod-0.28.1.tar.gz on PyPI: what is compiled is what was reviewed
SDIST_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
BUILD_FLAGS = {
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_MPI": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
}
TOOLS = ("cmake", "g++", "make")
MARKER = ".mlflow_hvd-horovod.json"  # in sys.prefix
# each framework's extension library in Horovod's package
EXTENSION_LIBRARIES = {"tensorflow": "mpi_lib", "torch": "mpi_lib_v2"}
BUILD_TIMEOUT = 3600.0
CHECK_TIMEOUT = 300.0


@dataclass(frozen=True)
class Target:
    """What a Horovod build is specific to: its wheel fits only these."""

    horovod: str
    tensorflow: str  # the TensorFlow built against; empty: a PyTorch-only build
    python: str
    cpu: str
    torch: str = ""  # the PyTorch built against; empty: a TensorFlow-only build
    patches: str = ""  # the source patches applied, by name, comma-separated
    gpu: str = ""  # the GPU operations asked for (NAME=value, ...); empty: Gloo on CPUs

    @property
    def name(self) -> str:
        torch = f"-torch{self.torch}" if self.torch else ""
        patched = ""
        if self.patches:
            # what is compiled: each patch's edits (a changed edit is a new build, never a
            # stale wheel; a reworded reason or condition is the same build)
            edits = [(p.name, p.edits) for p in self.patch_set()]
            digest = hashlib.sha256(repr(edits).encode()).hexdigest()[:8]
            patched = f"-p{digest}"
        # a GPU build is another wheel (a CPU build's name is as before: its cache stays)
        gpu = f"-gpu{hashlib.sha256(self.gpu.encode()).hexdigest()[:8]}" if self.gpu else ""
        tensorflow = f"-tf{self.tensorflow}" if self.tensorflow else ""
        return (f"horovod-{self.horovod}{tensorflow}{torch}-py{self.python}-"
                f"{self.cpu}{gpu}{patched}")

    def patch_set(self) -> tuple[horovod_patches.Patch, ...]:
        names = set(filter(None, self.patches.split(",")))
        return tuple(p for p in horovod_patches.PATCHES if p.name in names)

    def flags(self) -> dict[str, str]:
        """Horovod's build switches for this target."""
        torch = "HOROVOD_WITH_PYTORCH" if self.torch else "HOROVOD_WITHOUT_PYTORCH"
        tensorflow = ("HOROVOD_WITH_TENSORFLOW" if self.tensorflow
                      else "HOROVOD_WITHOUT_TENSORFLOW")
        return {**BUILD_FLAGS, tensorflow: "1", torch: "1"}

    def extensions(self) -> tuple[str, ...]:
        """Horovod's framework extensions this build has (``tensorflow``, ``torch``)."""
        return tuple(name for name, version in (("tensorflow", self.tensorflow),
                                                ("torch", self.torch)) if version)

    def frameworks(self) -> str:
        return " and ".join(f"{name} {version}" for name, version in
                            (("TensorFlow", self.tensorflow), ("PyTorch", self.torch))
                            if version)


def cpu_id() -> str:
    """Machine and a digest of the CPU model and flags (the build uses the CPU's
    instruction set)."""
    lines: list[str] = []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = platform.processor()
    for key in ("model name", "flags"):
        lines += [line for line in text.splitlines() if line.startswith(key)][:1]
    digest = hashlib.sha256("".join(f"{line}\n" for line in lines).encode()).hexdigest()
    return f"{platform.machine()}-{digest[:12]}"


def target(environ: Mapping[str, str] = os.environ) -> Target:
    """The build this environment needs: against the frameworks installed (PyTorch,
    TensorFlow or both), with the GPU operations ``environ`` asks for.

    Raises:
        UnsupportedVersionError: Neither framework is installed, or one of an unsupported
            version.
    """
    found = compat.TENSORFLOW.installed()
    torch = compat.TORCH.installed()
    if found is None and torch is None:
        raise UnsupportedVersionError(
            f"Neither PyTorch nor TensorFlow is installed in this environment ({sys.prefix}): "
            "Horovod is built against the frameworks it finds. Install PyTorch "
            f"{compat.TORCH.range} (pip install 'mlflow_hvd[torch]') or TensorFlow "
            f"{compat.TENSORFLOW.range} ({compat.TENSORFLOW_INSTALL}), or both, first"
        )
    compat.check_tensorflow(found, " (installed here)")
    compat.TORCH.check(torch, " (installed here)")
    gpu = gpu_build.asked(environ)
    if gpu and torch and not cuda_toolkit.torch_cuda():
        # Horovod's CMake stops there too, after the download and half a minute of pip
        switches = ", ".join(a.split("=")[0] for a in gpu.split(","))
        raise InstallError(
            f"{gpu} asks Horovod for GPU operations, but PyTorch {torch} here is a CPU build "
            "(torch.version.cuda is None) and Horovod's PyTorch extension would need CUDA's. "
            "Install a CUDA build of PyTorch (on Linux, PyPI's default torch wheel), or unset "
            f"{switches} for the CPU build; nothing was built")
    # a GPU build never takes the torch-cpu patch; its toolkit is checked when it compiles
    # (a cached wheel installs where none is)
    for_cpu = bool(torch) and not gpu and cuda_toolkit.torch_for_cpu(environ)
    build = horovod_patches.Build(found or "", torch or "", for_cpu, gpu=bool(gpu))
    patches = ",".join(p.name for p in horovod_patches.needed(build))
    return Target(VERSION, found or "", f"{sys.version_info[0]}.{sys.version_info[1]}",
                  cpu_id(), torch or "", patches, gpu)


def cache_root() -> Path:
    return cache.cache_root() / "wheels"


TARGET_FILE = "target.json"  # beside each cached wheel: the Target it was built for


def serving_wheel(t: Target, root: Path) -> Path | None:
    """A cached wheel built for another target that serves an environment of ``t``: for
    an environment without PyTorch, a wheel built against the same Horovod, TensorFlow,
    Python and CPU with PyTorch as well (its TensorFlow extension is the one such a build
    makes; its PyTorch extension is never loaded there, and an environment that installs
    PyTorch later is a new target, built for it). None when there is none, or ``t`` has
    PyTorch (its extension must match that PyTorch exactly) or no TensorFlow."""
    if t.torch or not t.tensorflow:
        return None
    found = []
    for recorded in root.glob(f"*/{TARGET_FILE}"):
        try:
            other = Target(**json.loads(recorded.read_text()))
            wheel = wheel_in(recorded.parent)
        except (OSError, ValueError, TypeError, InstallError):
            continue  # a wheel being built, or from another version of this module
        same = (other.horovod, other.tensorflow, other.python, other.cpu) == (
            t.horovod, t.tensorflow, t.python, t.cpu)
        # patches that do not depend on PyTorch: those of a TensorFlow-only build
        tensorflow_patches = {p.name for p in other.patch_set() if not p.with_torch}
        if same and other.torch and tensorflow_patches == {p.name for p in t.patch_set()}:
            found.append((recorded.stat().st_mtime, wheel))
    return max(found)[1] if found else None


def _marker() -> Path:
    return Path(sys.prefix) / MARKER


def installed_matches(t: Target) -> bool:
    """Whether this environment holds the Horovod built for ``t`` (by our marker and the
    installed metadata; nothing imported)."""
    try:  # a marker written before a field existed holds its default
        recorded = Target(**json.loads(_marker().read_text()))
    except (OSError, ValueError, TypeError):
        return False
    return (recorded == t and compat.HOROVOD.installed() == t.horovod
            and (not t.tensorflow or compat.horovod_tensorflow_extension() is not None)
            and (not t.torch or compat.horovod_torch_extension() is not None))


def installed_gpu_build() -> Target | None:
    """The GPU build installed here when it is the one this environment would build with its
    GPU operations (None: none, or one for other versions)."""
    try:
        recorded = Target(**json.loads(_marker().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if not recorded.gpu:
        return None
    switches = dict(item.split("=", 1) for item in recorded.gpu.split(","))
    t = target({**os.environ, **switches})
    return t if installed_matches(t) else None


def _pip(*args: str, env: dict[str, str] | None = None, timeout: float) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    try:
        done = subprocess.run(cmd, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise InstallError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f}s") from None
    if done.returncode != 0:
        raise InstallError(f"`{' '.join(cmd)}` failed with exit code {done.returncode} "
                                "(its output is above)")


def build_wheel(t: Target, dest: Path) -> Path:
    """Build Horovod's wheel for ``t`` into ``dest`` (atomically: a failed build leaves no
    directory)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise InstallError(
            f"{', '.join(missing)} not found: Horovod compiles from source "
            "(on Debian/Ubuntu: apt-get install -y cmake g++ make)"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        sdist = download_sdist(work)
        if t.patch_set():  # pip builds the patched sdist as it builds a released one
            sdist = patched_sdist(sdist, work / "patched", t.patch_set())
        env = dict(os.environ, **t.flags(), MAKEFLAGS=f"-j{os.cpu_count() or 1}")
        if t.gpu:  # the toolkit for PyTorch's helpers too, and NCCL where the user has it
            env.update(gpu_build.build_env(os.environ, gpu_build.site_packages(), work))
        patched = f", patched: {t.patches}" if t.patches else ""
        if horovod_patches.TORCH_CPU in t.patch_set():
            print(cuda_toolkit.describe_cpu_build(), flush=True)
        minutes = "4-8" if t.torch and t.tensorflow else "3-5"
        print(f"building Horovod {t.horovod} against {t.frameworks()} on Python {t.python}"
              f"{patched} ({minutes} minutes on 2 cores) ...", flush=True)
        _pip("wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
             "-w", str(work / "wheel"), str(sdist), env=env, timeout=BUILD_TIMEOUT)
        check_wheel(wheel_in(work / "wheel"), t)
        (work / "wheel" / TARGET_FILE).write_text(json.dumps(asdict(t)))
        (work / "wheel").rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return wheel_in(dest)


def download_sdist(into: Path) -> Path:
    """Download Horovod's sdist from the package index into ``into``, checked against
    :data:`SDIST_SHA256` (pip refuses any other bytes)."""
    into.mkdir(parents=True, exist_ok=True)
    spec = into / "horovod.txt"
    spec.write_text(f"horovod=={VERSION} --hash=sha256:{SDIST_SHA256}\n")
    _pip("download", "--quiet", "--no-deps", "--no-binary", ":all:", "--require-hashes",
         "-d", str(into), "-r", str(spec), timeout=600)
    sdist = into / f"horovod-{VERSION}.tar.gz"
    if not sdist.is_file():
        raise InstallError(f"the Horovod sdist was not downloaded to {sdist}")
    return sdist


def patched_sdist(archive: Path, into: Path,
                  patches: tuple[horovod_patches.Patch, ...]) -> Path:
    """Horovod's sdist (already hash-checked) with ``patches`` applied, packed again under
    the same name in ``into``."""
    if not archive.is_file():
        raise InstallError(f"the Horovod sdist was not downloaded to {archive}")
    tree = into / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    (source,) = tree.iterdir()
    horovod_patches.apply(source, patches, VERSION)
    out = into / archive.name
    # read once, by the build next to it: the fastest compression (2.3 s -> 0.6 s to pack on
    # 2 cores, 3.6 -> 4.8 MB)
    with tarfile.open(out, "w:gz", compresslevel=1) as tar:
        tar.add(source, arcname=source.name)
    return out


def check_wheel(wheel: Path, t: Target) -> None:
    """Refuse a wheel without the extension of each framework of ``t`` in its package (a
    build can succeed and still leave one out, or put it elsewhere)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    needed = [f"horovod/{name}/{EXTENSION_LIBRARIES[name]}{suffix}" for name in t.extensions()]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = [n for n in needed if n not in names]
    if missing:
        raise InstallError(f"the Horovod wheel built for {t.frameworks()} lacks "
                           f"{', '.join(missing)}; nothing was cached or installed")


def wheel_in(directory: Path) -> Path:
    wheels = sorted(directory.glob("horovod-*.whl"))
    if not wheels:
        raise InstallError(f"no Horovod wheel in {directory}")
    return wheels[-1]


def verify(t: Target, timeout: float = CHECK_TIMEOUT) -> str:
    """Load Horovod's extension of each framework of ``t`` in a fresh interpreter, as a rank
    will, and check each has Gloo, and CUDA and NCCL where ``t.gpu`` (the GPU operations the
    build asked for) says so; returns what it reported.

    Raises:
        InstallError: An extension does not load or lacks what it was built for, with how
            to rebuild.
    """
    gpu = t.gpu
    checks = load_extensions(t.extensions(), timeout)
    for check in checks:
        if not check.ok:
            raise InstallError(f"{check.describe()}. Rebuild it: {compat.HOROVOD_COMMAND} "
                               "--rebuild")
        if gpu and not (check.cuda and ("NCCL" not in gpu or check.nccl)):
            raise InstallError(
                f"{check.describe()}: built without {'NCCL' if check.cuda else 'CUDA'} though "
                f"{gpu} asked for it. Rebuild it: {gpu.replace(',', ' ')} "
                f"{compat.HOROVOD_COMMAND} --rebuild")
    first, *rest = [c.describe() for c in checks]
    return " and ".join([first, *(r.rsplit(" and ", 1)[1] for r in rest)])


def ensure(rebuild: bool = False, cpu: bool = False) -> tuple[bool, str]:
    """Make this environment's Horovod the one built for its TensorFlow; returns whether
    anything was installed and a line saying what. An installed GPU build for these versions
    is kept when no GPU operation is asked for (it runs CPU ranks as well), unless ``cpu``
    or ``rebuild``."""
    t = target()
    if cpu and t.gpu:
        raise InstallError(f"--cpu asks for the CPU build, and {t.gpu} for a GPU build: "
                           "unset one")
    kept = None if (t.gpu or cpu or rebuild) else installed_gpu_build()
    if kept is not None:
        return False, (f"Horovod {t.horovod} for {t.frameworks()} is installed, built with "
                       f"{kept.gpu}: it runs CPU ranks as well ({_marker()}; --cpu installs "
                       "the CPU build instead)")
    if not rebuild and installed_matches(t):
        return False, f"Horovod {t.horovod} for {t.frameworks()} is installed ({_marker()})"
    started = time.monotonic()
    directory = cache_root() / t.name
    serving = None if rebuild or directory.is_dir() else serving_wheel(t, cache_root())
    if serving is not None:
        wheel, directory = serving, serving.parent
        how = (f"reused {wheel} (built with PyTorch as well: its TensorFlow extension "
               "serves this environment)")
    elif rebuild or not directory.is_dir():
        if directory.is_dir():
            shutil.rmtree(directory)
        wheel = build_wheel(t, directory)
        how = f"built {wheel.name} in {time.monotonic() - started:.0f}s"
    else:
        wheel = wheel_in(directory)
        how = f"reused {wheel}"
    _pip("install", "--quiet", "--no-deps", "--force-reinstall", str(wheel), timeout=600)
    _marker().unlink(missing_ok=True)
    try:
        report = verify(t)
    except InstallError:
        if serving is not None:  # another target's wheel, which its own environment loads
            return ensure(rebuild=True)  # so this one gets a wheel of its own
        shutil.rmtree(directory, ignore_errors=True)  # not reused: the next run builds again
        raise
    _marker().write_text(json.dumps(asdict(t)))
    return True, f"{report}: {how}, installed in {sys.prefix}"


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mlflow_hvd.cli.horovod``."""
    parser = argparse.ArgumentParser(prog="python -m mlflow_hvd.cli.horovod", description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true",
                       help="only check the installed Horovod (loads it; builds nothing)")
    group.add_argument("--rebuild", action="store_true",
                       help="build again even if a wheel for these versions is cached")
    parser.add_argument("--cpu", action="store_true",
                        help="install the CPU build where a GPU build (HOROVOD_GPU_OPERATIONS) "
                             "is installed; without it, an installed GPU build for these "
                             "versions is kept")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.check:
            t = target()
            t = (installed_gpu_build() or t) if not t.gpu else t
            compat.check_horovod(tensorflow=bool(t.tensorflow), where=" (installed here)")
            if t.torch and compat.horovod_torch_extension() is None:
                raise InstallError(
                    f"PyTorch {t.torch} is installed but Horovod here was built without it "
                    f"(no horovod.torch extension). Rebuild: {compat.HOROVOD_COMMAND} --rebuild"
                )
            print(verify(t))
        else:
            print(ensure(rebuild=args.rebuild, cpu=args.cpu)[1])
    except MlflowHvdError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

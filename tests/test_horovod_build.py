"""Horovod built against the installed TensorFlow and PyTorch (mlflow_hvd.cli.horovod), in
environments mlflow_hvd did not make. Real package metadata, real subprocesses."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import run_entry_point
from test_compat import _fake_distribution

from mlflow_hvd.cli import horovod, horovod_patches


def test_an_environment_with_its_horovod_is_seen_as_ready_without_importing_tensorflow() -> None:
    proc = run_entry_point("mlflow_hvd.cli.horovod")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Horovod 0.28.1 for TensorFlow ")
    assert proc.stdout.rstrip().endswith(f"is installed ({Path(sys.prefix) / horovod.MARKER})")
    marker = json.loads((Path(sys.prefix) / horovod.MARKER).read_text())
    assert marker == {"horovod": "0.28.1", "tensorflow": horovod.target().tensorflow,
                      "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
                      "cpu": horovod.cpu_id(), "torch": horovod.target().torch,
                      "patches": horovod.target().patches, "gpu": ""}


def test_check_loads_horovod_as_a_rank_does_and_reports_gloo() -> None:
    proc = run_entry_point("mlflow_hvd.cli.horovod", "--check")
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch = horovod.target().torch
    assert proc.stdout.strip().splitlines()[-1] == (
        f"Horovod 0.28.1 with Gloo and TensorFlow {horovod.target().tensorflow}"
        + (f" and PyTorch {torch}" if torch else ""))


def test_the_installed_extensions_are_optimised_and_carry_no_debug_information() -> None:
    """The no-debug-info patch reached the compiler: no DWARF section in either extension
    (a RelWithDebInfo build as released has .debug_info in both)."""
    from mlflow_hvd.common import compat

    extensions = [compat.horovod_tensorflow_extension(), compat.horovod_torch_extension()]
    assert all(extensions), extensions
    for extension in extensions:
        sections = subprocess.run(["readelf", "--section-headers", "--wide", str(extension)],
                                  capture_output=True, text=True, timeout=60, check=True).stdout
        names = re.findall(r"\]\s+(\.\S+)", sections)
        assert ".text" in names and ".dynsym" in names, sections[:2000]
        assert not [n for n in names if n.startswith(".debug")], (extension, names)


@pytest.mark.beside  # horovodrun's own check: ~25 s of imports in its own processes
def test_the_main_environment_builds_horovod_with_pytorch_and_its_check_build_says_so() -> None:
    """horovodrun's own report of the build: Gloo, TensorFlow and PyTorch, no MPI."""
    assert horovod.target().torch == "2.13.0+cpu"
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "horovodrun"),
                           "--check-build"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ticked = {line.split("]", 1)[1].strip() for line in proc.stdout.splitlines()
              if line.strip().startswith("[X]")}
    assert {"TensorFlow", "PyTorch", "Gloo"} <= ticked and "MPI" not in ticked, proc.stdout


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Horovod's sdist from the package index, checked against its sha256 as a build is."""
    return horovod.download_sdist(tmp_path_factory.mktemp("sdist"))


@pytest.fixture(scope="module")
def released(sdist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _unpacked(sdist, tmp_path_factory.mktemp("released"))


@pytest.fixture(scope="module")
def patched_trees() -> dict[tuple[str, ...], Path]:
    return {}


def _unpacked(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    (source,) = into.iterdir()
    return source


@pytest.mark.parametrize(("tensorflow", "torch", "for_cpu", "gpu", "names"), [
    ("2.16.2", "", False, False, []), ("2.18.1", "", False, False, []),
    ("2.18.1", "2.13.0+cpu", False, False, ["cxx17"]),
    ("2.19.1", "", False, False, ["xla-ops"]), ("2.20.0", "", False, False, ["xla-ops"]),
    ("2.21.0", "", False, False, ["xla-ops"]),
    ("2.21.0", "2.13.0+cpu", False, False, ["cxx17", "xla-ops"]),
    # a CUDA build of PyTorch (PyPI's) where a toolkit is usable: Horovod's own CUDA path
    ("2.21.0rc1", "2.14.1", False, False, ["cxx20", "xla-ops"]),
    # ... and on a machine without one: built for CPU tensors
    ("2.21.0", "2.14.1", True, False, ["cxx20", "torch-cpu", "xla-ops"]),
    ("2.18.1", "2.13.0", True, False, ["cxx17", "torch-cpu"]),
    # GPU operations asked for (NCCL): the TensorFlow extension loads beside tensorflow-cpu
    # ... and CMake's run path of the build machine left out
    ("2.21.0", "2.14.1", False, True, ["cxx20", "xla-ops", "tf-cpu-on-gpu", "gpu-runpath"]),
])
def test_each_versions_patches_apply_to_the_released_sdist_and_change_only_their_lines(
        sdist: Path, released: Path, patched_trees: dict[tuple[str, ...], Path],
        tmp_path_factory: pytest.TempPathFactory, tensorflow: str, torch: str, for_cpu: bool,
        gpu: bool, names: list[str]) -> None:
    patches = horovod_patches.needed(
        horovod_patches.Build(tensorflow, torch, for_cpu, gpu=gpu))
    cut = len(names) - 2 * gpu  # the two GPU patches come after no-debug-info
    names = [*names[:cut], "no-debug-info", *names[cut:]]
    assert [p.name for p in patches] == names  # in PATCHES' order; no-debug-info: every build
    key = tuple(names)
    if key not in patched_trees:  # versions that need the same patches share one tree
        out = tmp_path_factory.mktemp("patched")
        patched_trees[key] = _unpacked(horovod.patched_sdist(sdist, out / "sdist", patches),
                                       out / "tree")
    patched = patched_trees[key]
    files = sorted(p.relative_to(released) for p in released.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(patched) for p in patched.rglob("*") if p.is_file())
    edits = {(e.file, e.line): (e.released, e.patched) for p in patches for e in p.edits}
    changed = {}
    for name in files:
        if (released / name).read_bytes() != (patched / name).read_bytes():
            before = (released / name).read_text().split("\n")
            mine = {line: edit for (file, line), edit in edits.items() if file == str(name)}
            # each edit's line was as released, and is the edit's text (which may add lines)
            expected = [mine[n + 1][1] if n + 1 in mine else line
                        for n, line in enumerate(before)]
            assert (patched / name).read_text() == "\n".join(expected), name
            changed.update({(str(name), n): (before[n - 1], mine[n][1]) for n in mine
                            if before[n - 1] != mine[n][1]})
    assert changed == edits
    if "xla-ops" in names:  # the XLA ops' file compiles to nothing on TensorFlow >= 2.19
        assert changed[("horovod/tensorflow/xla_mpi_ops.cc", 23)][1] == (
            "#if TENSORFLOW_VERSION >= 2006000000 && TENSORFLOW_VERSION < 2019000000")
    standard = {"cxx17": "17", "cxx20": "20"}
    for name in set(standard) & set(names):  # torch's extension; Gloo and the rest C++17
        assert changed[("horovod/torch/CMakeLists.txt", 67)][1] == (
            f"    set(CMAKE_CXX_STANDARD {standard[name]})")
        assert changed[("CMakeLists.txt", 19)][1] == "set(CMAKE_CXX_STANDARD 17)"
    if "torch-cpu" in names:  # FindPytorch sees a CPU build of PyTorch
        assert changed[("cmake/Modules/FindPytorch.cmake", 25)][1] == (
            'execute_process(COMMAND ${PY_EXE} -c "print(False)"')
    # RelWithDebInfo's flags without -g, for C, C++ and CUDA: -O3 -DNDEBUG
    for line, lang in ((89, "C"), (90, "CXX"), (91, "CUDA")):
        assert changed[("CMakeLists.txt", line)] == (
            f'string(REPLACE "-O2" "-O3" CMAKE_{lang}_FLAGS_RELWITHDEBINFO '
            f'"${{CMAKE_{lang}_FLAGS_RELWITHDEBINFO}}")',
            f'string(REPLACE "-O2 -g" "-O3" CMAKE_{lang}_FLAGS_RELWITHDEBINFO '
            f'"${{CMAKE_{lang}_FLAGS_RELWITHDEBINFO}}")')


def test_a_patch_refuses_a_source_it_was_not_written_for(sdist: Path, tmp_path: Path) -> None:
    source = _unpacked(sdist, tmp_path)
    torch_cmake = source / "horovod/torch/CMakeLists.txt"
    torch_cmake.write_text(torch_cmake.read_text().replace(
        "    set(CMAKE_CXX_STANDARD 14)", "    set(CMAKE_CXX_STANDARD 11)"))
    top = (source / "CMakeLists.txt").read_text()
    with pytest.raises(horovod.InstallError) as info:
        horovod_patches.apply(
            source, horovod_patches.needed(horovod_patches.Build("2.21.0", "2.13.0+cpu")),
            "0.28.1")
    assert str(info.value) == (
        "cannot apply the cxx17 patch to Horovod 0.28.1: line 67 of "
        "horovod/torch/CMakeLists.txt is '    set(CMAKE_CXX_STANDARD 11)', expected "
        "'    set(CMAKE_CXX_STANDARD 14)' (another version or a modified sdist); nothing was "
        "built")
    assert (source / "CMakeLists.txt").read_text() == top  # checked before anything is written


def test_the_cache_key_names_both_frameworks_and_the_patches() -> None:
    both = horovod.Target("0.28.1", "2.18.1", "3.11", "x86_64-abc", "2.13.0+cpu", "cxx17")
    assert both.name.startswith("horovod-0.28.1-tf2.18.1-torch2.13.0+cpu-py3.11-x86_64-abc-p")
    assert both.flags()["HOROVOD_WITH_PYTORCH"] == "1"
    tf_only = horovod.Target("0.28.1", "2.16.2", "3.12", "x86_64-abc")
    assert tf_only.name == "horovod-0.28.1-tf2.16.2-py3.12-x86_64-abc"  # the sdist unchanged
    assert tf_only.flags()["HOROVOD_WITHOUT_PYTORCH"] == "1"
    newest = horovod.Target("0.28.1", "2.21.0", "3.11", "x86_64-abc", "2.13.0+cpu",
                            "cxx17,xla-ops")
    assert [p.name for p in newest.patch_set()] == ["cxx17", "xla-ops"]
    assert newest.name.rsplit("-p", 1)[1] != both.name.rsplit("-p", 1)[1]
    torch_only = horovod.Target("0.28.1", "", "3.11", "x86_64-abc", "2.13.0+cpu", "cxx17")
    assert torch_only.name.startswith("horovod-0.28.1-torch2.13.0+cpu-py3.11-x86_64-abc-p")
    assert (torch_only.flags()["HOROVOD_WITHOUT_TENSORFLOW"],
            torch_only.flags()["HOROVOD_WITH_PYTORCH"]) == ("1", "1")
    assert "HOROVOD_WITH_TENSORFLOW" not in torch_only.flags()
    assert both.flags()["HOROVOD_WITH_TENSORFLOW"] == "1"
    assert (torch_only.extensions(), both.extensions(), tf_only.extensions()) == (
        ("torch",), ("tensorflow", "torch"), ("tensorflow",))
    assert torch_only.frameworks() == "PyTorch 2.13.0+cpu"


def test_horovod_is_built_for_the_frameworks_installed_pytorch_alone_included(
        tmp_path: Path) -> None:
    """The target is read from package metadata: PyTorch alone is a build without
    TensorFlow, whose patches are only those that concern PyTorch's sources and Horovod's
    own; with neither framework, the command refuses before anything is downloaded."""
    code = ("import json\nfrom mlflow_hvd.cli import horovod\nt = horovod.target({})\n"
            "print(json.dumps([t.tensorflow, t.torch, t.patches, t.frameworks()]))\n")
    site = tmp_path / "site"
    site.mkdir()
    hidden = ("import importlib.metadata as md, mlflow_hvd.common.compat as c\nreal = md.version\n"
              "def version(name):\n"
              "    if name.startswith(('tensorflow', 'torch')) and name not in SHOWN:\n"
              "        raise md.PackageNotFoundError(name)\n"
              "    return real(name)\n"
              "c.version = version\n")
    for shown, expected in (
            (("torch",), ["", version_of("torch"), "cxx17,no-debug-info",
                          f"PyTorch {version_of('torch')}"]),
            (("tensorflow-cpu",), [version_of("tensorflow-cpu"), "", "xla-ops,no-debug-info",
                                   f"TensorFlow {version_of('tensorflow-cpu')}"])):
        proc = subprocess.run([sys.executable, "-c", f"SHOWN = {shown!r}\n" + hidden + code],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout) == expected
    proc = subprocess.run([sys.executable, "-c", "SHOWN = ()\n" + hidden + (
        "from mlflow_hvd.cli import horovod\nraise SystemExit(horovod.main([]))\n")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "MLFLOW_HVD_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: Neither PyTorch nor TensorFlow is installed in this environment ({sys.prefix}): "
        "Horovod is built against the frameworks it finds. Install PyTorch >=2.13,<2.15 (pip "
        "install 'mlflow_hvd[torch]') or TensorFlow >=2.16,<2.22 (pip install "
        "'mlflow_hvd[tensorflow-cpu]' (or 'mlflow_hvd[tensorflow]' for GPUs)), or both, first")
    assert not (tmp_path / "cache").exists()  # nothing was downloaded or built


def version_of(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)


def _cached(root: Path, t: horovod.Target, tag: str = "cp311-cp311") -> Path:
    """A wheel in the cache as a build leaves it: its directory, named for its target, with
    the target recorded beside it."""
    directory = root / t.name
    directory.mkdir(parents=True)
    wheel = directory / f"horovod-0.28.1-{tag}-linux_x86_64.whl"
    wheel.write_bytes(b"")
    (directory / horovod.TARGET_FILE).write_text(json.dumps(
        {"horovod": t.horovod, "tensorflow": t.tensorflow, "python": t.python, "cpu": t.cpu,
         "torch": t.torch, "patches": t.patches}))
    return wheel


def test_an_environment_without_pytorch_takes_a_wheel_built_with_pytorch_as_well(
        tmp_path: Path) -> None:
    """The quickstart's venv (TensorFlow only) on a machine whose main environment built
    Horovod against the same TensorFlow, Python and CPU with PyTorch too: no second build."""
    both = horovod.Target("0.28.1", "2.21.0", "3.11", "x86_64-abc", "2.13.0+cpu",
                          "cxx17,xla-ops")
    wheel = _cached(tmp_path, both)
    _cached(tmp_path, horovod.Target("0.28.1", "2.20.0", "3.11", "x86_64-abc", "2.13.0+cpu",
                                     "cxx17,xla-ops"))
    _cached(tmp_path, horovod.Target("0.28.1", "2.21.0", "3.13", "x86_64-abc", "2.14.1",
                                     "cxx20,torch-cpu,xla-ops"), tag="cp313-cp313")
    (tmp_path / "horovod-being-built.x1y2").mkdir()  # a build in progress: nothing recorded
    tf_only = horovod.Target("0.28.1", "2.21.0", "3.11", "x86_64-abc", "", "xla-ops")
    assert horovod.serving_wheel(tf_only, tmp_path) == wheel
    # another TensorFlow, Python or CPU: none
    for other in (horovod.Target("0.28.1", "2.19.1", "3.11", "x86_64-abc", "", "xla-ops"),
                  horovod.Target("0.28.1", "2.21.0", "3.12", "x86_64-abc", "", "xla-ops"),
                  horovod.Target("0.28.1", "2.21.0", "3.11", "x86_64-def", "", "xla-ops")):
        assert horovod.serving_wheel(other, tmp_path) is None, other
    # an environment with PyTorch needs a wheel built against that PyTorch: never another's
    assert horovod.serving_wheel(both, tmp_path) is None
    tf_only_wheel = _cached(tmp_path / "only", tf_only)
    assert horovod.serving_wheel(both, tmp_path / "only") is None
    assert horovod.serving_wheel(tf_only, tmp_path / "only") is None  # its own: by its name
    assert tf_only_wheel.parent.name == tf_only.name


def test_a_tensorflow_outside_the_range_is_refused_before_any_build(tmp_path: Path) -> None:
    fake = _fake_distribution(tmp_path / "site", "tensorflow", "2.22.0")
    proc = run_entry_point("mlflow_hvd.cli.horovod", path=fake,
                env={"MLFLOW_HVD_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: TensorFlow 2.22.0 (installed here) is not supported: mlflow_hvd works with "
        "TensorFlow >=2.16,<2.22 (2.16 is the first whose tf.keras is Keras 3; 2.21 the newest "
        "released, which Horovod 0.28.1 builds against with the patches of "
        "mlflow_hvd/cli/horovod_patches.py). Install a version in that range")
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_tensorflow_2_20_beside_protobuf_7_is_refused_before_any_build(tmp_path: Path) -> None:
    fake = _fake_distribution(tmp_path / "site", "tensorflow", "2.20.0")
    _fake_distribution(fake, "protobuf", "7.36.2")
    proc = run_entry_point("mlflow_hvd.cli.horovod", path=fake,
                env={"MLFLOW_HVD_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith(
        "error: TensorFlow 2.20.0 (installed here) does not work with protobuf 7.36.2"), proc.stderr
    assert "Install 'protobuf<7'" in proc.stderr
    assert not (tmp_path / "cache").exists()


def test_a_wheel_without_the_pytorch_extension_is_refused(tmp_path: Path) -> None:
    import sysconfig
    import zipfile

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    wheel = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:  # the extension landed outside the package
        zf.writestr(f"horovod/tensorflow/mpi_lib{suffix}", b"")
        zf.writestr(f"root/build/horovod/torch/mpi_lib_v2{suffix}", b"")
    t = horovod.Target("0.28.1", "2.18.1", "3.11", "x86_64-abc", "2.13.0+cpu")
    with pytest.raises(horovod.InstallError) as info:
        horovod.check_wheel(wheel, t)
    assert str(info.value) == (
        "the Horovod wheel built for TensorFlow 2.18.1 and PyTorch 2.13.0+cpu lacks "
        f"horovod/torch/mpi_lib_v2{suffix}; nothing was cached or installed")
    horovod.check_wheel(wheel, horovod.Target("0.28.1", "2.18.1", "3.11", "x86_64-abc"))
    with pytest.raises(horovod.InstallError, match=(  # a PyTorch-only build needs only its own
            r"^the Horovod wheel built for PyTorch 2.13.0\+cpu lacks horovod/torch/")):
        horovod.check_wheel(wheel, horovod.Target("0.28.1", "", "3.11", "x86_64-abc",
                                                  "2.13.0+cpu"))


def _fake_torch(site: Path, version: str, cuda: str | None) -> Path:
    """A PyTorch distribution as pip installs one, with its ``torch/version.py``."""
    _fake_distribution(site, "torch", version)
    (site / "torch").mkdir()
    (site / "torch" / "version.py").write_text(
        "from typing import Optional\n\n__all__ = ['__version__', 'cuda']\n"
        f"__version__ = '{version}'\ncuda: Optional[str] = {cuda!r}\ngit_version = 'abc'\n")
    return site


def _toolkit(root: Path, nvcc: bool = True, cudart: str | None = "lib64") -> Path:
    if nvcc:
        (root / "bin").mkdir(parents=True)
        (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
        (root / "bin" / "nvcc").chmod(0o755)
    if cudart:
        (root / cudart).mkdir(parents=True)
        (root / cudart / "libcudart.so.13").write_bytes(b"")
    root.mkdir(parents=True, exist_ok=True)
    return root


def test_a_cuda_build_of_pytorch_is_read_from_its_version_file(tmp_path: Path) -> None:
    from mlflow_hvd.cli import cuda_toolkit

    cuda = _fake_torch(tmp_path / "cuda", "2.14.1", "13.0")
    cpu = _fake_torch(tmp_path / "cpu", "2.13.0+cpu", None)
    assert cuda_toolkit.torch_cuda([str(cuda)]) == "13.0"
    assert cuda_toolkit.torch_cuda([str(cpu)]) == ""
    assert cuda_toolkit.torch_cuda([str(tmp_path / "none")]) == ""


def test_a_toolkit_is_usable_only_with_nvcc_and_its_runtime_library(tmp_path: Path) -> None:
    from mlflow_hvd.cli import cuda_toolkit

    whole = _toolkit(tmp_path / "whole", cudart="lib")
    assert cuda_toolkit.find_toolkit({"CUDA_HOME": str(whole)}).usable
    # a nvcc on PATH whose prefix has no runtime (what this machine image carries)
    part = _toolkit(tmp_path / "part", cudart=None)
    found = cuda_toolkit.find_toolkit({"PATH": str(part / "bin")})
    assert (found.home, found.usable) == (str(part), False)
    assert found.describe() == (
        f"the CUDA toolkit at {part} is not usable: no libcudart under {part / 'lib64'} or "
        f"{part / 'lib'}")
    libs_only = _toolkit(tmp_path / "libs", nvcc=False)
    assert cuda_toolkit.find_toolkit({"CUDA_PATH": str(libs_only)}).missing == (
        f"no {libs_only / 'bin' / 'nvcc'}")
    # Horovod's own setting first
    assert cuda_toolkit.find_toolkit({"HOROVOD_CUDA_HOME": str(whole),
                                      "CUDA_HOME": str(part)}).home == str(whole)


def test_a_gpu_build_looks_past_an_nvcc_wrapper_to_the_default_toolkit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``nvcc`` on PATH can be a wrapper script outside its toolkit (``/usr/local/bin``):
    PyTorch's helpers then take ``/usr/local``; a GPU build takes ``/usr/local/cuda`` when
    that is usable, and a toolkit the user named as it is."""
    from mlflow_hvd.cli import cuda_toolkit

    whole = _toolkit(tmp_path / "cuda")
    wrapper = _toolkit(tmp_path / "usr-local", cudart=None)
    monkeypatch.setattr(cuda_toolkit, "DEFAULT_HOME", str(whole))
    env = {"PATH": str(wrapper / "bin")}
    assert cuda_toolkit.find_toolkit(env).home == str(wrapper)  # PyTorch's choice
    assert cuda_toolkit.gpu_toolkit(env).home == str(whole)
    monkeypatch.setattr(cuda_toolkit, "torch_cuda", lambda path=None: "13.0")
    assert cuda_toolkit.torch_for_cpu(env) is True  # PyTorch's choice, not usable
    assert cuda_toolkit.gpu_toolkit({**env, "CUDA_HOME": str(wrapper)}).home == str(wrapper)
    monkeypatch.setattr(cuda_toolkit, "DEFAULT_HOME", str(tmp_path / "none"))
    found = cuda_toolkit.gpu_toolkit(env)
    assert (found.home, found.usable) == (str(wrapper), False)  # named in the error


def test_an_extensions_check_names_its_gpu_build_and_what_a_node_lacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow_hvd.common.horovod_probe import ExtensionCheck

    gpu = ExtensionCheck("torch", True, True, "0.28.1", "2.14.1", "", 23007, True)
    assert gpu.describe() == "Horovod 0.28.1 with Gloo, CUDA and NCCL 2.30.7 and PyTorch 2.14.1"
    cpu = ExtensionCheck("tensorflow", True, True, "0.28.1", "2.21.0", "")
    assert cpu.describe() == "Horovod 0.28.1 with Gloo and TensorFlow 2.21.0"
    lacking = ExtensionCheck("tensorflow", False, False, "", "", (
        "ImportError: libnccl.so.2: cannot open shared object file: No such file or directory"))
    assert lacking.describe().endswith(
        "(libnccl.so* is missing: this Horovod was built with NCCL: install it in this "
        "environment (pip install nvidia-nccl-cu13, or -cu12 as the build's CUDA) or the "
        "system's (libnccl2))")
    # a GPU build that came out without NCCL fails its check, naming how to rebuild
    tf_gpu = ExtensionCheck("tensorflow", True, True, "0.28.1", "2.21.0", "", 0, True)
    monkeypatch.setattr(horovod, "load_extensions", lambda names, timeout: (tf_gpu,))
    tf_only = horovod.Target("0.28.1", "2.21.0", "3.11", "x86_64-abc")
    assert horovod.verify(tf_only) == "Horovod 0.28.1 with Gloo, CUDA and TensorFlow 2.21.0"
    nccl = "HOROVOD_GPU_OPERATIONS=NCCL"
    with pytest.raises(horovod.InstallError, match=(
            r"built without NCCL though HOROVOD_GPU_OPERATIONS=NCCL asked for it. Rebuild it: "
            r"HOROVOD_GPU_OPERATIONS=NCCL python -m mlflow_hvd.cli.horovod --rebuild")):
        horovod.verify(dataclasses.replace(tf_only, gpu=nccl))
    both = (dataclasses.replace(tf_gpu, nccl=23007), gpu)
    monkeypatch.setattr(horovod, "load_extensions", lambda names, timeout: both)
    assert horovod.verify(dataclasses.replace(tf_only, torch="2.14.1", gpu=nccl)) == (
        "Horovod 0.28.1 with Gloo, CUDA and NCCL 2.30.7 and TensorFlow 2.21.0 and PyTorch 2.14.1")


def test_pytorch_is_built_for_cpu_tensors_only_when_cuda_but_no_usable_toolkit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow_hvd.cli import cuda_toolkit

    part = str(_toolkit(tmp_path / "part", cudart=None))
    whole = str(_toolkit(tmp_path / "whole"))
    monkeypatch.setattr(cuda_toolkit, "torch_cuda", lambda path=None: "13.0")
    assert cuda_toolkit.torch_for_cpu({"CUDA_HOME": part}) is True
    assert cuda_toolkit.torch_for_cpu({"CUDA_HOME": whole}) is False  # Horovod's own build
    monkeypatch.setattr(cuda_toolkit, "torch_cuda", lambda path=None: "")
    # a CPU build of PyTorch: Horovod's own build, whatever toolkit is here
    assert cuda_toolkit.torch_for_cpu({"CUDA_HOME": part}) is False


def test_a_gpu_build_finds_nccl_where_the_user_has_it_and_says_what_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HOROVOD_GPU_OPERATIONS=NCCL: the toolkit goes to PyTorch's helpers as well as to
    Horovod; NCCL from NVIDIA's wheel in site-packages (shared, its soname linked for
    Horovod's search, found at run time beside Horovod), or as the user set it; none at all,
    or no usable toolkit, is refused naming what to install."""
    from mlflow_hvd.cli import gpu_build
    from mlflow_hvd.errors import InstallError

    cuda = _toolkit(tmp_path / "cuda")
    site, work = tmp_path / "site", tmp_path / "work"
    nccl = site / "nvidia" / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    (nccl / "lib").mkdir()
    (nccl / "lib" / "libnccl.so.2").write_bytes(b"\x7fELF")
    asked = {"HOROVOD_GPU_OPERATIONS": "NCCL", "CUDA_HOME": str(cuda), "PATH": "",
             "LDFLAGS": "-L/opt/x"}
    env = gpu_build.build_env(asked, site, work)
    assert env["CUDA_HOME"] == env["HOROVOD_CUDA_HOME"] == str(cuda)
    assert env["HOROVOD_NCCL_INCLUDE"] == str(nccl / "include")
    assert env["HOROVOD_NCCL_LINK"] == "SHARED"
    linked = Path(env["HOROVOD_NCCL_LIB"]) / "libnccl.so"
    assert linked.resolve() == (nccl / "lib" / "libnccl.so.2").resolve()
    assert env["LDFLAGS"] == "-L/opt/x -Wl,-rpath,$ORIGIN/../../nvidia/nccl/lib"
    assert gpu_build.asked(asked) == "HOROVOD_GPU_OPERATIONS=NCCL"

    # the user's NCCL: Horovod's search, and a run path to its libraries (the build keeps
    # none of CMake's: the gpu-runpath patch)
    own = gpu_build.build_env({**asked, "HOROVOD_NCCL_HOME": "/opt/nccl"}, site, work)
    assert own == {"CUDA_HOME": str(cuda), "HOROVOD_CUDA_HOME": str(cuda),
                   "LDFLAGS": "-L/opt/x -Wl,-rpath,/opt/nccl/lib"}
    own = gpu_build.build_env({**asked, "HOROVOD_NCCL_LIB": "/opt/nccl/lib64"}, site, work)
    assert own["LDFLAGS"] == "-L/opt/x -Wl,-rpath,/opt/nccl/lib64"

    with pytest.raises(InstallError, match=r"asks Horovod for NCCL, and none is here: "
                                           r"install NVIDIA's wheel for your CUDA"):
        gpu_build.build_env(asked, tmp_path / "empty-site", work)
    with pytest.raises(InstallError, match=r"HOROVOD_GPU_OPERATIONS=NCCL asks Horovod for "
                                           r"GPU operations, but the CUDA toolkit at .* is "
                                           r"not usable: no .*nvcc"):
        gpu_build.build_env({**asked, "CUDA_HOME": str(tmp_path)}, site, work)
    # against a CUDA build of PyTorch: the toolkit to install is the one it was built with
    monkeypatch.setattr(gpu_build.cuda_toolkit, "torch_cuda", lambda path=None: "13.0")
    with pytest.raises(InstallError, match=r"not usable: no .*nvcc.*\. Install the CUDA "
                                           r"toolkit 13\.0 that PyTorch was built with \(nvcc"):
        gpu_build.build_env({**asked, "CUDA_HOME": str(tmp_path)}, site, work)


def test_a_gpu_build_against_a_cpu_build_of_pytorch_is_refused_before_anything_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HOROVOD_GPU_OPERATIONS with PyTorch's CPU build (``+cpu``, torch.version.cuda None):
    refused naming both ways out, before the sdist is fetched; with PyTorch's CUDA build the
    same environment is a GPU target."""
    from mlflow_hvd.cli import cuda_toolkit

    asked = {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_GPU_ALLREDUCE": "NCCL"}
    torch = horovod.compat.TORCH.installed()  # the test environment's: 2.13.0+cpu
    assert torch
    monkeypatch.setattr(cuda_toolkit, "torch_cuda", lambda path=None: "")
    with pytest.raises(horovod.InstallError, match=(
            r"^HOROVOD_GPU_ALLREDUCE=NCCL,HOROVOD_GPU_OPERATIONS=NCCL asks Horovod for GPU "
            rf"operations, but PyTorch {re.escape(torch)} here is a CPU build "
            r"\(torch\.version\.cuda is None\) .* or unset HOROVOD_GPU_ALLREDUCE, "
            r"HOROVOD_GPU_OPERATIONS for the CPU build; nothing was built$")):
        horovod.target(asked)
    assert horovod.target({}).gpu == ""  # the CPU build as ever
    monkeypatch.setattr(cuda_toolkit, "torch_cuda", lambda path=None: "13.0")
    assert horovod.target(asked).gpu == "HOROVOD_GPU_ALLREDUCE=NCCL,HOROVOD_GPU_OPERATIONS=NCCL"


def test_a_gpu_build_is_another_wheel_and_a_cpu_builds_name_and_marker_stay() -> None:
    """The wheel cache's key names GPU operations only when asked for: a CPU build's
    directory is the one it always was, and an install marker written before the field
    existed still matches."""
    t = horovod.Target("0.28.1", "2.21.0", "3.11", "x86_64-7808973848ef", "2.13.0+cpu",
                       "cxx17,xla-ops,no-debug-info")
    assert t.name == "horovod-0.28.1-tf2.21.0-torch2.13.0+cpu-py3.11-x86_64-7808973848ef-p5788b80a"
    gpu = dataclasses.replace(t, gpu="HOROVOD_GPU_OPERATIONS=NCCL")
    assert gpu.name != t.name and "-gpu" in gpu.name
    old_marker = {k: v for k, v in dataclasses.asdict(t).items() if k != "gpu"}
    assert horovod.Target(**old_marker) == t


def test_an_installed_gpu_build_is_kept_unless_the_cpu_build_is_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain command (and `mlflow run`'s environment completion) keeps the NCCL build a
    user installed for these versions: it runs CPU ranks too; `--cpu` replaces it, a build
    for other versions is replaced, and `--cpu` with a GPU switch is refused."""
    from mlflow_hvd.cli import gpu_build

    cpu_t = horovod.Target("0.28.1", "2.21.0", "3.13", "x86_64-0", "2.14.1",
                           "cxx20,torch-cpu,xla-ops,no-debug-info")
    gpu_t = horovod.Target("0.28.1", "2.21.0", "3.13", "x86_64-0", "2.14.1",
                           "cxx20,xla-ops,no-debug-info,tf-cpu-on-gpu,gpu-runpath",
                           "HOROVOD_GPU_OPERATIONS=NCCL")
    marker = tmp_path / "marker.json"
    marker.write_text(json.dumps(dataclasses.asdict(gpu_t)))
    monkeypatch.delenv("HOROVOD_GPU_OPERATIONS", raising=False)
    monkeypatch.setattr(horovod, "_marker", lambda: marker)
    monkeypatch.setattr(horovod, "target", lambda environ=os.environ:
                        gpu_t if gpu_build.asked(environ) else cpu_t)
    # what is installed: the marker's build (the real check also asks pip and the files)
    monkeypatch.setattr(horovod, "installed_matches",
                        lambda t: horovod.Target(**json.loads(marker.read_text())) == t)
    monkeypatch.setattr(horovod, "cache_root", lambda: tmp_path / "wheels")

    class Built(Exception):
        pass

    def build(t: horovod.Target, dest: Path) -> Path:
        raise Built(t)

    monkeypatch.setattr(horovod, "build_wheel", build)
    assert horovod.installed_gpu_build() == gpu_t
    changed, said = horovod.ensure()
    assert not changed
    assert said == (f"Horovod 0.28.1 for TensorFlow 2.21.0 and PyTorch 2.14.1 is installed, "
                    f"built with HOROVOD_GPU_OPERATIONS=NCCL: it runs CPU ranks as well "
                    f"({marker}; --cpu installs the CPU build instead)")
    with pytest.raises(Built) as built:
        horovod.ensure(cpu=True)
    assert built.value.args[0] == cpu_t
    monkeypatch.setenv("HOROVOD_GPU_OPERATIONS", "NCCL")
    with pytest.raises(horovod.InstallError, match=r"^--cpu asks for the CPU build, and "
                       r"HOROVOD_GPU_OPERATIONS=NCCL for a GPU build: unset one$"):
        horovod.ensure(cpu=True)
    monkeypatch.delenv("HOROVOD_GPU_OPERATIONS")
    marker.write_text(json.dumps(dataclasses.asdict(
        dataclasses.replace(gpu_t, torch="2.13.0"))))  # built for another PyTorch
    assert horovod.installed_gpu_build() is None
    with pytest.raises(Built):
        horovod.ensure()
